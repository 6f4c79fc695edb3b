"""SamplingInputs: a step's SamplingMetadata from RequestState, reusing its request-constant part across steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import LogprobsMode
from engine.host_copy import to_device
from engine.sample import SamplingMetadata
from engine.sample.random_sampling import SeededKeys, mix_seeds
from engine.sampling_params import SamplingParams
from engine.worker.request_state import RequestState


@dataclass
class _RequestConstant:
    """What a step's sampling inputs take from its entries' requests alone (their slots and SamplingParams),
    not from how far each has got: the same for every step in which the same requests sample in the same order.
    Device tensors are only read by the sampler, so steps share them."""

    version: int  # RequestState.version when built: no request joined or left the runner since
    slots: np.ndarray  # [S] the entries' slots
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    max_top_k: int | None
    penalties: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]  # presence, frequency, repetition
    prompt_token_ids: torch.Tensor | None
    need_outputs: bool  # penalties or bad words read each entry's output so far
    seeded_entries: np.ndarray  # [K] entries whose request has a seed (and samples)
    seeds: np.ndarray  # [K] uint64, their seeds
    # entry -> (min_tokens, the ids it bans until then) for entries with min_tokens; others' edits by entry.
    min_tokens: dict[int, tuple[int, set[int]]]
    logit_bias: dict[int, dict[int, float]]
    bad_words_token_ids: dict[int, list[list[int]]]
    allowed_token_ids_mask: torch.Tensor | None
    max_num_logprobs: int | None


class SamplingInputs:
    """Builds the model runner's SamplingMetadata: one sample per entry (a batch row; rows may repeat)."""

    def __init__(self, state: RequestState, device: torch.device, vocab_size: int, logprobs_mode: LogprobsMode,
                 eos_token_ids: dict[str, int | None]) -> None:
        """eos_token_ids: the runner's req_id -> EOS id (min_tokens bans it too, unless the request ignores EOS)."""
        self.state = state
        self.device = device
        self.vocab_size = vocab_size
        self.logprobs_mode = logprobs_mode
        self.eos_token_ids = eos_token_ids
        self._last: _RequestConstant | None = None

    def _h2d(self, array: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(array), self.device)

    def clear(self) -> None:
        """Drops the reused request-constant inputs and their device tensors (the runner forgot its requests: a
        shutting-down worker must give their memory back)."""
        self._last = None

    def metadata(self, slots: np.ndarray, req_ids: list[str], rows: np.ndarray,
                 offsets: np.ndarray | None = None) -> SamplingMetadata:
        """slots: [S] each entry's RequestState slot; entry i is batch row rows[i], whose request is req_ids[rows[i]].

        offsets (speculative steps): entry i samples the token offsets[i] places after the row's
        known tokens, i.e. after its first offsets[i] drafts, which count as its output so far.
        """
        st = self.state
        const = self._last
        if const is None or const.version != st.version or not np.array_equal(const.slots, slots):
            const = self._last = self._request_constant(slots, req_ids, rows)
        ends = st.num_tokens[slots] if offsets is None else st.num_tokens[slots] + offsets  # [S] history ends
        num_outputs = ends - st.num_prompt_tokens[slots]  # [S]
        # Seeded entries' noise keys, all at once (random_sampling.SeededKeys): seed and output position.
        seeded = const.seeded_entries
        generators = SeededKeys(seeded, mix_seeds(const.seeds, num_outputs[seeded]) if len(seeded) else seeded)
        output_token_ids = (
            [st.token_ids[s, st.num_prompt_tokens[s] : e].tolist() for s, e in zip(slots.tolist(), ends.tolist())]
            if const.need_outputs else []
        )
        presence, frequency, repetition = const.penalties
        return SamplingMetadata(
            temperature=const.temperature,
            all_greedy=const.all_greedy,
            all_random=const.all_random,
            top_k=const.top_k,
            top_p=const.top_p,
            min_p=const.min_p,
            generators=generators,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            prompt_token_ids=const.prompt_token_ids,
            output_token_ids=output_token_ids,
            min_tokens={i: banned for i, banned in const.min_tokens.items() if num_outputs[i] < banned[0]},
            logit_bias=const.logit_bias,
            bad_words_token_ids=const.bad_words_token_ids,
            allowed_token_ids_mask=const.allowed_token_ids_mask,
            max_num_logprobs=const.max_num_logprobs,
            logprobs_mode=self.logprobs_mode,
            max_top_k=const.max_top_k,
        )

    def _request_constant(self, slots: np.ndarray, req_ids: list[str], rows: np.ndarray) -> _RequestConstant:
        st = self.state
        # Per-entry edits (min_tokens, allowed ids, bad words, logit bias) look at the SamplingParams of the
        # entries that have any: none in the usual batch, so no per-entry Python then.
        edit_entries = np.flatnonzero(st.uses_row_params[slots]).tolist()
        params: dict[int, SamplingParams] = {i: st.sampling_params[int(slots[i])] for i in edit_entries}
        temperature = st.column("temperature")[slots]  # [S] numpy
        greedy = temperature == 0.0

        def column(name: str, off_value: float) -> torch.Tensor | None:
            col = st.column(name)[slots]  # numpy: a small gather and test cost several times less than torch's
            return self._h2d(col) if (col != off_value).any() else None

        penalties = [st.column(name)[slots] for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")]
        use_penalties = bool((penalties[0] != 0).any() or (penalties[1] != 0).any() or (penalties[2] != 1).any())
        prompt_token_ids = None
        if use_penalties:
            max_prompt = int(st.num_prompt_tokens[slots].max())
            padded = np.full((len(slots), max_prompt), self.vocab_size, dtype=np.int64)
            for i, s in enumerate(slots.tolist()):
                prompt = st.prompt_ids(s)
                padded[i, : len(prompt)] = prompt
            prompt_token_ids = self._h2d(padded)

        min_tokens = {}
        for i, sp in params.items():
            if sp.min_tokens:
                stop_ids = sp.all_stop_token_ids
                eos = self.eos_token_ids.get(req_ids[rows[i]])
                if eos is not None and not sp.ignore_eos:
                    stop_ids = stop_ids | {eos}
                min_tokens[i] = (sp.min_tokens, stop_ids)

        allowed_mask = None
        if any(sp.allowed_token_ids for sp in params.values()):
            allowed_mask = torch.zeros(len(slots), self.vocab_size, dtype=torch.bool)
            for i, sp in params.items():
                if sp.allowed_token_ids:
                    allowed_mask[i] = True
                    allowed_mask[i, sp.allowed_token_ids] = False
            allowed_mask = to_device(allowed_mask, self.device)

        seeded_entries = np.flatnonzero(st.seeded[slots])
        wanted = int(st.num_logprobs[slots].max()) if len(slots) else -1  # -1: no entry asks for logprobs
        top_k = column("top_k", 0)
        return _RequestConstant(
            version=st.version,
            slots=slots.copy(),
            temperature=self._h2d(temperature),
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            top_k=top_k,
            top_p=column("top_p", 1.0),
            min_p=column("min_p", 0.0),
            max_top_k=int(st.column("top_k")[slots].max()) if top_k is not None else None,
            # All three columns when any is in use, the neutral ones included.
            penalties=tuple(self._h2d(col) for col in penalties) if use_penalties else (None, None, None),
            prompt_token_ids=prompt_token_ids,
            need_outputs=use_penalties or any(sp.bad_words_token_ids for sp in params.values()),
            seeded_entries=seeded_entries,
            seeds=st.seed[slots[seeded_entries]],
            min_tokens=min_tokens,
            logit_bias={i: sp.logit_bias for i, sp in params.items() if sp.logit_bias},
            bad_words_token_ids={i: sp.bad_words_token_ids for i, sp in params.items() if sp.bad_words_token_ids},
            allowed_token_ids_mask=allowed_mask,
            max_num_logprobs=wanted if wanted >= 0 else None,
        )
