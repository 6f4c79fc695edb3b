"""ServerConfig: how the HTTP server listens and whom it answers (one documented field each)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

UvicornLogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


@dataclass
class ServerConfig:
    """HTTP server settings."""

    host: str = "127.0.0.1"
    """Address to bind; loopback unless you mean to expose the server (e.g. 0.0.0.0)."""
    port: int = 8000
    """TCP port to listen on (0: pick a free one)."""
    api_key: str | None = None
    """When set, every route except /health and /metrics needs `Authorization: Bearer <key>`."""
    served_model_name: str | None = None
    """Model name clients must send in `model`; defaults to the --model argument as given."""
    uvicorn_log_level: UvicornLogLevel = "warning"
    """Log level of uvicorn's own messages (the access log has its own switch, --disable-access-log)."""
    disable_access_log: bool = False
    """Turn off the access log (one line per request with its status, uvicorn's format, on stderr)."""
    max_request_body_bytes: int = 32 << 20
    """Largest request body accepted (bytes); a bigger one is refused with 413 before it is read. /update_weights has its own limit."""
    max_batch_sequences: int = 4096
    """Most sequences (prompts x n) one /v1/completions request may ask for; more is a 400 (n alone is bounded by --max-num-seqs)."""
    max_weight_update_body_bytes: int = 1 << 30
    """Largest /update_weights body (bytes): the local backend sends tensors base64-encoded inside it (256 MiB of tensors per call by default)."""
    timeout_keep_alive: int = 5
    """Seconds an idle keep-alive connection stays open."""
    shutdown_grace_s: float = 5.0
    """Seconds in-flight requests get to finish after SIGINT/SIGTERM; then the engine stops and they end with an error."""
    enable_rl_routes: bool = False
    """Serve the RL control routes (/pause, /resume, /sleep, /wake_up, /abort_requests, weight updates...); they change what everyone gets, so keep them behind --api-key or a private network."""

    enable_return_routed_experts: bool = False
    """Mixture-of-experts models: every /v1/completions, /v1/chat/completions and /inference/v1/generate choice carries routed_experts (vLLM's flag; a request may also ask with return_routed_experts)."""
    enable_tokenizer_info_endpoint: bool = False
    """Serve GET /tokenizer_info (the tokenizer's configuration, chat template included), as vLLM's flag of this name."""

    enable_auto_tool_choice: bool = False
    """Parse tool calls out of chat answers with --tool-call-parser, so that tool_choice "auto" (the default when a request gives tools), "required" and named choices work (vLLM's flag)."""
    tool_call_parser: str | None = None
    """The tool-call format of the model: hermes (Hermes, Qwen2.5, Qwen3 <tool_call> JSON) or llama3_json (Llama 3.x JSON); needs --enable-auto-tool-choice (vLLM's flag and names)."""
    reasoning_parser: str | None = None
    """Put what the model writes inside its reasoning markup in message.reasoning (delta.reasoning when streamed) instead of the content: qwen3 (<think>...</think>) (vLLM's flag and names)."""
    exclude_tools_when_tool_choice_none: bool = False
    """Leave a request's tools out of the chat template when its tool_choice is "none" (vLLM's flag)."""

    weight_transfer_backend: str | None = None
    """The weight-sync backend /init_weight_transfer_engine accepts (local, nccl, sparse_nccl, ipc, sharded_rdt), and the one an init_info without "backend" gets (vLLM's trainers send none); unset: any backend init_info names, nccl when it names none (vLLM's default)."""
    weight_transfer_config: dict | None = None
    """vLLM's spelling of --weight-transfer-backend: a JSON object {"backend": "nccl"} (its only key, as in vLLM 0.33); it sets weight_transfer_backend, and giving both with different backends is an error."""

    lora_modules: list[str] | None = None
    """LoRA adapters served from start-up, each `name=path` or a JSON object {"name", "path", "base_model_name"} (vLLM's flag and forms); a request selects one by its name in `model`, and /v1/models lists them. Needs --enable-lora; ids are given in this order from 1."""
    allow_runtime_lora_updating: bool = False
    """Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 or true in rollout launch's environment turns them on too, as in vLLM). Whoever reaches them changes what `model` names serve: keep them behind --api-key."""
    allowed_lora_paths: list[str] = field(default_factory=list)
    """Directories /v1/load_lora_adapter may read adapters from: a lora_path must lie inside one once symlinks and '..' are resolved, else it is refused (400) before anything is opened; * allows any path the server can read (vLLM's behaviour). Default: none, so runtime loads are refused until you list some. --lora-modules are not checked."""

    def __post_init__(self) -> None:
        from rollout.server.lora import parse_lora_modules

        parse_lora_modules(self.lora_modules)  # ValueError naming a bad entry
        if not isinstance(self.allowed_lora_paths, list) or not all(
                isinstance(p, str) and p for p in self.allowed_lora_paths):
            raise ValueError(f"allowed_lora_paths: expected directory paths or *, got {self.allowed_lora_paths!r}")
        if self.weight_transfer_config is not None:
            config = self.weight_transfer_config
            unknown = sorted(set(config) - {"backend"})
            if unknown:
                raise ValueError(f"weight_transfer_config: unknown key(s) {unknown}; it takes only 'backend'")
            backend = config.get("backend", "nccl")  # vLLM's WeightTransferConfig default
            if not isinstance(backend, str):
                raise ValueError(f"weight_transfer_config.backend: expected a backend name, got {backend!r}")
            if self.weight_transfer_backend is not None and self.weight_transfer_backend != backend:
                raise ValueError(
                    f"weight_transfer_config.backend {backend!r} contradicts weight_transfer_backend "
                    f"{self.weight_transfer_backend!r}; give one of them"
                )
            self.weight_transfer_backend = backend
        if self.weight_transfer_backend is not None:
            from weight_transfer.base import known_engine_backends

            if self.weight_transfer_backend not in known_engine_backends():
                raise ValueError(
                    f"weight_transfer_backend must be one of {known_engine_backends()}, got {self.weight_transfer_backend!r}"
                )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("Error: --enable-auto-tool-choice requires --tool-call-parser")  # vLLM's words
        if self.tool_call_parser is not None:
            from rollout.server.tool_parsers import ToolParserManager

            ToolParserManager.get_tool_parser(self.tool_call_parser)  # an unknown name: vLLM's message
        if self.reasoning_parser is not None:
            from rollout.server.reasoning_parsers import ReasoningParserManager

            ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to turn auth off)")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.uvicorn_log_level not in get_args(UvicornLogLevel):
            raise ValueError(
                f"uvicorn_log_level must be one of {get_args(UvicornLogLevel)}, got {self.uvicorn_log_level!r}"
            )
        if self.timeout_keep_alive < 1:
            raise ValueError(f"timeout_keep_alive must be >= 1, got {self.timeout_keep_alive}")
        for name in ("max_request_body_bytes", "max_weight_update_body_bytes", "max_batch_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
