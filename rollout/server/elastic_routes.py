"""The elastic EP routes (mounted with the RL routes): prepare and commit a change of a lockstep group's engine count, and its state.

    POST /elastic_ep/prepare  {"new_data_parallel_size": N, "drain_timeout_s"?}  -> {"data_parallel_size", "generation", "pending"}
    POST /elastic_ep/commit   {"ready_timeout_s"?} (or no body)                 -> the same, once the new size serves
    GET  /elastic_ep                                          -> the same

A server whose engine is not a lockstep RolloutGroup answers 400; a prepare while another change
is prepared, or a commit with none, 409; a drain or ready timeout, 504 (rollout/elastic_ep.py).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import Field

from engine.control import group_only_error
from rollout.elastic_ep import ElasticEPStateError
from rollout.server.middleware import StrictJSONRoute
from rollout.server.openapi import error_responses
from rollout.server.protocol import RequestModel
from weight_transfer.base import MAX_TIMEOUT_S  # the longest wait any body may ask for (a day)


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
