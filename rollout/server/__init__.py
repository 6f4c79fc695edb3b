"""OpenAI-compatible HTTP server: a thin adapter over engine.async_llm.AsyncLLM (or a rollout.group.RolloutGroup of them)."""

from rollout.server.app import build_app
from rollout.server.config import ServerConfig

__all__ = ["ServerConfig", "build_app"]
