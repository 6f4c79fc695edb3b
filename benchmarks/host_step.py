"""Host work per engine step at ~256 decode rows: a CPU proxy for issue 30's GPU short-answer GRPO shape.

On the GPU, `grpo_rollout.py --num-prompts 64 --n 16 --prompt-len 512 --max-tokens 32` runs steps of
256 decode rows whose time is mostly host Python (scheduler, KV cache manager, the model runner's
input preparation and sampling metadata, output processor, stat loggers, LLM output handling). The
same Python runs here, with the tiny model on the CPU: each engine step of one LLM.generate is timed
by phase, and the device-side phases (the model's forward, compute_logits, the sampler call) are
taken out, leaving the host's time per step and per decode row.

Phases of one engine iteration (one get_output of the LLM loop; with async scheduling it launches
step N and collects step N-1, and is classed by the step it launches):

    schedule   Scheduler.schedule
    prep       ModelRunner.launch_step less forward, logits and sampler (state diff, input batch,
               sampling metadata, placeholder bookkeeping)
    forward / logits / sampler   the model's forward, compute_logits and the sampler call (device work
               on a GPU; on this CPU they compute)
    finish     ModelRunner.finish_step (samples into RequestState, per-row lists)
    update     Scheduler.update_from_output
    frontend   OutputProcessor.process_outputs and the stat loggers' record_engine_outputs
    other      the rest of the iteration (EngineCore.step, make_stats, the LLM loop)

host = the iteration's wall time less forward, logits and sampler. Garbage collections inside the
timed generates are counted (gc.callbacks) with their time. Table on stdout, JSON at --json-out with
`uptime` before and after; medians over --repeats generates of each phase's per-step mean.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import resolve_model, vocab_size_of, write_json  # noqa: E402

PHASES = ("schedule", "prep", "forward", "logits", "sampler", "finish", "update", "frontend", "other")
DEVICE_PHASES = ("forward", "logits", "sampler")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


class StepTimer:
    """Wraps the engine's phase functions with timers; one record per engine iteration."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.records: list[dict[str, Any]] = []
        self.current: dict[str, Any] = defaultdict(float)
        self.gc_ms: list[float] = []
        self._gc_start = 0.0
        self._undo: list[tuple[Any, str, Any]] = []

    def _patch(self, obj: Any, name: str, wrapper_of) -> None:
        original = getattr(obj, name)
        self._undo.append((obj, name, obj.__dict__.get(name, None)))
        setattr(obj, name, wrapper_of(original))

    def _timed(self, phase: str):
        current = self.current

        def wrapper_of(fn):
            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    current[phase] += time.perf_counter() - start
            return timed
        return wrapper_of

    def install(self) -> None:
        llm = self.llm
        core = llm.engine_core
        runner = core.executor.worker.model_runner
        self._patch(core.scheduler, "schedule", self._classified)
        self._patch(core.scheduler, "update_from_output", self._timed("update"))
        self._patch(runner, "launch_step", self._timed("launch"))
        self._patch(runner, "finish_step", self._timed("finish"))
        self._patch(runner.model, "compute_logits", self._timed("logits"))
        self._patch(runner, "sampler", self._timed("sampler"))
        self._patch(llm.output_processor, "process_outputs", self._timed("frontend"))
        self._patch(llm.stat_loggers, "record_engine_outputs", self._timed("frontend"))
        current = self.current
        starts: list[float] = []
        self._hooks = [
            runner.model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())),
            runner.model.register_forward_hook(
                lambda *_: current.__setitem__("forward", current["forward"] + time.perf_counter() - starts.pop())),
        ]
        last = [0.0]

        def begin_iteration(fn):
            def wrapped():
                now = time.perf_counter()
                if last[0]:
                    self._close(now - last[0])
                last[0] = now
                out = fn()
                return out
            return wrapped

        self._last = last
        self._patch(llm.engine_client, "get_output", begin_iteration)
        gc.callbacks.append(self._gc_callback)

    def _classified(self, schedule):
        """Scheduler.schedule timed, remembering the kind of step it makes (its rows and tokens)."""
        current = self.current

        def timed():
            start = time.perf_counter()
            out = schedule()
            current["schedule"] += time.perf_counter() - start
            current["reqs"] = len(out.num_scheduled_tokens)
            current["tokens"] = out.total_num_scheduled_tokens
            return out
        return timed

    def _gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            ms = 1e3 * (time.perf_counter() - self._gc_start)
            self.gc_ms.append(ms)
            self.current["gc_ms"] += ms
            self.current["gc_gen2"] += info.get("generation") == 2

    def _close(self, wall_s: float) -> None:
        c = self.current
        if "reqs" not in c:  # an iteration that launched nothing (the last collects the final step)
            c["reqs"] = c["tokens"] = 0
        record = {"wall": wall_s, "reqs": c["reqs"], "tokens": c["tokens"], "gc_ms": c["gc_ms"],
                  "gc_gen2": c["gc_gen2"]}
        for phase in ("schedule", "forward", "logits", "sampler", "finish", "update", "frontend"):
            record[phase] = c[phase]
        # The hooks and wrappers nest: the forward, logits and sampler run inside launch_step.
        record["prep"] = c["launch"] - c["forward"] - c["logits"] - c["sampler"]
        record["other"] = wall_s - sum(record[p] for p in PHASES if p != "other")
        self.records.append(record)
        c.clear()

    def end_generate(self) -> None:
        """Closes the generate's last iteration (from its get_output to the generate's return)."""
        if self._last[0]:
            self._close(time.perf_counter() - self._last[0])
        self._last[0] = 0.0

    def remove(self) -> None:
        for obj, name, original in reversed(self._undo):
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)
        self._undo = []
        for h in self._hooks:
            h.remove()
        gc.callbacks.remove(self._gc_callback)


def kind_of(record: dict[str, Any], max_num_seqs: int) -> str:
    reqs, tokens = record["reqs"], record["tokens"]
    if reqs == 0:
        return "none launched"
    if tokens != reqs:
        return "prefill/mixed"
    return f"decode {max_num_seqs}" if reqs == max_num_seqs else "decode <max"


def summarize(records: list[dict[str, Any]], max_num_seqs: int) -> dict[str, dict[str, float]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[kind_of(r, max_num_seqs)].append(r)
    out = {}
    for kind, rs in groups.items():
        n = len(rs)
        row = {"steps": n, "rows": sum(r["reqs"] for r in rs) / n}
        for key in ("wall",) + PHASES:
            row[f"{key}_ms"] = 1e3 * sum(r[key] for r in rs) / n
        row["gc_ms"] = sum(r["gc_ms"] for r in rs) / n
        row["host_ms"] = row["wall_ms"] - sum(row[f"{p}_ms"] for p in DEVICE_PHASES)
        row["host_us_per_row"] = 1e3 * row["host_ms"] / row["rows"] if row["rows"] else float("nan")
        out[kind] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="timed generates (medians of their per-step means)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--note", default=None, help="free text kept in the JSON (what tree this is)")
    p.add_argument("--json-out", default="benchmarks/out/host_step.json")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    load_before = uptime()
    torch.set_num_threads(args.threads)

    from engine import LLM, SamplingParams

    path = resolve_model(args.model)
    vocab = vocab_size_of(path)
    llm = LLM(path, max_num_seqs=args.max_num_seqs, max_model_len=args.prompt_len + args.max_tokens)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_len)]}
               for _ in range(args.num_prompts)]
    # As grpo_rollout.py asks: n samples, no seed, no logprobs, detokenized text, every answer max_tokens long.
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, n=args.n, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, n=2), use_tqdm=False)  # warm-up
    timer = StepTimer(llm)
    per_generate: list[dict[str, dict[str, float]]] = []
    walls, gcs, host_totals, gen2 = [], [], [], []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # every rollout computes its prompts once, as a new GRPO step's would
        timer.records = []
        timer.gc_ms = []
        timer.install()
        start = time.perf_counter()
        try:
            llm.generate(prompts, params, use_tqdm=False)
            timer.end_generate()
        finally:
            timer.remove()
        walls.append(time.perf_counter() - start)
        gcs.append(timer.gc_ms)
        host_totals.append(sum(r["wall"] - sum(r[p] for p in DEVICE_PHASES) for r in timer.records))
        gen2.append(sum(r["gc_gen2"] for r in timer.records))
        per_generate.append(summarize(timer.records, args.max_num_seqs))
    load_after = uptime()

    kinds = [k for k in ("prefill/mixed", f"decode {args.max_num_seqs}", "decode <max", "none launched")
             if all(k in g for g in per_generate)]
    table = {}
    for kind in kinds:
        keys = per_generate[0][kind].keys()
        table[kind] = {k: statistics.median(g[kind][k] for g in per_generate) for k in keys}
    result = dict(benchmark="host_step", model=args.model, num_prompts=args.num_prompts, n=args.n,
                  prompt_len=args.prompt_len, max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs,
                  temperature=args.temperature, torch_threads=args.threads, repeats=args.repeats, note=args.note,
                  generate_ms=1e3 * statistics.median(walls), generate_all_ms=[1e3 * w for w in walls],
                  host_ms=1e3 * statistics.median(host_totals), host_all_ms=[1e3 * h for h in host_totals],
                  gc_collections=[len(g) for g in gcs], gc_full_collections=gen2, gc_ms=[sum(g) for g in gcs],
                  by_kind=table, load_before=load_before, load_after=load_after)
    print(f"\nhost work per step: {args.num_prompts} prompts x n={args.n}, prompt {args.prompt_len}, "
          f"max_tokens {args.max_tokens}, max_num_seqs {args.max_num_seqs}, {args.model}, {args.threads} thread(s)")
    print(f"generate {result['generate_ms']:.1f} ms, host {result['host_ms']:.1f} ms (medians of {args.repeats}); "
          f"gc per generate: {result['gc_collections']} collections ({gen2} full), "
          f"{[round(x, 1) for x in result['gc_ms']]} ms")
    cols = ("wall",) + PHASES
    print(f"{'kind (ms per step, median)':<26}{'steps':>6}{'rows':>6}" + "".join(f"{c:>9}" for c in cols)
          + f"{'host':>9}{'us/row':>8}")
    for kind, row in table.items():
        print(f"{kind:<26}{row['steps']:>6.0f}{row['rows']:>6.0f}" + "".join(f"{row[c + '_ms']:>9.3f}" for c in cols)
              + f"{row['host_ms']:>9.3f}{row['host_us_per_row']:>8.1f}")
    print(f"load: before [{load_before}] after [{load_after}]")
    write_json(args.json_out, result)


if __name__ == "__main__":
    main()
