"""The `make demo` GRPO step on CPU: our LLM.generate against HF generate() on the same rows, the trainer's rollout path, and the phases of a whole step.

The shape is examples/grpo_tiny/grpo.toml's: 32 addition prompts x n=8 samples, T=1, max_tokens 6,
the committed tiny Llama, float32. Three parts, all in one process and one run:

1. generation: engine.LLM.generate of the 32 prompts with n=8 (seeded as the trainer seeds them,
   logprobs=0) against HF `generate` of the same 256 rows (each prompt 8 times, left-padded, plain
   multinomial sampling at T=1: top_k=0, top_p=1), interleaved, median of --reps;
2. the rollout path: the trainer's RolloutWorker.generate alone and trainers.rollouts.generate_rollouts
   (the same call plus RolloutBatch building), so its overhead over LLM.generate is visible;
3. a GRPOTrainer of the demo's config: --steps steps, the median of each phase (generate, reward,
   train, sync) over all but the first.

4. when `trl` is importable (an optional extra: `pip install trl`, or PYTHONPATH to a --no-deps copy),
   TRL's GRPOTrainer on the same task in the same run: the same model, the demo's problems and reward,
   32 prompts x 8 generations per step (batch 256), max_completion_length 6, T=1 (top_k 0, top_p 1), the
   demo's lr / weight decay / grad clip, constant LR, float32 (bf16 and gradient checkpointing off),
   loss_type "grpo", scale_rewards "group", beta 0; its step time (median over all but the first
   step) and its generation time inside the step. Without trl the JSON says it was skipped.

Both generate sides run at the same torch thread count (--threads; default: what the process has
after the engine started, which on CPU is the engine's own thread plan). Table on stdout,
--json-out with `uptime` before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/, trainers/
from workload import write_json  # noqa: E402

ROOT = sys.path[1]
CONFIG = os.path.join(ROOT, "examples", "grpo_tiny", "grpo.toml")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def median_ms(samples: list[float]) -> float:
    return 1000.0 * statistics.median(samples)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def hf_generate_fn(path: str, prompts: list[str], n: int, max_tokens: int, temperature: float):
    """HF generate() of every prompt n times (adjacent rows, left-padded), sampling plainly at `temperature`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = [p for p in prompts for _ in range(n)]
    enc = tok(rows, return_tensors="pt", padding=True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                  max_new_tokens=max_tokens, pad_token_id=pad)

    return run


def trl_grpo_steps(path: str, config: Any, task: Any, num_steps: int, threads: int) -> dict[str, Any]:
    """TRL's GRPOTrainer on the demo's task and hyperparameters; medians of its step and generation times."""
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    ro, optim = config.rollout, config.optim
    if torch.distributed.is_initialized():  # our trainer's single-rank group: TRL would take it for a DDP launch
        torch.distributed.destroy_process_group()
    problems = task.make_problems(config.task.num_train_problems, config.seed, "train")
    answers = {pr.prompt: pr for pr in problems}
    dataset = Dataset.from_dict({"prompt": [pr.prompt for pr in problems]})

    def reward(prompts, completions, **_):
        return task.batched_reward(list(completions), [answers[p] for p in prompts])

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = ro.num_prompts_per_step * ro.num_samples_per_prompt
    out_dir = tempfile.mkdtemp(prefix="rl_step_trl_")
    args = GRPOConfig(
        output_dir=out_dir, max_steps=num_steps, per_device_train_batch_size=batch,
        num_generations=ro.num_samples_per_prompt,
        generation_batch_size=batch, num_iterations=1, max_completion_length=ro.max_tokens,
        temperature=ro.temperature, top_k=0, top_p=1.0, learning_rate=optim.lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.beta1, adam_beta2=optim.beta2, adam_epsilon=optim.eps, max_grad_norm=optim.max_grad_norm,
        lr_scheduler_type="constant", warmup_steps=0, bf16=False, fp16=False, gradient_checkpointing=False,
        loss_type="grpo", scale_rewards="group", beta=0.0, use_vllm=False, use_cpu=True, report_to=[],
        logging_steps=1, save_strategy="no", disable_tqdm=True, seed=config.seed, dataloader_num_workers=0,
        log_completions=False,
    )
    steps: list[float] = []
    gen: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            steps.append(time.perf_counter() - self.start)

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tok,
                          callbacks=[Timer()])
    unwrapped_generate = trainer.model.generate

    def timed_generate(*a, **k):  # the step's generation, as its HF generate() call takes it
        start = time.perf_counter()
        out = unwrapped_generate(*a, **k)
        gen.append(time.perf_counter() - start)
        return out

    trainer.model.generate = timed_generate
    torch.set_num_threads(threads)
    trainer.train()
    torch.set_num_threads(threads)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return dict(trl_version=__import__("trl").__version__, steps=num_steps, torch_threads=threads,
                step_ms=median_ms(steps[1:]),
                generate_ms=median_ms(gen[1:]) if len(gen) > 1 else None,
                step_all_ms=[1000 * t for t in steps], generate_calls=len(gen), mean_reward_per_step=rewards)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=15, help="generate calls timed per side (median reported)")
    p.add_argument("--steps", type=int, default=6, help="GRPO steps run (the first is left out of the medians)")
    p.add_argument("--skip-steps", action="store_true", help="time generation only")
    p.add_argument("--threads", type=int, default=None, help="torch threads for every timed part")
    p.add_argument("--note", default=None, help="free text kept in the JSON (what tree this is)")
    p.add_argument("--json-out", default="benchmarks/out/rl_step.json")
    args = p.parse_args()
    if args.reps < 1 or args.steps < 2:
        raise SystemExit("--reps must be >= 1 and --steps >= 2")
    load_before = uptime()

    from engine import LLM, SamplingParams
    from examples.grpo_tiny import task
    from trainers.cli import parse_config
    from trainers.common import step_seed
    from trainers.config import TrainerConfig
    from trainers.rollouts import generate_rollouts

    config = parse_config(TrainerConfig, ["--config", CONFIG, "--logging.output-dir", "/tmp/rl_step_bench"])
    ro = config.rollout
    path = os.path.join(ROOT, config.model.path) if not os.path.isabs(config.model.path) else config.model.path
    problems = task.make_problems(ro.num_prompts_per_step, config.seed, "train")
    prompts = [pr.prompt for pr in problems]
    n = ro.num_samples_per_prompt
    seed = step_seed(ro, 0)
    params = [SamplingParams(n=n, temperature=ro.temperature, max_tokens=ro.max_tokens, logprobs=0, seed=seed + i * n)
              for i in range(len(prompts))]

    # ---- 1. generation: ours vs HF, interleaved -------------------------------------------------
    llm = LLM(path, max_model_len=ro.max_model_len, seed=ro.seed, logprobs_mode="processed_logprobs")
    hf_run = hf_generate_fn(path, prompts, n, ro.max_tokens, ro.temperature)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    for _ in range(2):  # warm-up: first-call allocations, lazy imports
        llm.generate(prompts, params, use_tqdm=False)
        hf_run()
    ours, hf = [], []
    for _ in range(args.reps):
        ours.append(timed(lambda: llm.generate(prompts, params, use_tqdm=False)))
        hf.append(timed(hf_run))
    outs = llm.generate(prompts, params, use_tqdm=False)
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    result: dict[str, Any] = dict(
        benchmark="rl_step", config=os.path.relpath(CONFIG, ROOT), num_prompts=len(prompts), n=n,
        max_tokens=ro.max_tokens, temperature=ro.temperature, torch_threads=threads,
        cpu_count=os.cpu_count(), reps=args.reps,
        generate=dict(ours_ms=median_ms(ours), hf_ms=median_ms(hf), ratio=median_ms(ours) / median_ms(hf),
                      ours_all_ms=[1000 * t for t in ours], hf_all_ms=[1000 * t for t in hf],
                      ours_output_tokens=out_tokens),
    )
    llm.shutdown() if hasattr(llm, "shutdown") else None
    del llm

    print(f"\nRL step shape: {len(prompts)} prompts x n={n}, max_tokens {ro.max_tokens}, T={ro.temperature}, "
          f"{os.path.relpath(path, ROOT)}, {torch.get_num_threads()} threads")
    g = result["generate"]
    print(f"{'generate (ms, median of ' + str(args.reps) + ')':<34}{'ours':>10}{'HF':>10}{'ours/HF':>10}")
    print(f"{'256 rows':<34}{g['ours_ms']:>10.1f}{g['hf_ms']:>10.1f}{g['ratio']:>10.2f}")

    # ---- 2 + 3. the trainer: its rollout path and a whole step ------------------------------------
    if not args.skip_steps:
        from trainers.grpo import GRPOTrainer

        with GRPOTrainer(config, reward_fn=task.batched_reward) as trainer:
            torch.set_num_threads(threads)
            worker = trainer.worker
            raw, rollouts = [], []
            for _ in range(2):
                generate_rollouts(worker, prompts, n=n, temperature=ro.temperature, max_tokens=ro.max_tokens, seed=seed)
            for _ in range(args.reps):
                raw.append(timed(lambda: worker.generate(prompts, params, use_tqdm=False)))
                rollouts.append(timed(lambda: generate_rollouts(worker, prompts, n=n, temperature=ro.temperature,
                                                                max_tokens=ro.max_tokens, seed=seed)))
            result["step_torch_threads"] = torch.get_num_threads()
            history = trainer.train(task.make_problems(config.task.num_train_problems, config.seed, "train"),
                                    num_steps=args.steps)
        phases = {name: [m[f"time/{name}"] for m in history[1:]] for name in ("generate", "reward", "train", "sync")}
        result["rollout_path"] = dict(worker_generate_ms=median_ms(raw), generate_rollouts_ms=median_ms(rollouts),
                                      llm_generate_ms=g["ours_ms"])
        result["step"] = {f"{k}_ms": median_ms(v) for k, v in phases.items()}
        result["step"]["total_ms"] = sum(result["step"].values())
        result["step"]["steps"] = args.steps
        rp, st = result["rollout_path"], result["step"]
        print(f"\n{'rollout path (ms, median)':<34}{'ms':>10}")
        print(f"{'LLM.generate':<34}{rp['llm_generate_ms']:>10.1f}")
        print(f"{'RolloutWorker.generate':<34}{rp['worker_generate_ms']:>10.1f}")
        print(f"{'generate_rollouts (+ RolloutBatch)':<34}{rp['generate_rollouts_ms']:>10.1f}")
        print(f"\n{'GRPO step phase (ms, median of ' + str(args.steps - 1) + ')':<34}{'ms':>10}")
        for k in ("generate", "reward", "train", "sync", "total"):
            print(f"{k:<34}{st[k + '_ms']:>10.1f}")

    try:
        import trl  # noqa: F401
    except ImportError:
        result["trl"] = "skipped: trl is not installed"
        print(f"\nTRL: {result['trl']}")
    else:
        if args.skip_steps:
            result["trl"] = "skipped: --skip-steps"
        else:
            result["trl"] = trl_grpo_steps(path, config, task, args.steps, threads)
            t = result["trl"]
            print(f"\n{'TRL GRPOTrainer ' + t['trl_version'] + ' (ms, median)':<34}{'ms':>10}")
            print(f"{'generate (HF generate in its step)':<34}{(t['generate_ms'] or float('nan')):>10.1f}")
            print(f"{'step':<34}{t['step_ms']:>10.1f}")
            if "step" in result:
                result["step"]["ours_vs_trl"] = result["step"]["total_ms"] / t["step_ms"]
                print(f"{'ours step / TRL step':<34}{result['step']['ours_vs_trl']:>10.2f}")
    result["note"] = args.note
    result["uptime_before"], result["uptime_after"] = load_before, uptime()
    print(f"load: before [{load_before}] after [{result['uptime_after']}]")
    write_json(args.json_out, result)


if __name__ == "__main__":
    main()
