"""A real two-rank tensor-parallel group for tests: spawned processes joined with gloo, running named functions of this module."""

from __future__ import annotations

import socket
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 8  # 32 tokens per sequence
CALL_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """`size` worker processes in one tensor-parallel group; run(fn, *args) calls fn(state, *args) on every rank.

    Commands go to every rank before any answer is read, so collectives inside fn meet. `state`
    is a dict each rank keeps between calls (models, weight updaters).
    """

    def __init__(self, size: int = 2, device_type: str = "cpu", serve=None) -> None:
        """serve: the rank process's function (this module's _serve, which joins a tensor-parallel group)."""
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.size = size
        self.conns, self.procs = [], []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve or _serve, args=(rank, size, init_method, device_type, child), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def send(self, fn: str, *args: Any, ranks: list[int] | None = None) -> None:
        for rank in ranks if ranks is not None else range(self.size):
            self.conns[rank].send((fn, args))

    def collect(self, ranks: list[int] | None = None, timeout_s: float = CALL_TIMEOUT_S) -> list:
        """Every rank's result (rank order); raises with the first failing rank's traceback."""
        results, errors = [], []
        for rank in ranks if ranks is not None else range(self.size):
            if not self.conns[rank].poll(timeout_s):
                raise TimeoutError(f"tensor-parallel rank {rank} did not answer within {timeout_s} s")
            ok, value = self.conns[rank].recv()
            (results if ok else errors).append(value if ok else f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return results

    def run(self, fn: str, *args: Any) -> list:
        self.send(fn, *args)
        return self.collect()

    def run_each(self, fn: str, args_per_rank: list[tuple]) -> list:
        for rank, args in enumerate(args_per_rank):
            self.conns[rank].send((fn, args))
        return self.collect()

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _serve(rank: int, size: int, init_method: str, device_type: str, conn) -> None:
    from engine.distributed import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    if device_type == "cuda":  # one GPU per rank, NCCL between them
        torch.cuda.set_device(rank)
        init_tensor_parallel(size, rank, init_method, "nccl", timeout_s=CALL_TIMEOUT_S)
    else:
        init_tensor_parallel(size, rank, init_method, "gloo", timeout_s=CALL_TIMEOUT_S)
    try:
        serve_calls(conn, globals(), rank, device_type)
    finally:
        destroy_tensor_parallel()


def serve_calls(conn, functions: dict, rank: int, device_type: str) -> None:
    """A rank's loop: runs functions[fn](state, *args) for each (fn, args) received, sends back (ok, result
    or traceback); None ends it. `state` is the rank's own dict, starting with its device."""
    state: dict = {"device": torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")}
    while True:
        message = conn.recv()
        if message is None:
            return
        fn, args = message
        try:
            conn.send((True, functions[fn](state, *args)))
        except BaseException:  # noqa: BLE001 - any failure goes back to the test, with its traceback
            conn.send((False, traceback.format_exc()))


# ---------------------------------------------------------------------------------------
# The model side, the same in the test process (one rank) and in every rank.


def load_engine_model(path: str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The engine's model for this process's tensor-parallel rank, float32, with a KV cache per layer."""
    from engine.attention.layer import Attention
    from engine.models.loader import load_hf_config, load_model

    model = load_model(path, load_hf_config(path), torch.float32, device)
    for module in model.modules():
        if isinstance(module, Attention):  # per rank: this rank's KV heads only
            module.kv_cache = torch.zeros(
                2, 4 * BLOCKS_PER_SEQ, BLOCK_SIZE, module.num_kv_heads, module.head_size, device=device
            )
    return model


@torch.no_grad()
def engine_step(model, rows: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
    """One forward; each row is (all tokens so far, num_computed, block ids); returns each row's logits."""
    from engine.attention.metadata import AttentionMetadata
    from engine.forward_context import set_forward_context

    input_ids, positions, query_lens, seq_lens, block_table = [], [], [], [], []
    for tokens, num_computed, blocks in rows:
        input_ids += tokens[num_computed:]
        positions += range(num_computed, len(tokens))
        query_lens.append(len(tokens) - num_computed)
        seq_lens.append(len(tokens))
        block_table.append(blocks)
    device = next(model.parameters()).device
    metadata = AttentionMetadata.build(query_lens, seq_lens, block_table, BLOCK_SIZE, device=device)
    with set_forward_context(metadata):
        hidden = model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device))  # [T, hidden]
    return [t.cpu() for t in model.compute_logits(hidden).split(query_lens)]  # [T, vocab] float32 per row


def greedy(model, prompts: list[list[int]], max_tokens: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Batched greedy decoding: a prefill of every prompt (the second in two chunks), then decode steps.

    Returns every step's logits (per row) and the generated tokens per prompt.
    """
    seqs = [list(p) for p in prompts]
    blocks = [list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))[::-1] for i in range(len(prompts))]
    chunk = len(seqs[1]) // 2
    all_logits = engine_step(model, [(seqs[1][:chunk], 0, blocks[1])])  # chunked prefill, first part
    computed = [0] * len(seqs)
    computed[1] = chunk
    generated: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_tokens):
        step = engine_step(model, [(s, c, b) for s, c, b in zip(seqs, computed, blocks)])
        all_logits += step
        for i, logits in enumerate(step):
            computed[i] = len(seqs[i])
            token = int(logits[-1].argmax())
            seqs[i].append(token)
            generated[i].append(token)
    return all_logits, generated


# ---------------------------------------------------------------------------------------
# Functions the ranks run (first argument: the rank's state dict).


def rank_info(state: dict) -> dict:
    from engine.distributed import get_tp

    tp = get_tp()
    return {"rank": tp.rank, "size": tp.size}


def rank_greedy(state: dict, path: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from engine.attention.layer import Attention

    model = load_engine_model(path, state["device"])
    logits, generated = greedy(model, prompts, max_tokens)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    return {"logits": logits, "generated": generated, "num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads}


def rank_construct_errors(state: dict, cases: list[tuple]) -> list[str]:
    """The ValueError message of QKVLinear(*case) for each case ('' when it builds)."""
    from engine.models.layers import QKVLinear

    messages = []
    for case in cases:
        try:
            QKVLinear(*case)
            messages.append("")
        except ValueError as e:
            messages.append(str(e))
    return messages


def rank_load(state: dict, path: str) -> None:
    """Builds this rank's model from a checkpoint and a WeightUpdater over it."""
    from engine.worker.weight_update import WeightUpdater

    state["model"] = load_engine_model(path)
    state["updater"] = WeightUpdater(state["model"], torch.device("cpu"))


def rank_weights(state: dict) -> dict:
    """weight_info() (full shapes, this rank's shards) and checksums() (of this rank's slices)."""
    updater = state["updater"]
    return {"info": updater.weight_info(), "checksums": updater.checksums()}


def rank_greedy_loaded(state: dict, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return greedy(state["model"], prompts, max_tokens)[1]


def rank_call(state: dict, method: str, *args: Any) -> Any:
    """One weight-sync client call (the RL route names) on this rank's WeightUpdater, as an executor forwards it."""
    updater = state["updater"]
    if method == "init_weight_transfer_engine":
        if args[0].get("backend") == "local_stable":
            _register_local_stable()
        return updater.init_transfer_engine(args[0])
    calls = {
        "start_weight_update": updater.start_update,
        "update_weights": updater.update_weights,
        "finish_weight_update": lambda version=None: updater.finish_update(),
        "abort_weight_update": updater.abort_update,
        "shutdown_weight_transfer_engine": updater.shutdown,
    }
    return calls[method](*args)


def _register_local_stable() -> None:
    """The local backend, declared views_stable_per_call (true of it: its tensors live in update_info for
    the whole call), so the worker lands each call as one group (WeightUpdater.update_weights, whole_call)."""
    from weight_transfer.base import register_engine_backend
    from weight_transfer.local import LocalWeightTransferEngine

    class StableLocal(LocalWeightTransferEngine):
        views_stable_per_call = True

    register_engine_backend("local_stable", StableLocal)


def rank_bake(state: dict, names: list[str], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]) -> dict:
    """The byte ranges of each full tensor this rank's loaders consume (what sharded_rdt pulls)."""
    from weight_transfer.rdt_plan import bake_consumed_ranges

    return bake_consumed_ranges(state["model"], names, dtypes, shapes)


def rank_dummy_logits(state: dict, path: str, prompts: list[list[int]], seed: int) -> list[torch.Tensor]:
    """The prefill logits of the load_format="dummy" model built after torch.manual_seed(seed), as a worker does."""
    return greedy(load_dummy_model(path, seed), prompts, 1)[0]


def load_dummy_model(path: str, seed: int) -> torch.nn.Module:
    from engine.attention.layer import Attention
    from engine.models.loader import load_hf_config, load_model

    torch.manual_seed(seed)
    model = load_model(path, load_hf_config(path), torch.float32, "cpu", load_format="dummy")
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_cache = torch.zeros(2, 4 * BLOCKS_PER_SEQ, BLOCK_SIZE, module.num_kv_heads, module.head_size)
    return model
