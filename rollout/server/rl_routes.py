"""The RL control routes (pause/resume, sleep/wake_up, aborts, weight updates) and the fault-tolerance routes.

Each route is a thin adapter over the AsyncLLM method of the same name. Bodies are JSON only
(nothing from the network is unpickled); unknown or missing fields and bad values are a 400
naming the field, and the engine validates before it changes any state. build_app mounts
these routers only when enabled (--enable-rl-routes, --enable-fault-tolerance), behind the
API key like the OpenAI routes.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from rollout.server.middleware import StrictJSONRoute
from rollout.server.openapi import error_responses
from rollout.server.protocol import RequestModel, ResponseModel

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


# ---------------------------------------------------------------------------- answers


class IsPausedResponse(ResponseModel):
    is_paused: bool


class IsSleepingResponse(ResponseModel):
    is_sleeping: bool


class AbortRequestsResponse(ResponseModel):
    aborted: list[str]
    """The ids that were running (unknown or finished ids are left out)."""


class EmptyResponse(ResponseModel):
    """An empty JSON object: the call succeeded."""


class WeightVersionResponse(ResponseModel):
    weight_version: str | None


class AbortWeightUpdateResponse(ResponseModel):
    aborted: bool
    """Whether an update was in progress (its changes are undone)."""
    weight_version: str | None


class ResetPrefixCacheResponse(ResponseModel):
    reset: bool


class WorldSizeResponse(ResponseModel):
    world_size: int


class FaultToleranceStatusResponse(ResponseModel):
    status: str
    """healthy, unhealthy or dead."""
    enabled: bool
    """Whether the engine runs with fault tolerance (--enable-fault-tolerance)."""


class FaultToleranceApplyResponse(FaultToleranceStatusResponse):
    instruction: str


class InjectResponse(ResponseModel):
    injected: bool


# ---------------------------------------------------------------------------- routers

# The engine answers 503 when it is dead (and, for some calls, asleep or paused).
_ENGINE = error_responses(503)
# Weight-update calls: the trainer side of a transfer failed (502; the previous weights serve again).
_TRANSFER = error_responses(502, 503)


def rl_router(engine, weight_transfer_backend: str | None = None) -> APIRouter:
    """The RL control routes over `engine` (an AsyncLLM)."""
    router = APIRouter(tags=["rl"], route_class=StrictJSONRoute, responses=_ENGINE)

    @router.post("/pause")
    async def pause(mode: str = "abort") -> IsPausedResponse:
        await engine.pause(mode)
        return IsPausedResponse(is_paused=True)

    @router.post("/resume")
    async def resume() -> IsPausedResponse:
        await engine.resume()
        return IsPausedResponse(is_paused=False)

    @router.get("/is_paused")
    async def is_paused() -> IsPausedResponse:
        return IsPausedResponse(is_paused=await engine.is_paused())

    @router.post("/sleep")
    async def sleep(level: Annotated[int, Query(ge=0, le=2)] = 1) -> IsSleepingResponse:
        await engine.sleep(level)
        return IsSleepingResponse(is_sleeping=True)

    @router.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(default=None)) -> IsSleepingResponse:
        await engine.wake_up(tags)
        return IsSleepingResponse(is_sleeping=await engine.is_sleeping())

    @router.get("/is_sleeping")
    async def is_sleeping() -> IsSleepingResponse:
        return IsSleepingResponse(is_sleeping=await engine.is_sleeping())

    @router.post("/abort_requests")
    async def abort_requests(body: AbortRequestsRequest) -> AbortRequestsResponse:
        return AbortRequestsResponse(aborted=await engine.abort_requests(body.request_ids))

    # 504: the trainer's rendezvous did not answer within init_info's timeout_s.
    @router.post("/init_weight_transfer_engine", responses=error_responses(504))
    async def init_weight_transfer_engine(body: InitWeightTransferRequest) -> EmptyResponse:
        backend = body.init_info.get("backend")
        if weight_transfer_backend is not None and backend != weight_transfer_backend:
            raise ValueError(
                f"init_info.backend: this server takes weight_transfer_backend {weight_transfer_backend!r} "
                f"(--weight-transfer-backend), got {backend!r}"
            )
        await engine.init_weight_transfer_engine(body.init_info)
        return EmptyResponse()

    @router.post("/start_weight_update", responses=_TRANSFER)
    async def start_weight_update() -> EmptyResponse:
        await engine.start_weight_update()
        return EmptyResponse()

    @router.post("/update_weights", responses=_TRANSFER)
    async def update_weights(body: UpdateWeightsRequest) -> EmptyResponse:
        await engine.update_weights(body.update_info)
        return EmptyResponse()

    @router.post("/finish_weight_update", responses=_TRANSFER)
    async def finish_weight_update(body: FinishWeightUpdateRequest | None = None) -> WeightVersionResponse:
        await engine.finish_weight_update(body.weight_version if body is not None else None)
        return WeightVersionResponse(weight_version=await engine.get_weight_version())

    @router.post("/abort_weight_update")
    async def abort_weight_update() -> AbortWeightUpdateResponse:
        aborted = await engine.abort_weight_update()
        return AbortWeightUpdateResponse(aborted=bool(aborted), weight_version=await engine.get_weight_version())

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> EmptyResponse:
        await engine.shutdown_weight_transfer_engine()
        return EmptyResponse()

    @router.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionRequest) -> WeightVersionResponse:
        await engine.update_weight_version(body.new_version)
        return WeightVersionResponse(weight_version=await engine.get_weight_version())

    @router.get("/get_weight_version")
    async def get_weight_version() -> WeightVersionResponse:
        return WeightVersionResponse(weight_version=await engine.get_weight_version())

    @router.get("/weight_info")
    async def weight_info(model: str = "target") -> dict[str, Any]:  # ?model=draft: speculative decoding's draft model
        return await engine.weight_info(model)

    @router.post("/weight_checker")
    async def weight_checker(body: WeightCheckerRequest | None = None) -> dict[str, Any]:
        body = body if body is not None else WeightCheckerRequest()
        return await engine.weight_checker(body.baseline, body.model)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> ResetPrefixCacheResponse:
        return ResetPrefixCacheResponse(reset=bool(await engine.reset_prefix_cache()))

    @router.get("/get_world_size")
    async def get_world_size() -> WorldSizeResponse:
        return WorldSizeResponse(world_size=await engine.get_world_size())

    return router


def fault_tolerance_router(engine) -> APIRouter:
    """/fault_tolerance/apply and /fault_tolerance/status over `engine` (an AsyncLLM)."""
    router = APIRouter(prefix="/fault_tolerance", tags=["fault_tolerance"], route_class=StrictJSONRoute,
                       responses=_ENGINE)

    @router.post("/apply", status_code=202)
    async def apply(body: FaultToleranceApplyRequest) -> FaultToleranceApplyResponse:
        await engine.apply_fault_tolerance_instruction(body.instruction)
        return FaultToleranceApplyResponse(instruction=body.instruction, **await engine.fault_tolerance_status())

    @router.get("/status")
    async def status() -> FaultToleranceStatusResponse:
        return FaultToleranceStatusResponse(**await engine.fault_tolerance_status())

    if engine.config.fault_tolerance.enable_fault_injection:
        # Tests only: mounted solely when the engine was started with --enable-fault-injection.
        @router.post("/inject", status_code=202)
        async def inject() -> InjectResponse:
            await engine.inject_fault()
            return InjectResponse(injected=True)

    return router

