"""A colocated RL step on one GPU: the engine sleeps, the trainer trains in the freed memory, syncs its weights over ipc, the engine wakes and rolls out.

The engine runs in its own process (RolloutWorker(multiprocess=True)) on the GPU; this process is the
trainer, on the same GPU, with the policy as an HF model (random bf16 weights of the shape, from the
checkpoint the engine loads). Each step, timed phase by phase:

    sleep(level) -> train (forward + backward + AdamW step on --train-tokens tokens) ->
    wake_up(["weights"]) -> ipc weight sync (send_weights, the engine then serves the new version) ->
    wake_up(["kv_cache"]) -> rollout (--num-prompts prompts x --max-tokens greedy tokens)

The training step is sized to need the memory the sleep frees: its peak (torch.cuda.max_memory_allocated)
is printed beside what was free on the device while the engine was awake. The trainer empties its allocator's cache after
the step (as colocated trainers do), or the engine could not map its memory again. The first step is a warm-up
(ipc buffers exported, pinned buffers made); the table shows the median of the timed steps.

    python benchmarks/colocated_step.py --shape qwen3-0.6b --level 1 --json-out colocated.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_common import shape_checkpoint, timed  # noqa: E402

PHASES = ("sleep", "train", "wake_weights", "weight_sync", "wake_kv_cache", "rollout")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--level", type=int, default=1, choices=[1, 2])
    parser.add_argument("--steps", type=int, default=4, help="the first is a warm-up")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--train-tokens", type=int, default=32768, help="tokens per training step (batch x 1024)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from engine.sampling_params import SamplingParams
    from rollout.worker import RolloutWorker
    from weight_transfer import StateDictSource, trainer_init
    from weight_transfer.clients import LocalWeightSyncClient
    from weight_transfer.ipc import IPCTrainerInitInfo

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    path = shape_checkpoint(args.shape)
    engine = RolloutWorker(model=path, multiprocess=True, device="cuda", max_model_len=2048, max_num_seqs=args.num_prompts,
                           gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=True)
    rows = []
    try:
        policy = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda()
        policy.train()
        policy.gradient_checkpointing_enable()
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        state = {k: v for k, v in policy.state_dict().items()
                 if not (policy.config.tie_word_embeddings and k == "lm_head.weight")}
        trainer = trainer_init(IPCTrainerInitInfo(), client=LocalWeightSyncClient(engine), source=StateDictSource(state))
        gen = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(10, 150000, (256,), generator=gen).tolist()}
                   for _ in range(args.num_prompts)]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        seq = 1024
        batch = torch.randint(10, 150000, (args.train_tokens // seq, seq), device="cuda")
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]

        def train() -> None:
            torch.cuda.reset_peak_memory_stats()
            loss = policy(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
            # What the step cached goes back to the device: the engine maps its memory again at wake_up.
            torch.cuda.empty_cache()

        for step in range(args.steps):
            times = {}
            times["sleep"] = timed(lambda: engine.sleep(args.level))
            free_asleep = torch.cuda.mem_get_info()[0]
            times["train"] = timed(train)
            peak = torch.cuda.max_memory_allocated()
            times["wake_weights"] = timed(lambda: engine.wake_up(["weights"]))
            times["weight_sync"] = timed(lambda: trainer.send_weights(weight_version=f"step{step}"))
            times["wake_kv_cache"] = timed(lambda: engine.wake_up(["kv_cache"]))
            outputs = []
            times["rollout"] = timed(lambda: outputs.extend(engine.generate(prompts, greedy)))
            assert engine.get_weight_version() == f"step{step}"  # the rollout ran on the pushed weights
            assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outputs)
            rows.append(dict(step=step, **times, total=sum(times.values()), trainer_peak_bytes=peak,
                             free_awake_bytes=free_awake, free_asleep_bytes=free_asleep))
            print(f"{args.shape} L{args.level} step {step}: " + "  ".join(f"{k} {1e3 * v:7.1f} ms" for k, v in times.items())
                  + f"  | trainer peak {peak / 2**30:.1f} GiB, free awake {free_awake / 2**30:.1f} GiB, "
                  f"free asleep {free_asleep / 2**30:.1f} GiB", flush=True)
        trainer.shutdown()
    finally:
        engine.shutdown()
    timed_rows = rows[1:] or rows
    median = {k: statistics.median(r[k] for r in timed_rows) for k in (*PHASES, "total")}
    print(f"{args.shape} L{args.level} median of {len(timed_rows)}: "
          + "  ".join(f"{k} {1e3 * v:.1f} ms" for k, v in median.items()))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(shape=args.shape, level=args.level, device=torch.cuda.get_device_name(), load=load,
                           args=vars(args), median_s=median, steps=rows), f, indent=2)


if __name__ == "__main__":
    main()
