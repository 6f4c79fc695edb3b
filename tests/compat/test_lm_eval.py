"""lm-evaluation-harness's stock `local-completions` model scores a log-likelihood task against a
real `rollout launch` (float32, tiny-qwen3), and every loglikelihood equals HF transformers' within 1e-4.

The task is a small multiple-choice file written here (local JSON through the `json` dataset
builder; HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, nothing fetched). lm-eval runs through its own
CLI with --log_samples, `local-completions` against our server (tokenized_requests: lm-eval sends
token ids with echo + logprobs, as it does against vLLM). The reference is transformers' forward
on the same checkpoint in float32, scoring each logged (context, continuation) pair tokenized as
lm-eval tokenizes it for a causal model (trailing context spaces moved to the continuation; the
pair encoded whole, the context's tokens split off the front; no special tokens).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
SERVED_MODEL_NAME = "tiny-qwen3"
TASK = "rollout_compat_tiny_mc"

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Rome"], 0),
    ("What is two plus two?", ["Four", "Five"], 0),
    ("She sells sea shells by the sea", ["shore", "house", "moon", "tree"], 0),
    ("A journey of a thousand miles begins with a single", ["step", "shoe"], 0),
    ("Practice makes progress, not", ["perfection", "money", "noise"], 0),
    ("def add(a, b): return a", ["+ b", "- b"], 0),
    ("Numbers appear too: 0 1 2 3", ["4", "9", "x"], 0),
    ("User: Hello! How are you today? Assistant: I am", ["fine", "blue"], 0),
]


def write_task(directory: Path) -> Path:
    data = directory / "tiny_mc.jsonl"
    with open(data, "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    (directory / f"{TASK}.yaml").write_text(
        "\n".join([
            f"task: {TASK}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {json.dumps(str(data))}",
            "test_split: test",
            "output_type: multiple_choice",
            'doc_to_text: "Question: {{question}}\\nAnswer:"',
            'doc_to_choice: "{{choices}}"',
            'doc_to_target: "{{answer}}"',
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
            "",
        ])
    )
    return directory


def run_lm_eval(model: str, model_args: str, task_dir: Path, out_dir: Path) -> tuple[list[str], dict, list[dict]]:
    """Runs lm-eval's CLI; returns (command, results json, samples)."""
    cmd = [
        sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
        "--tasks", TASK, "--include_path", str(task_dir), "--batch_size", "1",
        "--output_path", str(out_dir), "--log_samples", "--seed", "0",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(out_dir / "hf-datasets-cache"), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"{shlex.join(cmd)}\nrc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results_files = sorted(out_dir.rglob("results_*.json"))
    sample_files = sorted(out_dir.rglob(f"samples_{TASK}_*.jsonl"))
    assert results_files and sample_files, f"no results under {out_dir}:\n{proc.stderr[-3000:]}"
    results = json.loads(results_files[-1].read_text())
    samples = [json.loads(line) for line in sample_files[-1].read_text().splitlines() if line.strip()]
    return cmd, results, samples


def loglikelihoods(samples: list[dict]) -> dict[tuple[int, int], tuple[str, str, float]]:
    """{(doc_id, choice index): (context, continuation, loglikelihood)} from lm-eval's logged samples."""
    out = {}
    for sample in samples:
        arguments = sample["arguments"]  # {"gen_args_<i>": {"arg_0": context, "arg_1": continuation}}
        if isinstance(arguments, dict):
            arguments = [arguments[f"gen_args_{i}"] for i in range(len(arguments))]
        for i, (args, resp) in enumerate(zip(arguments, sample["resps"], strict=True)):
            context, continuation = (args["arg_0"], args["arg_1"]) if isinstance(args, dict) else args[:2]
            out[(int(sample["doc_id"]), i)] = (context, continuation, float(resp[0][0]))
    return out


def hf_loglikelihoods(model_dir: str, pairs: dict) -> dict:
    """{key: loglikelihood of continuation given context} by transformers' forward in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    out = {}
    with torch.no_grad():
        for key, (context, continuation) in pairs.items():
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            n_context = len(tokenizer(context, add_special_tokens=False).input_ids)
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
            out[key] = sum(logprobs[i - 1, whole[i]].item() for i in range(n_context, len(whole)))
    return out


def test_lm_eval_local_completions_matches_hf(tiny_checkpoint, launch_server, tmp_path):
    model_dir = tiny_checkpoint("qwen3")
    server = launch_server(model_dir, "--served-model-name", SERVED_MODEL_NAME)
    (tmp_path / "task").mkdir()
    task_dir = write_task(tmp_path / "task")

    ours_args = ",".join([
        f"model={SERVED_MODEL_NAME}", f"base_url={server.url}/v1/completions", "tokenizer_backend=huggingface",
        f"tokenizer={model_dir}", "tokenized_requests=True", "num_concurrent=1", "max_retries=1",
        f"max_length={256}",
    ])
    cmd, ours_results, ours_samples = run_lm_eval("local-completions", ours_args, task_dir, tmp_path / "ours")

    ours = loglikelihoods(ours_samples)
    n_requests = sum(len(choices) for _, choices, _ in QUESTIONS)
    assert len(ours) == n_requests, (len(ours), n_requests)
    hf = hf_loglikelihoods(model_dir, {key: (ctx, cont) for key, (ctx, cont, _) in ours.items()})
    deltas = {key: abs(ours[key][2] - hf[key]) for key in ours}
    worst = max(deltas, key=deltas.get)
    ours_acc = ours_results["results"][TASK]["acc,none"]
    hf_acc = sum(
        max(range(len(choices)), key=lambda i: hf[(doc_id, i)]) == answer
        for doc_id, (_, choices, answer) in enumerate(QUESTIONS)
    ) / len(QUESTIONS)
    print(f"\nlm-eval command: {shlex.join(cmd)}")
    print(f"accuracy: {ours_acc:.4f} (HF's loglikelihoods give {hf_acc:.4f}); {len(deltas)} loglikelihoods, "
          f"max |delta loglikelihood| vs HF {deltas[worst]:.3g} (doc {worst[0]} choice {worst[1]})")
    bad = {k: (ours[k][2], hf[k]) for k, d in deltas.items() if d > TOLERANCE}
    assert not bad, f"loglikelihoods (ours, HF) differ by more than {TOLERANCE}: {bad}"
    assert ours_acc == pytest.approx(hf_acc)
