"""OpenAI-compatible HTTP server: a thin adapter over engine.async_llm.AsyncLLM (or a rollout.group.RolloutGroup of them)."""

from rollout.server.config import ServerConfig

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name: str):
    # build_app is imported on first use: it brings in torch and the engine, and `rollout launch`
    # reads its flags and checks the model (ServerConfig) before paying for them.
    if name == "build_app":
        from rollout.server.app import build_app

        return build_app
    raise AttributeError(f"module 'rollout.server' has no attribute {name!r}")
