"""What the benchmarks share: model resolution, the random request workload, the JSON result file."""

from __future__ import annotations

import json
import os
import random


def resolve_model(name: str) -> str:
    """A checkpoint directory as given, or a built-in tiny model's (built on first use)."""
    if os.path.isdir(name):
        return name
    from engine.tiny_models import builtin_model_dir

    return builtin_model_dir(name)


def vocab_size_of(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def make_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    """args.num_requests (prompt ids, max_tokens) pairs, lengths uniform in args.input_len / args.output_len."""
    rng = random.Random(args.seed)
    work = []
    for _ in range(args.num_requests):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*args.input_len))]  # ids 0-2 are special
        work.append((prompt, rng.randint(*args.output_len)))
    return work


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


def load() -> dict:
    """The machine's load average and `uptime`'s line: how busy it was around a measurement."""
    import subprocess
    import time

    one, five, fifteen = os.getloadavg()
    try:
        line = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        line = None
    return {"loadavg": [one, five, fifteen], "uptime": line, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
