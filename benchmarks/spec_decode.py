"""Speculative decoding speed-up at batch 1 and 16: n-gram on a repetitive workload, a draft model on a layer-skip pair.

Each case times one generate() of `batch` greedy requests of --output-len tokens (ignore_eos), with
and without speculation on the same checkpoint, and reports ms per output token per request,
the speed-up, and the acceptance: accepted / proposed draft tokens, the mean tokens a request
gains per verify step (1 + accepted / drafts), and acceptance per draft position.

Checkpoints are random-weight shapes (nothing is downloaded). n-gram: the 0.6B shape with
prompts that repeat a phrase. Draft model: a random model's argmax is unrelated to any other
random model's, so the pair is built to agree the way a trained draft does: the target is the
0.6B shape with the residual writes (o_proj, down_proj) of its layers past the first
--draft-layers scaled by --skip-scale, and the draft is those first layers with the same
embeddings, final norm and head. The acceptance this gives is a property of the construction
(reported, not claimed for trained models); the timing is the engine's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import shape_checkpoint  # noqa: E402
from workload import write_json  # noqa: E402


@torch.no_grad()
def layer_skip_pair(base: str, num_draft_layers: int, scale: float, root: str) -> tuple[str, str]:
    """(target, draft) checkpoint directories derived from `base` (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    out = Path(root) / f"{Path(base).name}-skip{num_draft_layers}-{scale:g}"
    target, draft = out / "target", out / "draft"
    if (draft / "model.safetensors").exists():
        return str(target), str(draft)
    tensors = load_file(str(Path(base) / "model.safetensors"))
    cfg = json.loads((Path(base) / "config.json").read_text())
    for d in (target, draft):
        d.mkdir(parents=True, exist_ok=True)
        for f in Path(base).iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, d / f.name)

    def layer_of(name: str) -> int | None:
        parts = name.split(".")
        return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None

    scaled = {n: (t * scale if (layer_of(n) or 0) >= num_draft_layers and n.endswith(("o_proj.weight", "down_proj.weight"))
                  else t) for n, t in tensors.items()}
    save_file(scaled, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    kept = {n: t for n, t in tensors.items() if layer_of(n) is None or layer_of(n) < num_draft_layers}
    save_file(kept, str(draft / "model.safetensors"))
    cfg = {**cfg, "num_hidden_layers": num_draft_layers}
    cfg.pop("layer_types", None)
    (draft / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(target), str(draft)


def repetitive_prompts(n: int, vocab: int, rng: random.Random) -> list[dict]:
    """A 16-token phrase repeated 8 times per prompt (n-gram lookups find it)."""
    return [{"prompt_token_ids": [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(16)] * 8} for _ in range(n)]


def random_prompts(n: int, vocab: int, rng: random.Random) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(128)]} for _ in range(n)]


class _PhaseTimer:
    """Where a synchronous step's runner time goes: wraps the runner's forward (its host time, and the
    device time between CUDA events recorded around the call: the forward, plus any time the idle
    device waits for the host's launch work inside the call), verification plus sampling (the step's
    one wait for the device is in it) and the speculator's propose (host work, draft passes included)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.host = {"forward_launch": 0.0, "verify_and_propose": 0.0, "propose": 0.0}
        self.events: list = []
        self.saved = {"_forward": runner._forward, "_verify_and_propose": runner._verify_and_propose}
        self.saved_propose = runner.speculator.propose if runner.speculator is not None else None
        cuda = torch.cuda.is_available()

        def forward(*a, **k):
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            t = time.perf_counter()
            out = self.saved["_forward"](*a, **k)
            self.host["forward_launch"] += time.perf_counter() - t
            if cuda:
                end.record()
                self.events.append((begin, end))
            return out

        def timed(name, fn):
            def wrapper(*a, **k):
                t = time.perf_counter()
                out = fn(*a, **k)
                self.host[name] += time.perf_counter() - t
                return out
            return wrapper

        runner._forward = forward
        runner._verify_and_propose = timed("verify_and_propose", self.saved["_verify_and_propose"])
        if self.saved_propose is not None:
            runner.speculator.propose = timed("propose", self.saved_propose)

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.runner, name, fn)
        if self.saved_propose is not None:
            self.runner.speculator.propose = self.saved_propose

    def per_step_ms(self, steps: int) -> dict:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out = {k: 1000 * v / max(steps, 1) for k, v in self.host.items()}
        out["forward_device"] = sum(b.elapsed_time(e) for b, e in self.events) / max(steps, 1)
        return out


def run_case(llm, prompts, output_len: int, time_phases: bool = False) -> dict:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm
    core = llm.engine_core
    totals = getattr(core.scheduler, "spec_totals", None)
    before = None if totals is None else (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens,
                                          list(totals.num_accepted_tokens_per_pos))
    # Runner time per step: the forward pass, sampling, the wait for it, verification and proposing
    # (speculative steps are synchronous); the rest of a step is the engine's host work.
    executor = core.executor
    execute, runner_s, steps = executor.execute_model, [0.0], [0]

    def timed(sched):
        t = time.perf_counter()
        result = execute(sched)
        runner_s[0] += time.perf_counter() - t
        steps[0] += 1
        return result

    executor.execute_model = timed
    phases = _PhaseTimer(executor.worker.model_runner) if time_phases and totals is not None else None
    gc.collect()  # garbage of the engines before (and of the warm-up) is not collected inside the timed run
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        executor.execute_model = execute
        if phases is not None:
            phases.restore()
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    row = {"elapsed_s": elapsed, "ms_per_token": 1000 * elapsed / output_len,
           "output_tok_per_s": sum(map(len, tokens)) / elapsed, "tokens": tokens, "num_synchronous_steps": steps[0],
           "runner_ms_per_synchronous_step": 1000 * runner_s[0] / max(steps[0], 1)}
    if phases is not None:
        row["phases_ms_per_step"] = phases.per_step_ms(steps[0])
    if totals is not None:
        drafts = totals.num_drafts - before[0]
        draft_tokens = totals.num_draft_tokens - before[1]
        accepted = totals.num_accepted_tokens - before[2]
        row.update(num_drafts=drafts, num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
                   acceptance_rate=accepted / max(draft_tokens, 1),
                   mean_acceptance_length=1 + accepted / max(drafts, 1),
                   accepted_per_pos=[a - b for a, b in zip(totals.num_accepted_tokens_per_pos, before[3])])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape (e.g. a tiny one on CPU)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--skip-scale", type=float, default=0.02)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--cases", nargs="+", default=["ngram", "draft_model"])
    p.add_argument("--phases", action="store_true",
                   help="also time each step's phases: forward launch and device time, verify, propose")
    p.add_argument("--json-out", default="benchmarks/out/spec_decode.json")
    args = p.parse_args()

    from engine import LLM

    base = args.model or shape_checkpoint(args.shape)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    k = args.num_speculative_tokens
    rng = random.Random(0)
    results = []
    for case in args.cases:
        if case == "ngram":
            target = base
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
            make_prompts = repetitive_prompts
        else:
            target, draft = layer_skip_pair(base, args.draft_layers, args.skip_scale, "/tmp/rollout-bench")
            spec = {"method": "draft_model", "num_speculative_tokens": k, "model": draft}
            make_prompts = random_prompts
        vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
        prompts = {b: make_prompts(b, vocab, rng) for b in args.batch_sizes}
        rows = {}
        for mode, config in (("plain", None), ("spec", spec)):
            llm = LLM(target, max_num_seqs=max(args.batch_sizes), max_model_len=args.max_model_len,
                      speculative_config=config, kv_cache_memory_bytes=8 << 30)
            rows[mode] = {b: run_case(llm, prompts[b], args.output_len, args.phases) for b in args.batch_sizes}
            llm.engine_core.shutdown()
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        for b in args.batch_sizes:
            plain, fast = rows["plain"][b], rows["spec"][b]
            # bf16: a verify step's logits come from other kernel shapes than a decode step's, so a
            # near-tie may flip a request's greedy path (tests/gpu/test_spec_decode_gpu.py bounds the gap).
            same = sum(a == b for a, b in zip(plain.pop("tokens"), fast.pop("tokens")))
            results.append({"case": case, "batch": b, "k": k, "plain": plain, "spec": fast,
                            "speedup": plain["elapsed_s"] / fast["elapsed_s"], "requests_identical": same})

    print(f"\nSpeculative decoding, {args.shape} shape, greedy, {args.output_len} output tokens per request, "
          f"k={k}, {gpu}")
    print(f"{'case':<12}{'batch':>6}{'plain ms/tok':>14}{'spec ms/tok':>13}{'speed-up':>10}{'accept':>8}"
          f"{'tok/step':>10}{'steps':>7}{'step ms':>9}{'runner ms':>11}  per position          same tokens")
    for r in results:
        s = r["spec"]
        steps = s["num_synchronous_steps"]
        print(f"{r['case']:<12}{r['batch']:>6}{r['plain']['ms_per_token']:>14.3f}{s['ms_per_token']:>13.3f}"
              f"{r['speedup']:>9.2f}x{s['acceptance_rate']:>8.2f}{s['mean_acceptance_length']:>10.2f}"
              f"{steps:>7}{1000 * s['elapsed_s'] / max(steps, 1):>9.3f}{s['runner_ms_per_synchronous_step']:>11.3f}  "
              f"{str(s['accepted_per_pos']):<22}{r['requests_identical']}/{r['batch']}")
    for r in results:
        for mode in ("plain", "spec"):
            if "phases_ms_per_step" in r[mode]:
                ph = "  ".join(f"{k} {v:.3f}" for k, v in r[mode]["phases_ms_per_step"].items())
                print(f"phases ms/step {r['case']:<12} batch {r['batch']:>3} {mode:<6} {ph}")
    write_json(args.json_out, {"benchmark": "spec_decode", "shape": args.shape, "gpu": gpu,
                               "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
