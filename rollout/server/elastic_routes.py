"""The elastic EP routes (mounted with the RL routes): prepare and commit a change of a lockstep group's engine count, and its state.

    POST /elastic_ep/prepare  {"new_data_parallel_size": N, "drain_timeout_s"?}  -> {"data_parallel_size", "generation", "pending"}
    POST /elastic_ep/commit   {"ready_timeout_s"?} (or no body)                 -> the same, once the new size serves
    GET  /elastic_ep                                          -> the same

    POST /scale_elastic_ep, POST /is_scaling_elastic_ep           vLLM 0.33's (vllm_elastic_router)

A server whose engine is not a lockstep RolloutGroup answers 400 (is_scaling_elastic_ep: idle); a prepare while another change
is prepared, or a commit with none, 409; a drain or ready timeout, 504 (rollout/elastic_ep.py).
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, HTTPException, Request
from pydantic import Field

from engine.control import group_only_error
from rollout.elastic_ep import ElasticEPStateError
from rollout.server.middleware import StrictJSONRoute
from rollout.server.openapi import error_responses
from rollout.server.protocol import RequestModel
from weight_transfer.base import MAX_TIMEOUT_S  # the longest wait any body may ask for (a day)

logger = logging.getLogger(__name__)


class PrepareElasticEPRequest(RequestModel):
    new_data_parallel_size: int = Field(ge=1, le=1024)
    """The group's engine count after commit (its expert-parallel size)."""
    drain_timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    """Scale down: how long the leaving engines' requests may take to finish (None: the group's default, 300 s)."""


class CommitElasticEPRequest(RequestModel):
    ready_timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    """How long to wait until every engine of the new size is connected (None: the group's default, 120 s)."""


def elastic_router(engine) -> APIRouter:
    """The /elastic_ep routes over `engine` (a RolloutGroup; anything else answers 400)."""
    router = APIRouter(prefix="/elastic_ep", tags=["elastic_ep"], route_class=StrictJSONRoute,
                       responses=error_responses(400, 409, 503, 504))

    # prepare and commit are declared controls (engine/control.py, Where.GROUP): a single engine refuses
    # them with a ValueError (400). The state is the group's alone.
    def group():
        if getattr(engine, "elastic_ep_state", None) is None:
            raise group_only_error("elastic_ep")
        return engine

    async def call(coro) -> dict:
        try:
            return await coro
        except ElasticEPStateError as e:
            raise HTTPException(409, str(e)) from None
        except TimeoutError as e:
            raise HTTPException(504, str(e)) from None

    @router.post("/prepare")
    async def prepare(body: PrepareElasticEPRequest) -> dict:
        return await call(engine.prepare_elastic_ep(body.new_data_parallel_size, body.drain_timeout_s))

    @router.post("/commit")
    async def commit(body: CommitElasticEPRequest | None = None) -> dict:
        return await call(engine.commit_elastic_ep(body.ready_timeout_s if body is not None else None))

    @router.get("")
    async def state() -> dict:
        return group().elastic_ep_state()

    return router


def vllm_elastic_router(engine) -> APIRouter:
    """vLLM 0.33's elastic EP routes (its serve/elastic_ep router): POST /scale_elastic_ep
    {"new_data_parallel_size", "drain_timeout"?: 120} -> {"message"}, 400 for bad input, 408 for a drain
    timeout, 500 otherwise; POST /is_scaling_elastic_ep -> {"is_scaling_elastic_ep", "phase", "epoch",
    "error", "requested_data_parallel_size"}. Both run the declared controls (scale_elastic_ep is our
    prepare then commit)."""
    router = APIRouter(tags=["elastic_ep"], route_class=StrictJSONRoute, responses=error_responses(400, 503))

    @router.post("/scale_elastic_ep")
    async def scale_elastic_ep(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise HTTPException(400, "Invalid JSON format") from None
        if not isinstance(body, dict):
            raise HTTPException(400, "Request body must be a JSON object")
        new_size = body.get("new_data_parallel_size")
        drain_timeout = body.get("drain_timeout", 120)
        if new_size is None:
            raise HTTPException(400, "new_data_parallel_size is required")
        if isinstance(new_size, bool) or not isinstance(new_size, int) or new_size <= 0:
            raise HTTPException(400, "new_data_parallel_size must be a positive integer")
        if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, int) or drain_timeout <= 0:
            raise HTTPException(400, "drain_timeout must be a positive integer")
        scale = getattr(engine, "scale_elastic_ep", None)
        if scale is None:
            raise group_only_error("scale_elastic_ep")
        try:
            await scale(new_size, min(drain_timeout, int(MAX_TIMEOUT_S)))
        except TimeoutError:
            raise HTTPException(408, f"Scale failed due to request drain timeout after {drain_timeout} seconds") from None
        except (ValueError, ElasticEPStateError) as e:
            raise HTTPException(400, str(e)) from None
        except Exception as e:
            logger.error("Scale failed: %s", e)
            raise HTTPException(500, "Scale failed") from None
        return {"message": f"Scaled to {new_size} data parallel engines"}

    @router.post("/is_scaling_elastic_ep")
    async def is_scaling_elastic_ep() -> dict:
        return await engine.is_scaling_elastic_ep()

    return router
