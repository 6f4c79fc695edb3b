"""LLM: the offline API - batch generate and chat over an in-process EngineCore (InprocClient)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from engine.control import Control, Where, forward_controls, plain_arguments
from engine.core_client import InprocClient
from engine.engine_args import create_engine_config
from engine.lora.request import LoRARequest
from engine.metrics.loggers import StatLoggerManager
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.processor import Processor, PromptType
from engine.sampling_params import RequestOutputKind, SamplingParams


@forward_controls(asynchronous=False, include=lambda declared: declared.where in (Where.ENGINE, Where.WORKER))
class LLM:
    """`LLM(model=DIR, **engine_args)`; argument names follow vLLM's where vLLM has one."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.config = create_engine_config(model=model, **{"usage_context": "llm_class", **engine_args})
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model.tokenizer, truncation_side="left")  # as vLLM loads it for generation
        self.engine_client = InprocClient(self.config)
        self.engine_core = self.engine_client.engine_core  # for tests and callers that inspect it
        self.processor = Processor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        self.stat_loggers = StatLoggerManager(self.config, model_name=self.config.model.model_name)
        self.stat_loggers.log_engine_initialized(self.engine_client.num_blocks)

    def shutdown(self) -> None:
        """Stops the engine's workers (worker processes or Ray actors, per distributed_executor_backend) and gives
        back every tensor the engine holds on the device (weights, KV cache, CUDA graphs, a draft model) before
        it returns, even while this object is still referenced; idempotent. generate() raises EngineDeadError
        ("the executor was shut down") afterwards."""
        self.engine_client.shutdown()

    close = shutdown

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of `prompts`.

        lora_request: the adapter of every prompt, or a list with one per prompt (None: the base model);
        each adapter is read and validated (add_lora) before any request of the call is added."""
        # Before any request is registered: EngineDeadError saying why (shut down, or a worker died).
        self.engine_core.executor.check_alive()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: {len(params_list)} given for {len(prompts)} prompts"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: {len(priority)} given for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")

        # Offline callers see only finished outputs: skip building per-step snapshots.
        params_list = [
            p.clone(output_kind=RequestOutputKind.FINAL_ONLY) if isinstance(p, SamplingParams) else p
            for p in params_list
        ]
        # Validate everything first, so a bad prompt leaves the engine untouched.
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            req_id = str(next(self._counter))
            try:
                text, request = self.processor.process(
                    req_id, prompt, params, priority[i] if priority is not None else 0, loras[i]
                )
            except ValueError as e:
                raise ValueError(f"{e} (prompt #{i})") from None
            requests.append((text, request))
        for lora in dict.fromkeys(r.lora_request for _, r in requests if r.lora_request is not None):
            self.add_lora(lora)  # ValueError naming what is wrong with the adapter, before anything is added
        try:
            for text, request in requests:
                self._add_request(text, request)
        except BaseException:
            # Refused (asleep, weights discarded): nothing of this call may stay registered, or the next
            # generate() would wait for it forever.
            self.abort([r.request_id for _, r in requests])
            raise
        return self._run_engine([r.request_id for _, r in requests], use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the tokenizer's chat template, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"messages": conversation, "add_generation_prompt": add_generation_prompt,
             "chat_template_kwargs": chat_template_kwargs}
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _add_request(self, prompt_text: str | None, request) -> None:
        parent_id = request.request_id if request.sampling_params.n > 1 else None
        for engine_request in self.output_processor.add_user_request(request, prompt_text):
            self.stat_loggers.on_request_added(
                engine_request.request_id, request.arrival_time, len(request.prompt_token_ids), parent_id,
                request.sampling_params.max_tokens, request.sampling_params.n,
            )
            self.engine_client.add_request(engine_request)

    def _run_engine(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(req_ids), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.output_processor.has_unfinished_requests():
                engine_outputs = self.engine_client.get_output()
                processed = self.output_processor.process_outputs(
                    engine_outputs.outputs, engine_outputs.weight_version, engine_outputs.lora_weight_versions)
                self.stat_loggers.record_engine_outputs(engine_outputs, stopped_req_ids=processed.reqs_to_abort)
                if processed.reqs_to_abort:
                    self.engine_client.abort_requests(processed.reqs_to_abort)
                for out in processed.request_outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            # Leave the engine clean for the next call (e.g. after KeyboardInterrupt).
            pending = [r for r in req_ids if r not in finished]
            self.abort(pending)
            raise
        finally:
            bar.close()
        return [finished[r] for r in req_ids]

    def abort(self, req_ids: list[str]) -> None:
        child_ids = self.output_processor.abort_requests(req_ids)
        self.stat_loggers.on_requests_aborted(child_ids)
        self.engine_client.abort_requests(list(child_ids) if child_ids else req_ids)

    # ---- RL controls (engine/control.py): every control the engine implements, as vLLM's LLM has them ----
    # sleep(level, mode), wake_up(tags) -> bool, reset_prefix_cache(reset_running_requests, reset_connector),
    # collective_rpc, get_world_size(include_dp), and the weight-transfer lifecycle taking vLLM's request
    # objects (init_weight_transfer_engine(request), update_weights(request), start_draft_weight_update...).
    # generate() blocks, so no request is in flight when one of these runs.

    def _forward_control(self, declared: Control, args: tuple) -> Any:
        result = self.engine_client.call_utility(declared.name, *plain_arguments(declared, args))
        return None if declared.signature.return_annotation is type(None) else result

    # ---- metrics ----

    def get_metrics_snapshot(self) -> dict[str, float]:
        """Counters, gauges and histogram sums/counts as plain numbers, keyed by Prometheus sample name."""
        return self.stat_loggers.get_metrics_snapshot()
