"""An external trainer driving a `rollout launch` server over HTTP: sample with logprobs, score, take a GRPO step, push the weights over NCCL (gloo on CPU).

    python examples/external_trainer_http.py                    # starts a server on the built-in tiny model
    python examples/external_trainer_http.py --url http://host:8000 --model DIR   # a server you started with
        rollout launch --model DIR --enable-rl-routes --weight-transfer-backend nccl --logprobs-mode processed_logprobs

Only HTTP and the weight-sync transport cross between the two: the engine runs only in the
server process. The toy reward (the share of digits in a completion) is one a random tiny model learns
in a few steps; put a verifier of your task there.
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys

import httpx
import torch

from trainers.advantages import grpo_advantages
from trainers.config import ModelConfig, OptimConfig
from trainers.losses import GRPOLoss, PolicyBatch
from trainers.policy import Policy, init_distributed
from weight_transfer import trainer_init
from weight_transfer.clients import HTTPWeightSyncClient
from weight_transfer.nccl import NCCLTrainerInitInfo

PROMPTS = [[5, 17, 99, 230], [300, 12, 7, 88], [77, 78, 79], [41, 42, 43, 44, 45]]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one on --model)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny-llama)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rollout.cli", "launch", "--model", model, "--port", "0", "--device", "cpu",
           "--enable-rl-routes", "--weight-transfer-backend", "nccl", "--logprobs-mode", "processed_logprobs"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the server prints one ready line: "rollout: serving NAME at URL"
        ready = re.match(r"^rollout: serving \S+ at (http://\S+)$", line.strip())
        if ready:
            return proc, ready.group(1)
    raise RuntimeError(f"the server exited with {proc.wait()} before it was ready")


def reward(text: str) -> float:
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def sample(http: httpx.Client, model: str, n: int, max_tokens: int, step: int) -> list[dict]:
    """n completions per prompt with the sampled tokens' logprobs (choice i*n+j is prompt i's j-th)."""
    r = http.post("/v1/completions", json={
        "model": model, "prompt": PROMPTS, "n": n, "max_tokens": max_tokens, "temperature": 1.0,
        "logprobs": 0, "return_token_ids": True, "seed": step,
    })
    r.raise_for_status()
    return sorted(r.json()["choices"], key=lambda c: c["index"])


def to_batch(choices: list[dict], n: int) -> tuple[torch.Tensor, ...]:
    """Right-padded prompt+response ids [B, L], prompt lengths [B], response ids [B, R], mask and engine logprobs [B, R]."""
    prompts = [PROMPTS[i // n] for i in range(len(choices))]
    responses = [c["token_ids"] for c in choices]
    width, resp_width = max(len(p) + len(r) for p, r in zip(prompts, responses)), max(len(r) for r in responses)
    input_ids = torch.zeros(len(choices), width, dtype=torch.long)
    response_ids = torch.zeros(len(choices), resp_width, dtype=torch.long)
    mask = torch.zeros(len(choices), resp_width)
    engine_logprobs = torch.zeros(len(choices), resp_width)
    for b, (p, r, c) in enumerate(zip(prompts, responses, choices)):
        input_ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        response_ids[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1.0
        engine_logprobs[b, : len(r)] = torch.tensor(c["logprobs"]["token_logprobs"])
    prompt_lens = torch.tensor([len(p) for p in prompts])
    return input_ids, prompt_lens, response_ids, mask, engine_logprobs


def main() -> None:
    args = parse_args()
    if args.model is None:
        from engine.tiny_models import builtin_model_dir  # only to find the built-in checkpoint's directory

        args.model = builtin_model_dir("tiny-llama")
    server, url = (None, args.url) if args.url else start_server(args.model)
    try:
        init_distributed("cpu")  # a one-process gloo group: the trainer could be torchrun-launched FSDP2 instead
        policy = Policy(ModelConfig(path=args.model), OptimConfig(lr=args.lr))
        client = HTTPWeightSyncClient(url)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        sync = trainer_init(NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port,
                                                world_size=1 + client.get_world_size()),
                            client=client, source=policy.weight_source())
        loss_fn = GRPOLoss()
        with httpx.Client(base_url=url, timeout=120) as http:
            model_name = http.get("/v1/models").json()["data"][0]["id"]
            for step in range(1, args.steps + 1):
                choices = sample(http, model_name, args.n, args.max_tokens, step)
                rewards = torch.tensor([reward(c["text"]) for c in choices])
                advantages = grpo_advantages(rewards, args.n)
                input_ids, prompt_lens, response_ids, mask, engine_logprobs = to_batch(choices, args.n)
                logprobs, _ = policy.response_logprobs(input_ids, prompt_lens, response_ids)
                batch = PolicyBatch(logprobs=logprobs, old_logprobs=logprobs.detach(),
                                    advantages=advantages[:, None].expand_as(mask), mask=mask,
                                    rollout_logprobs=engine_logprobs)
                loss, metrics = loss_fn(batch)
                loss.backward()
                policy.optimizer_step()
                stats = sync.send_weights(weight_version=f"step-{step}")  # the server serves it when this returns
                print(f"step {step}: reward {rewards.mean():.3f}  mismatch |d| {metrics['mismatch_abs']:.2e}  "
                      f"sync {stats.seconds * 1e3:.0f} ms  serving {client.get_weight_version()}", flush=True)
        sync.shutdown()
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
