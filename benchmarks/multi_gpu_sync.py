"""Weight sync across GPUs: a trainer on one GPU, a `rollout launch` server on another, synced over HTTP (nccl, sparse_nccl, sharded_rdt).

For each model shape a server is started on --engine-device with random (dummy) weights; this
process is the trainer: it holds random bf16 weights of the same shapes on --trainer-device,
viewed as an HF transformers model (no copy). For each backend (nccl packed, nccl unpacked,
sparse_nccl, and sharded_rdt: its producer in this process (producer_host="thread", no Ray),
NIXL-read by the engine from the trainer's GPU) it runs one warm-up sync and --syncs timed ones, each of freshly changed weights
(sparse_nccl: --sparse-fraction of the coordinates), timed from send_weights() start to the
engine serving the new version. Then it checks the engine against the trainer's model:

- greedy: the server generates --greedy-tokens tokens greedily for a few prompts; HF runs the
  prompt + those tokens in one forward and must pick the same token at every position, or a
  token whose logit is within --tie-tolerance of HF's best (bf16 near-ties; both are reported);
- checksums: the server's weight checker against the trainer's tensors (skipped above
  --checksum-max-gb: both sides hash every byte on the host).

    python benchmarks/multi_gpu_sync.py --models qwen3-0.6b qwen2.5-1.5b qwen2.5-7b     # 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from weight_sync import _free_port, perturb, trainer_state

_READY = re.compile(r"^rollout: serving (\S+) at (http://\S+)$")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen2.5-1.5b", "qwen2.5-7b"])
    p.add_argument("--backends", nargs="+", default=["nccl", "nccl-unpacked", "sparse_nccl"])
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--buffer-mib", type=int, default=1024)
    p.add_argument("--sparse-fraction", type=float, default=0.01)
    p.add_argument("--sparse-snapshot-device", default="cpu",
                   help="sparse_nccl: where the delta tracker keeps the last-synced copy (cpu: no GPU memory, "
                        "but every sync copies the model to the host; cuda: fast, one more copy on the trainer GPU)")
    p.add_argument("--trainer-device", default="cuda:0")
    p.add_argument("--engine-device", default="cuda:1")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--greedy-prompts", type=int, default=4)
    p.add_argument("--greedy-tokens", type=int, default=8)
    p.add_argument("--tie-tolerance", type=float, default=0.05, help="bf16: a logit this close to the best is a tie")
    p.add_argument("--checksum-max-gb", type=float, default=4.0,
                   help="compare checksums for models up to this many GB (host hashing: ~1 GB/s per side)")
    p.add_argument("--json-out", default="benchmarks/out/multi_gpu_sync.json")
    return p.parse_args()


class Server:
    """`rollout launch` on the engine device, in its own process group; stop() ends it."""

    def __init__(self, model_dir: str, args, dummy: bool) -> None:
        cmd = [sys.executable, "-m", "rollout.cli", "launch", "--model", model_dir, "--port", "0",
               "--device", args.engine_device, "--max-model-len", "256", "--disable-log-stats", "--enable-rl-routes"]
        if dummy:
            cmd += ["--load-format", "dummy"]
        if args.engine_device.startswith("cuda"):
            cmd += ["--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        else:
            cmd += ["--dtype", "float32"]
        self.log = tempfile.NamedTemporaryFile("w", prefix="multi-gpu-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                match = _READY.match(lines.get(timeout=0.5).strip())
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if match:
                self.served, self.url = match.group(1), match.group(2)
                return
        self.stop()
        with open(self.log.name, errors="replace") as f:
            raise RuntimeError(f"the server did not start:\n{f.read()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def init_info_for(backend: str, args):
    buffer = args.buffer_mib << 20
    port = _free_port()
    if backend == "sparse_nccl":
        from weight_transfer.sparse_nccl import SparseNCCLTrainerInitInfo

        return SparseNCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2,
                                         packed_buffer_size_bytes=buffer, snapshot_device=args.sparse_snapshot_device)
    if backend == "sharded_rdt":  # NIXL READs from the trainer's device; the producer in this process (no Ray)
        from weight_transfer.sharded_rdt import ShardedRDTTrainerInitInfo

        return ShardedRDTTrainerInitInfo(producer_host="thread", producer_device=args.trainer_device,
                                         chunk_bytes=min(buffer, 256 << 20), lookahead_groups=2)
    from weight_transfer.nccl import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2,
                               packed=backend == "nccl", packed_buffer_size_bytes=buffer)


def hf_model_of(model_dir: str, state: dict[str, torch.Tensor]):
    """An HF transformers model whose parameters ARE the trainer's tensors (assigned, not copied)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    first = next(iter(state.values()))
    with torch.device(first.device):  # buffers (rotary frequencies) are made here; parameters replaced below
        model = AutoModelForCausalLM.from_config(config, dtype=first.dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
        missing = [n for n in missing if n != "lm_head.weight"]
    assert not unexpected and not missing, f"trainer tensors vs HF parameters: extra {unexpected}, missing {missing}"
    return model.eval()


def greedy_check(server: Server, model, vocab: int, args) -> dict:
    """Engine greedy tokens vs the HF model's argmax at every generated position."""
    import httpx

    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, vocab, (16 + 8 * i,), generator=gen).tolist() for i in range(args.greedy_prompts)]
    exact, within, total, worst_gap = 0, 0, 0, 0.0
    device = next(model.parameters()).device
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for prompt in prompts:
            body = {"model": server.served, "prompt": prompt, "max_tokens": args.greedy_tokens, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            reply = http.post("/v1/completions", json=body)
            reply.raise_for_status()
            tokens = reply.json()["choices"][0]["token_ids"]
            ids = torch.tensor([prompt + tokens[:-1]], device=device)
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:].float()  # the positions that chose tokens
            best = logits.max(dim=-1).values
            chosen = logits[torch.arange(len(tokens), device=device), torch.tensor(tokens, device=device)]
            gaps = (best - chosen).tolist()
            exact += sum(g == 0.0 for g in gaps)
            within += sum(g <= args.tie_tolerance for g in gaps)
            total += len(tokens)
            worst_gap = max(worst_gap, max(gaps))
    return {"tokens": total, "exact": exact, "within_tie_tolerance": within, "max_logit_gap": worst_gap,
            "match": within == total}


def bench_model(model: str, args, done: list[dict]) -> list[dict]:
    from gpu_common import SHAPES, shape_config
    from weight_sync import model_path

    from weight_transfer import StateDictSource, trainer_init
    from weight_transfer.checksums import hf_state_checksums
    from weight_transfer.clients import HTTPWeightSyncClient

    dummy = model in SHAPES  # published shapes: random weights in the server too; tiny models: their checkpoint
    model_dir = shape_config(model) if dummy else model_path(model, "cpu")
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    server = Server(model_dir, args, dummy)
    results = []
    try:
        client = HTTPWeightSyncClient(server.url, timeout=600)
        weights = client.weight_info()["weights"]
        if config.get("tie_word_embeddings"):
            weights.pop("lm_head.weight", None)
        state = trainer_state(weights, args.trainer_device, seed=0)
        hf = hf_model_of(model_dir, state)
        dense_bytes = sum(t.numel() * t.element_size() for t in state.values())
        for backend in args.backends:
            trainer = trainer_init(init_info_for(backend, args), client=client, source=StateDictSource(state))
            start = time.perf_counter()
            warm = trainer.send_weights(weight_version=f"{backend}-warmup")
            warm_s = time.perf_counter() - start
            fraction = args.sparse_fraction if backend == "sparse_nccl" else 1.0
            times, sent = [], []
            for i in range(args.syncs):
                perturb(state, fraction, seed=100 + i)
                if args.trainer_device.startswith("cuda"):
                    torch.cuda.synchronize(args.trainer_device)
                start = time.perf_counter()
                stats = trainer.send_weights(weight_version=f"{backend}-v{i}")
                times.append(time.perf_counter() - start)
                sent.append(stats.bytes_sent)
                assert client.get_weight_version() == f"{backend}-v{i}"
            greedy = greedy_check(server, hf, config["vocab_size"], args)
            match, mismatched = None, []
            if dense_bytes <= args.checksum_max_gb * 1e9:
                report = client.weight_checker(hf_state_checksums(state))
                match, mismatched = bool(report["match"]), list(report.get("mismatches", []))
            trainer.shutdown()
            median = statistics.median(times)
            row = {"model": model, "backend": backend, "dense_bytes": dense_bytes, "warmup_s": warm_s,
                   "warmup_bytes_sent": warm.bytes_sent, "sync_s": times, "median_s": median,
                   "gb_per_s": dense_bytes / median / 1e9, "bytes_sent_median": statistics.median(sent),
                   "sent_fraction": statistics.median(sent) / dense_bytes, "greedy": greedy, "checksums_match": match,
                   "checksum_mismatches": mismatched}
            results.append(row)
            write_json(args, [*done, *results])  # after every row: a run cut short keeps what it measured
            print(f"{model:<14}{backend:<15}{dense_bytes / 1e6:>10.1f}{warm_s:>10.3f}{median:>10.4f}"
                  f"{row['gb_per_s']:>8.2f}{100 * row['sent_fraction']:>8.2f}"
                  f"{greedy['within_tie_tolerance']:>6}/{greedy['tokens']:<4}{greedy['max_logit_gap']:>8.3f}  {match}",
                  flush=True)
        client.close()
    finally:
        server.stop()
    return results


def main() -> None:
    args = parse_args()
    cuda = [d for d in (args.trainer_device, args.engine_device) if d.startswith("cuda")]
    if len(set(cuda)) == 1:
        raise SystemExit("the trainer and the engine need different GPUs (nccl puts one rank per device)")
    if cuda and torch.cuda.device_count() < len(set(cuda)):
        raise SystemExit(f"multi_gpu_sync.py: {args.trainer_device} and {args.engine_device} need "
                         f"{len(set(cuda))} GPUs, this machine has {torch.cuda.device_count()}")
    print(f"Weight sync {args.trainer_device} -> {args.engine_device} ({args.syncs} timed syncs after a "
          "warm-up; median; send_weights() start to the engine serving the new version)")
    print(f"{'model':<14}{'backend':<15}{'MB':>10}{'warm-up s':>10}{'sync s':>10}{'GB/s':>8}{'sent %':>8}"
          f"{'greedy':>11}{'gap':>8}  checksums", flush=True)
    results: list[dict] = []
    for model in args.models:
        results.extend(bench_model(model, args, results))
    print(f"wrote {args.json_out}")


def write_json(args, results: list[dict]) -> None:
    out = {"benchmark": "multi_gpu_sync", "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
           "machine": platform.node(), "torch": torch.__version__, "args": vars(args), "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
