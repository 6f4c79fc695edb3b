"""Peer run for offline_throughput.py: vLLM's LLM.generate on a workload file, in vLLM's own interpreter (its CPU build's venv).

Usage (offline_throughput.py --peer vllm does this): <vllm venv>/bin/python vllm_peer.py IN.json OUT.json
IN.json holds the checkpoint path, dtype, the engine limits and the requests (prompt token ids
and max_tokens); every request runs to its max_tokens (ignore_eos), as ours do. OUT.json gets
the timing and vLLM's version. Imports nothing of this repository, so any interpreter with vLLM
installed can run it; the __main__ guard matters because vLLM starts its engine core with spawn.
"""

from __future__ import annotations

import json
import sys
import time


def main(in_path: str, out_path: str) -> None:
    with open(in_path) as f:
        spec = json.load(f)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
        seed=spec["seed"],
        **({"max_num_batched_tokens": spec["max_num_batched_tokens"]} if spec.get("max_num_batched_tokens") else {}),
    )
    work = spec["requests"]  # [[prompt ids, max_tokens], ...]

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=spec["temperature"], top_p=spec.get("top_p", 1.0), max_tokens=n, ignore_eos=True)

    warm = work[:4]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in warm], [params(8)] * len(warm), use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up prompts must not give the timed run cache hits
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
    start = time.perf_counter()
    outputs = llm.generate(prompts, [params(n) for _, n in work], use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    if num_out != sum(n for _, n in work):
        raise SystemExit(f"vLLM produced {num_out} tokens, expected {sum(n for _, n in work)}: a request stopped early")
    result = {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed,
              "vllm": vllm.__version__, "torch": torch.__version__, "frontend_torch_threads": torch.get_num_threads(),
              "dtype": spec["dtype"]}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
