"""The RL control routes (pause/resume, sleep/wake_up, aborts, weight updates) and the fault-tolerance routes.

Each route is a thin adapter over the AsyncLLM method of the same name. Bodies are JSON only
(nothing from the network is unpickled); unknown or missing fields and bad values are a 400
naming the field, and the engine validates before it changes any state. build_app mounts
these routers only when enabled (--enable-rl-routes, --enable-fault-tolerance), behind the
API key like the OpenAI routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from rollout.server.protocol import RequestModel

# ---------------------------------------------------------------------------- bodies


class AbortRequestsRequest(RequestModel):
    request_ids: list[str]
    """Request ids to abort: a response's `id` (the i-th prompt of a batched completion is `id-i`)."""


class InitWeightTransferRequest(RequestModel):
    init_info: dict[str, Any]
    """Backend settings for the engine-side receiver (JSON), e.g. {"backend": "local"}; with "model": "draft"
    the receiver of speculative decoding's draft model (default "target")."""


class UpdateWeightsRequest(RequestModel):
    update_info: dict[str, Any]
    """One update for the receiver; for the local backend {"weights": [{"name", "dtype", "shape", "data_b64"}]};
    with "model": "draft" it lands in speculative decoding's draft model (default "target")."""


class FinishWeightUpdateRequest(RequestModel):
    weight_version: str | None = None
    """The version the new weights serve under; None keeps the engine's own numbering."""


class UpdateWeightVersionRequest(RequestModel):
    new_version: str
    """The version label outputs are tagged with from now on."""


class WeightCheckerRequest(RequestModel):
    baseline: dict[str, Any] | None = None
    """Checksums computed trainer-side to compare against; None just reports the engine's."""
    model: str = "target"
    """Which model's weights: "target" (the served model) or "draft" (speculative decoding's draft model)."""


class FaultToleranceApplyRequest(RequestModel):
    instruction: str
    """What the engine should do now, e.g. "retry"."""


# ---------------------------------------------------------------------------- routers


def rl_router(engine, weight_transfer_backend: str | None = None) -> APIRouter:
    """The RL control routes over `engine` (an AsyncLLM)."""
    router = APIRouter(tags=["rl"])

    @router.post("/pause")
    async def pause(mode: str = "abort") -> dict:
        await engine.pause(mode)
        return {"is_paused": True}

    @router.post("/resume")
    async def resume() -> dict:
        await engine.resume()
        return {"is_paused": False}

    @router.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": await engine.is_paused()}

    @router.post("/sleep")
    async def sleep(level: int = 1) -> dict:
        await engine.sleep(level)
        return {"is_sleeping": True}

    @router.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(default=None)) -> dict:
        await engine.wake_up(tags)
        return {"is_sleeping": await engine.is_sleeping()}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": await engine.is_sleeping()}

    @router.post("/abort_requests")
    async def abort_requests(body: AbortRequestsRequest) -> dict:
        return {"aborted": await engine.abort_requests(body.request_ids)}

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitWeightTransferRequest) -> dict:
        backend = body.init_info.get("backend")
        if weight_transfer_backend is not None and backend != weight_transfer_backend:
            raise ValueError(
                f"init_info.backend: this server takes weight_transfer_backend {weight_transfer_backend!r} "
                f"(--weight-transfer-backend), got {backend!r}"
            )
        await engine.init_weight_transfer_engine(body.init_info)
        return {}

    @router.post("/start_weight_update")
    async def start_weight_update() -> dict:
        await engine.start_weight_update()
        return {}

    @router.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> dict:
        await engine.update_weights(body.update_info)
        return {}

    @router.post("/finish_weight_update")
    async def finish_weight_update(body: FinishWeightUpdateRequest | None = None) -> dict:
        await engine.finish_weight_update(body.weight_version if body is not None else None)
        return {"weight_version": await engine.get_weight_version()}

    @router.post("/abort_weight_update")
    async def abort_weight_update() -> dict:
        aborted = await engine.abort_weight_update()
        return {"aborted": bool(aborted), "weight_version": await engine.get_weight_version()}

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict:
        await engine.shutdown_weight_transfer_engine()
        return {}

    @router.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionRequest) -> dict:
        await engine.update_weight_version(body.new_version)
        return {"weight_version": await engine.get_weight_version()}

    @router.get("/weight_info")
    async def weight_info(model: str = "target") -> dict:  # ?model=draft: speculative decoding's draft model
        return await engine.weight_info(model)

    @router.post("/weight_checker")
    async def weight_checker(body: WeightCheckerRequest | None = None) -> dict:
        body = body if body is not None else WeightCheckerRequest()
        return await engine.weight_checker(body.baseline, body.model)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        return {"reset": bool(await engine.reset_prefix_cache())}

    @router.get("/get_world_size")
    async def get_world_size() -> dict:
        return {"world_size": await engine.get_world_size()}

    return router


def fault_tolerance_router(engine) -> APIRouter:
    """/fault_tolerance/apply and /fault_tolerance/status over `engine` (an AsyncLLM)."""
    router = APIRouter(prefix="/fault_tolerance", tags=["fault_tolerance"])

    @router.post("/apply", status_code=202)
    async def apply(body: FaultToleranceApplyRequest) -> JSONResponse:
        await engine.apply_fault_tolerance_instruction(body.instruction)
        status = await engine.fault_tolerance_status()
        return JSONResponse({"instruction": body.instruction, **status}, status_code=202)

    @router.get("/status")
    async def status() -> dict:
        return await engine.fault_tolerance_status()

    if engine.config.fault_tolerance.enable_fault_injection:
        # Tests only: mounted solely when the engine was started with --enable-fault-injection.
        @router.post("/inject", status_code=202)
        async def inject() -> JSONResponse:
            await engine.inject_fault()
            return JSONResponse({"injected": True}, status_code=202)

    return router

