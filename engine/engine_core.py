"""EngineCore: the engine's inner loop, schedule -> execute -> update, one step at a time."""

from __future__ import annotations

import logging
import time

from engine.config import EngineConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.executor import UniProcExecutor
from engine.wire import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type = UniProcExecutor) -> None:
        assert config.model.max_model_len is not None, "resolve max_model_len before building the core"
        self.config = config
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.hf_config_dict()["vocab_size"]
        self.executor = executor_class(config, self.max_model_len)
        self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(self.num_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.max_model_len, self.num_blocks)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admits a request, or raises ValueError naming what is wrong and changes nothing."""
        validate_request(request, self.max_model_len, self.vocab_size)
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        finished = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        return [EngineCoreOutput(r.request_id, [], finish_reason=FinishReason.ABORT) for r in finished]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(timestamp=time.time())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.scheduler_stats = self.scheduler.make_stats()
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()


def validate_request(request: EngineCoreRequest, max_model_len: int, vocab_size: int) -> None:
    prompt = request.prompt_token_ids
    if not prompt:
        raise ValueError("prompt: the prompt is empty")
    if len(prompt) > max_model_len:
        raise ValueError(
            f"prompt: {len(prompt)} tokens is longer than max_model_len={max_model_len}"
        )
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt_token_ids: token ids must be in [0, {vocab_size})")
    request.sampling_params.validate_for_vocab(vocab_size)
