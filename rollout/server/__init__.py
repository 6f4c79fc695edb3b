"""OpenAI-compatible HTTP server: a thin adapter over engine.async_llm.AsyncLLM."""

from rollout.server.app import build_app
from rollout.server.config import ServerConfig

__all__ = ["ServerConfig", "build_app"]
