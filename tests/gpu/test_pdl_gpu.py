"""GPU tier: programmatic dependent launch changes when kernels start, never what they compute.

A chain of the decode path's kernels (norm, one-row linear with and without split-K, SiLU, q/k
norm + rope, KV write, split-KV attention) captured in one CUDA graph with PDL on gives the same
bits as the same chain run eagerly with PDL off; and an engine decoding greedily under CUDA graphs
gives the same tokens and logprobs with PDL on and off.
"""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.metadata import AttentionMetadata
from engine.kernels import attention, pdl as pdl_module
from engine.kernels.activation import silu_and_mul_triton
from engine.kernels.gemv import GemvConfig, linear_triton
from engine.kernels.norm import rms_norm_triton
from engine.kernels.qk_norm_rope import qk_norm_rope_triton

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture
def set_pdl(monkeypatch):
    def set_(on: bool) -> None:
        monkeypatch.setenv("ROLLOUT_PDL", "1" if on else "0")
        pdl_module.pdl.cache_clear()
        assert pdl_module.pdl() is on

    yield set_
    monkeypatch.delenv("ROLLOUT_PDL")
    pdl_module.pdl.cache_clear()


def _layer_chain(t: dict) -> list[torch.Tensor]:
    """One decoder layer's decode-path kernels on one token, each reading what the one before wrote."""
    h, res = rms_norm_triton(t["x"], t["norm_w"], 1e-6, t["res"])
    qkv = linear_triton(h, t["w_qkv"])  # one row, no split
    q, k = qkv[:, :2048], qkv[:, 2048:3072]
    v = qkv[:, 3072:].reshape(1, 8, 128)
    q, k = qk_norm_rope_triton(t["pos"], q, k, t["qn"], t["kn"], 1e-6, t["cos"], t["sin"], 128)
    attention.write_kv_cache(k.reshape(1, 8, 128), v, t["kv"], t["slot"])
    o = attention.paged_attention(q.reshape(1, 16, 128), t["kv"], t["md"], 128**-0.5)  # split-KV at batch 1
    o = linear_triton(o.reshape(1, 2048), t["w_o"], None, GemvConfig(4, 512, split_k=4))  # split-K + reduce
    h2, res2 = rms_norm_triton(o, t["norm_w"], 1e-6, res)
    up = silu_and_mul_triton(linear_triton(h2, t["w_gu"]))
    return [qkv.clone(), o.clone(), res2.clone(), linear_triton(up, t["w_down"]), t["kv"].clone()]


def _inputs() -> dict:
    g = torch.Generator(device=DEV).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(torch.bfloat16)

    context, block = 700, 16
    num_blocks = context // block + 2
    md = AttentionMetadata.build([1], [context + 1], [list(range(num_blocks))[::-1]], block, device=DEV)
    return dict(
        x=rnd(1, 1024), res=rnd(1, 1024), norm_w=1 + rnd(1024, scale=0.1), w_qkv=rnd(4096, 1024, scale=0.03),
        qn=1 + rnd(128, scale=0.1), kn=1 + rnd(128, scale=0.1), pos=torch.tensor([context], device=DEV),
        cos=torch.randn(2048, 64, generator=g, device=DEV), sin=torch.randn(2048, 64, generator=g, device=DEV),
        kv=rnd(2, num_blocks, block, 8, 128), slot=md.slot_mapping,
        md=md, w_o=rnd(1024, 2048, scale=0.02), w_gu=rnd(6144, 1024, scale=0.03), w_down=rnd(1024, 3072, scale=0.02),
    )


def test_a_graph_of_pdl_kernels_gives_the_bits_of_eager_without_pdl(set_pdl):
    set_pdl(False)
    t = _inputs()
    kv0 = t["kv"].clone()
    expected = _layer_chain(t)
    set_pdl(True)
    t["kv"].copy_(kv0)
    _layer_chain(t)  # compiles the PDL variants outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = _layer_chain(t)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):  # every replay starts from the same cache
        t["kv"].copy_(kv0)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(out, expected):
            assert torch.equal(got, want)


def _greedy(path) -> tuple[list[list[int]], list[list[float]]]:
    llm = LLM(path, device="cuda", max_model_len=512, kv_cache_memory_bytes=1 << 28, max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 400 for j in range(5 + 11 * i)]} for i in range(5)]
    outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine_core.executor.worker.model_runner.cuda_graphs.num_replays > 0
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, logprobs


def test_greedy_decode_is_the_same_with_and_without_pdl(tiny_checkpoint, set_pdl):
    path = tiny_checkpoint("qwen3")
    set_pdl(False)
    without = _greedy(path)
    set_pdl(True)
    assert _greedy(path) == without  # batch 1 (the one-row linear path) first, then 5 rows
