"""A real two-rank expert-parallel group for tests: spawned processes joined by init_expert_parallel (gloo), running named functions of this module."""

from __future__ import annotations

import traceback
from typing import Any

import torch
from tp_group import CALL_TIMEOUT_S, TPGroup, engine_step, load_engine_model, serve_calls


class EPGroup(TPGroup):
    """`size` processes in one expert-parallel group (no tensor parallelism); run(fn, *args) calls
    fn(state, *args) of this module on every rank, run_each gives each rank its own args."""

    def __init__(self, size: int = 2, device_type: str = "cpu") -> None:
        super().__init__(size, device_type, serve=_serve)  # ranks join an EP group, not a TP one


def _serve(rank: int, size: int, init_method: str, device_type: str, conn) -> None:
    from engine.distributed import destroy_expert_parallel, init_expert_parallel

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    if device_type == "cuda":  # one GPU per rank, NCCL between them
        torch.cuda.set_device(rank)
    init_expert_parallel(size, rank, init_method, "nccl" if device_type == "cuda" else "gloo", timeout_s=CALL_TIMEOUT_S)
    try:
        serve_calls(conn, globals(), rank, device_type)
    finally:
        destroy_expert_parallel()


# ---------------------------------------------------------------------------------------
# The model side, the same in the test process (EP size 1) and in every rank.


DUMMY = "dummy"  # a step in which a rank runs the engine's dummy batch (one token, no request)


@torch.no_grad()
def run_steps(model, steps: list) -> list[dict]:
    """Runs each step (a list of engine_step rows, [] for 0 tokens: each MoE block on none, or DUMMY) with routing
    capture on; returns each step's {"logits": per-row logits, "routed": [T, layers, k] ids or None}."""
    from engine.worker.model_runner import dummy_forward

    model.set_routing_capture(True)
    results = []
    for step in steps:
        if step == DUMMY:
            dummy_forward(model, next(model.parameters()).device)
            results.append({"logits": [], "routed": None})
            continue
        if not step:  # no token here (the engine never runs an empty forward): each MoE block still takes part
            from engine.models.moe import moe_blocks

            for block in moe_blocks(model):
                empty = block.gate.weight.new_zeros(0, block.gate.weight.shape[1])  # [0, H]
                assert block(empty).shape[0] == 0
            results.append({"logits": [], "routed": model.routed_expert_ids().cpu()})
            continue
        logits = engine_step(model, step)
        routed = model.routed_expert_ids()
        results.append({"logits": logits, "routed": None if routed is None else routed.cpu()})
    return results


# ---------------------------------------------------------------------------------------
# Functions the ranks run (first argument: the rank's state dict).


def rank_info(state: dict) -> dict:
    from engine.distributed import get_ep

    rank, size, group = get_ep()
    default_group = torch.distributed.is_initialized()
    return {"rank": rank, "size": size, "has_group": group is not None, "default_group": default_group}


def rank_steps(state: dict, path: str, steps: list, dummy_seed: int | None = None) -> dict:
    """run_steps on this rank's model: the checkpoint's, or with dummy_seed the load_format="dummy" one."""
    if dummy_seed is None:
        model = load_engine_model(path, state["device"])
    else:
        from tp_group import load_dummy_model

        model = load_dummy_model(path, dummy_seed)
    experts = next(m for m in model.modules() if type(m).__name__ == "FusedExperts")
    return {"steps": run_steps(model, steps), "local_experts": list(experts.local_experts),
            "w13_shape": list(experts.w13_weight.shape)}


def rank_load(state: dict, path: str) -> None:
    from engine.worker.weight_update import WeightUpdater

    state["model"] = load_engine_model(path)
    state["updater"] = WeightUpdater(state["model"], torch.device("cpu"))


def rank_weights(state: dict) -> dict:
    updater = state["updater"]
    return {"info": updater.weight_info(), "checksums": updater.checksums()}


def rank_update(state: dict, items: list[tuple[str, torch.Tensor]], backend: str = "local") -> dict:
    """One whole update (init, start, update_weights in two calls, finish) with the full HF tensors;
    returns the error message of a rejected call (the update is then aborted) or ''."""
    from weight_transfer.local import make_update_info

    updater = state["updater"]
    if backend == "local_stable":
        from tp_group import _register_local_stable

        _register_local_stable()
    updater.init_transfer_engine({"backend": backend})
    updater.start_update()
    half = len(items) // 2
    try:
        updater.update_weights(make_update_info(items[:half]))
        updater.update_weights(make_update_info(items[half:]))
    except ValueError as e:
        updater.abort_update()
        return str(e)
    updater.finish_update()
    return ""


def rank_weight_checker(state: dict, baseline: dict) -> dict:
    return state["updater"].weight_checker(baseline)


def rank_worker(state: dict, path: str, port: int, dp_rank: int) -> dict:
    """A worker set up as a lockstep engine's (uni executor): its EP group, its experts, dummy batches."""
    from engine.distributed import destroy_expert_parallel, get_ep
    from engine.engine_args import create_engine_config
    from engine.executor.uniproc import UniProcExecutor
    from engine.worker.worker import Worker

    destroy_expert_parallel()  # this process's test group: the worker builds its own from the config
    config = create_engine_config(
        model=path, dtype="float32", device="cpu", max_model_len=64, enable_expert_parallel=True,
        data_parallel_size=2, data_parallel_rank=dp_rank, data_parallel_master_port=port, num_gpu_blocks_override=8,
    )
    executor = UniProcExecutor(config, 64)
    executor.rpc(Worker.initialize_kv_cache, min(executor.rpc(Worker.determine_num_blocks)))
    ep = get_ep()
    experts = next(m for m in executor.worker.model.modules() if type(m).__name__ == "FusedExperts")
    for _ in range(2):
        executor.execute_dummy_batch()
    info = executor.rpc(Worker.weight_info)[0]
    executor.shutdown()
    return {"rank": ep.rank, "size": ep.size, "local_experts": list(experts.local_experts),
            "expert_names": sorted(n for n in info if ".experts." in n and n.startswith("model.layers.0.")),
            "size_after_shutdown": get_ep().size}


# ---------------------------------------------------------------------------------------
# init / destroy / init again with another size: plain spawned processes (not an EPGroup).


def reinit_main(rank: int, ports: tuple[int, int], queue) -> None:
    """3 processes: an EP group of 3, destroyed; then ranks 0 and 1 form a group of 2 (swapped ranks,
    another port) and rank 2 is alone (size 1: nothing to join)."""
    from engine.distributed import destroy_expert_parallel, ep_all_gather, ep_all_reduce, get_ep, init_expert_parallel

    try:
        torch.set_num_threads(1)
        out: dict[str, Any] = {"rank": rank}
        init_expert_parallel(3, rank, f"tcp://127.0.0.1:{ports[0]}", timeout_s=CALL_TIMEOUT_S)
        try:
            init_expert_parallel(3, rank, f"tcp://127.0.0.1:{ports[0]}", timeout_s=CALL_TIMEOUT_S)
        except RuntimeError as e:
            out["double_init"] = str(e)
        out["first"] = ep_all_gather(torch.tensor([rank])).tolist()
        out["sum"] = ep_all_reduce(torch.ones(2)).tolist()
        destroy_expert_parallel()
        out["after_destroy"] = (get_ep().rank, get_ep().size, get_ep().group)
        if rank < 2:
            init_expert_parallel(2, 1 - rank, f"tcp://127.0.0.1:{ports[1]}", timeout_s=CALL_TIMEOUT_S)
        else:
            init_expert_parallel(1, 0)
        out["second"] = ep_all_gather(torch.tensor([rank, rank])).tolist()
        out["second_state"] = (get_ep().rank, get_ep().size)
        out["default_group"] = torch.distributed.is_initialized()
        destroy_expert_parallel()
        queue.put(out)
    except BaseException:  # noqa: BLE001
        queue.put({"rank": rank, "error": traceback.format_exc()})
