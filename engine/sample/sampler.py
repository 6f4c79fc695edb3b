"""The Sampler: turns one step's logits and SamplingMetadata into sampled tokens and logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import use_triton
from engine.kernels.sampling import gumbel_sample
from engine.kernels.top_p import top_p_sample_triton
from engine.sample.logits_processors import apply_allowed_token_ids, apply_bad_words, apply_logit_bias, apply_min_tokens
from engine.sample.logprobs import LogprobsTensors, gather_logprobs
from engine.sample.metadata import SamplingMetadata
from engine.sample.penalties import apply_penalties
from engine.sample.random_sampling import sampling_keys
from engine.sample.topk_topp import apply_min_p, apply_temperature, apply_top_k_top_p, top_k_lower

# Same threshold as SamplingParams.greedy, so a near-zero temperature never divides logits.
_GREEDY_EPS = 1e-5


@dataclass
class SamplerOutput:
    """One token per row, plus logprobs when any row asked for them."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


def _has_penalties(md: SamplingMetadata) -> bool:
    return any(t is not None for t in (md.presence_penalties, md.frequency_penalties, md.repetition_penalties))


def _has_processors(md: SamplingMetadata) -> bool:
    return bool(md.allowed_token_ids_mask is not None or md.bad_words_token_ids or md.min_tokens or md.logit_bias)


def _has_shaping(md: SamplingMetadata) -> bool:
    """Top-k, top-p or min-p: they need the temperature-scaled float32 logits as a tensor."""
    return any(t is not None for t in (md.top_k, md.top_p, md.min_p))


class Sampler:
    """Stateless apart from an optional generator for rows without their own seed.

    Order of work (each step only when some row uses it):
      1. raw snapshot (raw_* logprobs modes)
      2. allowed_token_ids, bad words, min_tokens, logit_bias
      3. presence / frequency / repetition penalties
      4. random rows: temperature, top-k / top-p, min-p (greedy rows get neutral values, so
         their processed logits are exactly the penalized ones)
      5. processed snapshot (processed_* modes)
      6. one-pass Gumbel-max with counter-based noise keyed by (seed, position) for seeded
         rows, by a fresh draw from the generator for the others; greedy rows (key -1) take
         the argmax of the logits so far
      7. logprobs of the sampled token plus the top-K from the chosen snapshot

    The caller's logits may be in the model's dtype (bf16 on GPU): every step that does
    arithmetic on them works on a float32 copy, made once, and the plain cases (no edits,
    penalties, shaping or logprobs) read them as they are, upcasting in the kernel.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Noise keys for unseeded rows; None uses torch's default generator.
        self.generator = generator

    def _keys(
        self, md: SamplingMetadata, num_rows: int, greedy_mask: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        """The rows' noise keys ([B] int64), -1 for greedy rows."""
        keys = sampling_keys(num_rows, md.generators, self.generator, device)  # [B]
        return keys if greedy_mask is None else keys.masked_fill(greedy_mask, -1)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        wants_logprobs = md.max_num_logprobs is not None
        edits = _has_processors(md) or _has_penalties(md)
        if md.all_greedy and not wants_logprobs and not edits:
            # Fast path: nothing changes the argmax (of the logits in any dtype: upcasting is exact).
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1), logprobs=None)

        temperature = md.temperature.to(logits.device)  # [B]
        greedy_mask = None if md.all_random else temperature < _GREEDY_EPS  # [B] bool
        if not md.all_greedy and not wants_logprobs and not edits and not _has_shaping(md):
            # Fast path: one kernel pass over the caller's logits divides by the temperature and
            # draws in registers: the same float32 values and tokens as the path below, without
            # writing [B, V] float32 out.
            keys = self._keys(md, logits.shape[0], greedy_mask, logits.device)  # [B]
            return SamplerOutput(sampled_token_ids=gumbel_sample(logits, keys, temperature), logprobs=None)
        if (not md.all_greedy and not wants_logprobs and not edits and md.min_p is None and md.top_p is not None
                and use_triton(logits) and logits.stride(-1) == 1):
            # GPU fast path with top-p (and top-k): draw over the top-k set, keep the draw when it lies in the
            # nucleus (one count), else draw again above it; only rows still undecided after that search for
            # their boundary (engine/kernels/top_p.py). The same tokens as the path below, on the caller's
            # logits, without a float32 copy or a host sync.
            top_k, top_p = md.top_k, md.top_p.to(logits.device)
            nucleus_temp = temperature
            if greedy_mask is not None:
                top_k = None if top_k is None else top_k.to(logits.device).masked_fill(greedy_mask, 0)
                top_p = top_p.masked_fill(greedy_mask, 1.0)
                nucleus_temp = temperature.masked_fill(greedy_mask, 1.0)  # never divides: greedy rows keep every token
            lower = top_k_lower(logits, top_k, md.max_top_k)
            keys = self._keys(md, logits.shape[0], greedy_mask, logits.device)  # [B]
            tokens = top_p_sample_triton(logits, keys, top_p, lower, temperature, nucleus_temp)
            return SamplerOutput(sampled_token_ids=tokens, logprobs=None)

        scaled = False
        if md.all_greedy or edits or (wants_logprobs and md.logprobs_mode.startswith("raw")):
            # Own copy: the caller's logits are never modified.
            logits = logits.to(torch.float32, copy=True)  # [B, V]
        else:
            # Own float32 copy and temperature in one pass: nothing before (4) needs the unscaled
            # values, and greedy rows divide by 1 (exact).
            logits = apply_temperature(logits, temperature, greedy_mask, out_dtype=torch.float32)  # [B, V]
            scaled = True

        # (1) raw snapshot.
        snapshot: torch.Tensor | None = None
        if wants_logprobs and md.logprobs_mode == "raw_logprobs":
            snapshot = logits.log_softmax(dim=-1)
        elif wants_logprobs and md.logprobs_mode == "raw_logits":
            snapshot = logits.clone()

        # (2) per-request edits.
        if md.allowed_token_ids_mask is not None:
            apply_allowed_token_ids(logits, md.allowed_token_ids_mask)
        if md.bad_words_token_ids:
            apply_bad_words(logits, md.bad_words_token_ids, md.output_token_ids)
        if md.min_tokens:
            apply_min_tokens(logits, md.min_tokens, md.output_token_ids)
        if md.logit_bias:
            apply_logit_bias(logits, md.logit_bias)

        # (3) penalties.
        if _has_penalties(md):
            apply_penalties(
                logits,
                md.prompt_token_ids,
                md.output_token_ids,
                md.presence_penalties,
                md.frequency_penalties,
                md.repetition_penalties,
            )
        if md.logit_bias or _has_penalties(md):
            # Valid but extreme values overflow float32: a positive logit / a tiny repetition penalty, or
            # plus a huge bias, is +inf, and -inf (a masked token) times a penalty that underflowed is NaN.
            # NaN must never win (it sampled an id past the vocabulary and killed the engine) and +inf must
            # not make the softmax NaN: they become -inf and the largest float.
            torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)

        if md.all_greedy:
            sampled = logits.argmax(dim=-1)  # [B]
        else:
            # (4) random-row shaping, neutral for greedy rows.
            top_k, top_p, min_p = md.top_k, md.top_p, md.min_p
            if greedy_mask is not None:
                top_k = None if top_k is None else top_k.to(logits.device).masked_fill(greedy_mask, 0)
                top_p = None if top_p is None else top_p.to(logits.device).masked_fill(greedy_mask, 1.0)
                min_p = None if min_p is None else min_p.to(logits.device).masked_fill(greedy_mask, 0.0)
            if not scaled:
                apply_temperature(logits, temperature, greedy_mask)
            apply_top_k_top_p(logits, top_k, top_p, md.max_top_k)
            if min_p is not None:
                apply_min_p(logits, min_p)

            # (6) sample; greedy rows take their argmax in the same pass.
            keys = self._keys(md, logits.shape[0], greedy_mask, logits.device)  # [B]
            sampled = gumbel_sample(logits, keys)  # [B]

        # (5) processed snapshot (taken after sampling only because nothing below changes logits).
        if wants_logprobs and md.logprobs_mode == "processed_logprobs":
            snapshot = logits.log_softmax(dim=-1)
        elif wants_logprobs and md.logprobs_mode == "processed_logits":
            snapshot = logits

        # (7) logprobs.
        logprobs = None
        if wants_logprobs:
            assert snapshot is not None, f"unknown logprobs_mode {md.logprobs_mode!r}"
            logprobs = gather_logprobs(snapshot, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled.to(torch.int64), logprobs=logprobs)
