"""GPU tier: the LoRA shrink/expand Triton pair against its torch reference in bf16 (also inside a CUDA graph), and an
engine with LoRA whose CUDA-graph decode steps give eager's tokens for a batch mixing three adapters and the base model."""

from __future__ import annotations

import gc
import json
import os
import random

import numpy as np
import pytest
import torch

from engine.kernels.lora import lora_expand_triton, lora_num_splits, lora_shrink_triton
from engine.lora.ops import lora_expand_slots_ref, lora_shrink_slots_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"
MAX_LORAS, RANK = 4, 16
# Qwen3-0.6B's LoRA layers: (in, slice widths) of qkv, o, gate/up, down.
SHAPES = [(1024, (2048, 1024, 1024)), (2048, (1024,)), (1024, (3072, 3072)), (3072, (1024,))]
BF16_REL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in kernel output"
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _slots(num_tokens: int, seed: int) -> torch.Tensor:
    """Each token's slot: every slot and -1 (no adapter) mixed, in runs like a batch of prefill chunks and decodes."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, MAX_LORAS, (num_tokens,), generator=g, dtype=torch.int32)
    if num_tokens > 40:
        slots[:24] = 2  # a prefill chunk of one adapter
    return slots.to(DEV)


def _weights(k: int, widths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked A [max_loras, slices * rank, k] and B [max_loras, sum(widths), rank] in bf16, scaled like adapters;
    slot 3 has rank 5 (rows of A and columns of B past it zero), slot 1 has nothing in the last slice."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    a = (torch.randn(MAX_LORAS, len(widths) * RANK, k, device=DEV, generator=g) / k**0.5).to(torch.bfloat16)
    b = (0.5 * torch.randn(MAX_LORAS, sum(widths), RANK, device=DEV, generator=g) / RANK**0.5).to(torch.bfloat16)
    for s in range(len(widths)):
        a[3, s * RANK + 5:(s + 1) * RANK] = 0
    b[3, :, 5:] = 0
    a[1, (len(widths) - 1) * RANK:] = 0
    b[1, sum(widths) - widths[-1]:] = 0
    return a, b


def _reference(x, a, b, slots, y, widths):
    """The references in float32 over the same bf16 inputs: [T, slices * rank] and y + delta."""
    buf = lora_shrink_slots_ref(x.float(), a.float(), slots, torch.empty(x.shape[0], a.shape[1], device=DEV))
    want = y.float()
    lora_expand_slots_ref(buf, b.float(), slots, want, 0, widths)
    return buf, want


def _buffer(num_tokens: int, a: torch.Tensor, split: bool) -> torch.Tensor:
    """The shrink's output: [T, slices * rank] bf16, or float32 split-K partials as LoRALinear uses them."""
    if not split:
        return torch.empty(num_tokens, a.shape[1], device=DEV, dtype=torch.bfloat16)
    return torch.empty(lora_num_splits(a.shape[2]), num_tokens, a.shape[1], device=DEV, dtype=torch.float32)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split-k"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("k,widths", SHAPES)
def test_kernel_pair_matches_the_reference_in_bf16(k, widths, num_tokens, split):
    a, b = _weights(k, widths, seed=k + len(widths))
    slots = _slots(num_tokens, seed=num_tokens)
    x = torch.randn(num_tokens, k, device=DEV).to(torch.bfloat16)
    y = torch.randn(num_tokens, sum(widths), device=DEV).to(torch.bfloat16)
    buf_ref, want = _reference(x, a, b, slots, y, widths)
    buf = lora_shrink_triton(x, a, slots, _buffer(num_tokens, a, split))
    got = y.clone()
    lora_expand_triton(buf, b, slots, got, 0, widths)
    if split:
        buf = buf.sum(0)
    none = slots < 0
    assert (buf[none] == 0).all()
    assert rel_err(buf[~none], buf_ref[~none]) < BF16_REL
    assert torch.equal(got[none], y[none])  # rows without an adapter: untouched
    assert rel_err(got[~none] - y[~none].float(), want[~none] - y[~none].float()) < BF16_REL  # the delta itself


@pytest.mark.parametrize("k,widths", SHAPES)
def test_split_k_rows_have_the_same_bits_in_any_batch(k, widths):
    """A token's delta does not depend on the other tokens of the step (graph padding, a bigger batch): the split
    count is fixed by the width, so an eager step and a graph replay of another size agree bit for bit."""
    a, b = _weights(k, widths, seed=5)
    slots = _slots(300, seed=9)
    x = torch.randn(300, k, device=DEV).to(torch.bfloat16)
    y = torch.randn(300, sum(widths), device=DEV).to(torch.bfloat16)
    outs = []
    for num_tokens in (300, 37, 5):
        out = y[:num_tokens].clone()
        buf = lora_shrink_triton(x[:num_tokens], a, slots[:num_tokens], _buffer(num_tokens, a, split=True))
        lora_expand_triton(buf, b, slots[:num_tokens], out, 0, widths)
        outs.append(out)
    assert torch.equal(outs[0][:37], outs[1]) and torch.equal(outs[0][:5], outs[2])
    # Programs taking the tokens grouped by slot (LoRAMapping.token_order), as the engine runs them: the same bits.
    out = y.clone()
    order = torch.argsort(slots, stable=True).to(torch.int32)
    buf = lora_shrink_triton(x, a, slots, _buffer(300, a, split=True), order)
    lora_expand_triton(buf, b, slots, out, 0, widths, order)
    assert torch.equal(out, outs[0])


def test_kernel_pair_in_a_cuda_graph_reads_new_slots_and_new_weights():
    """Captured once, replayed after token_slots and the slot tensors change in place (adapter paging)."""
    k, widths, num_tokens = 1024, (2048, 1024, 1024), 48
    a, b = _weights(k, widths, seed=1)
    x = torch.randn(num_tokens, k, device=DEV).to(torch.bfloat16)
    y0 = torch.randn(num_tokens, sum(widths), device=DEV).to(torch.bfloat16)
    slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=DEV)  # nothing loaded at capture
    y = y0.clone()
    buf = _buffer(num_tokens, a, split=True)  # as LoRALinear runs the pair

    def step():
        y.copy_(y0)
        lora_shrink_triton(x, a, slots, buf)
        lora_expand_triton(buf, b, slots, y, 0, widths)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (2, 3):
        slots.copy_(_slots(num_tokens, seed=seed))
        new_a, new_b = _weights(k, widths, seed=seed)
        a.copy_(new_a)
        b.copy_(new_b)
        graph.replay()
        torch.cuda.synchronize()
        _, want = _reference(x, a, b, slots, y0, widths)
        none = slots < 0
        assert torch.equal(y[none], y0[none])
        assert rel_err(y[~none] - y0[~none].float(), want[~none] - y0[~none].float()) < BF16_REL


# ---- the engine: CUDA graphs with LoRA on ----

MAX_TOKENS = 16
TARGETS = {  # adapter -> (rank, target modules): ranks below the maximum, fused q/k/v and gate/up slices left out
    "qv": (4, ("q_proj", "v_proj")),
    "mixed": (8, ("k_proj", "o_proj", "gate_proj")),
    "all": (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}


def _write_adapter(base: str, out_dir: str, rank: int, targets: tuple[str, ...], seed: int) -> str:
    """A PEFT adapter directory for the checkpoint at `base` (adapter_config.json + adapter_model.safetensors,
    PEFT's names), with random A and B: written by hand, as PEFT is not on the GPU machine."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.lora.peft_loader import peft_tensor_name

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(os.path.join(base, "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            module, _, leaf = key.rpartition(".")
            if leaf != "weight" or module.rpartition(".")[2] not in targets:
                continue
            out_features, in_features = f.get_slice(key).get_shape()
            tensors[peft_tensor_name(module, "A")] = torch.randn(rank, in_features, generator=g) / in_features**0.5
            tensors[peft_tensor_name(module, "B")] = 0.3 * torch.randn(out_features, rank, generator=g)
    assert tensors
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
              "bias": "none", "lora_dropout": 0.0}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


@pytest.fixture(scope="module")
def lora_setup(tiny_checkpoint, tmp_path_factory):
    from engine import LoRARequest

    base = tiny_checkpoint("llama")
    adapters = {name: LoRARequest(name, i, _write_adapter(base, str(tmp_path_factory.mktemp(f"gpu-lora-{name}")),
                                                          rank, targets, seed=i))
                for i, (name, (rank, targets)) in enumerate(TARGETS.items(), start=1)}
    rng = random.Random(0)
    shared = [rng.randrange(3, 400) for _ in range(20)]
    prompts = [(shared if i % 3 else []) + [rng.randrange(3, 400) for _ in range(5 + 3 * i)] for i in range(13)]
    assignment = [[adapters["qv"], adapters["mixed"], adapters["all"], None][i % 4] for i in range(len(prompts))]
    return base, prompts, assignment


def _lora_engine(base: str, **kwargs):
    from engine import LLM

    return LLM(base, device="cuda", max_model_len=256, kv_cache_memory_bytes=1 << 28, max_num_seqs=16,
               enable_lora=True, max_loras=4, max_lora_rank=16, disable_log_stats=True, **kwargs)


def _greedy(llm, prompts, loras) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each sequence's tokens before the first difference (as tests/gpu/test_engine_gpu.py)."""
    total = 0.0
    for x, y in zip(a, b):
        total += next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / len(x)
    return total / len(a)


def _free(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def eager_tokens(lora_setup):
    base, prompts, assignment = lora_setup
    llm = _lora_engine(base, enforce_eager=True)
    assert llm.engine_core.executor.worker.model_runner.cuda_graphs is None
    tokens = _greedy(llm, prompts, assignment), _greedy(llm, prompts, None)  # with adapters, and the base model
    _free(llm)
    return tokens


@pytest.fixture(scope="module")
def graphed_llm(lora_setup):
    llm = _lora_engine(lora_setup[0])
    yield llm
    _free(llm)


def test_cuda_graphs_with_lora_give_eagers_tokens_for_mixed_adapters(lora_setup, eager_tokens, graphed_llm):
    _, prompts, assignment = lora_setup
    eager, eager_base = eager_tokens
    graphs = graphed_llm.engine_core.executor.worker.model_runner.cuda_graphs
    assert graphs is not None and graphs.lora_slots is not None
    replays = graphs.num_replays
    graphed = _greedy(graphed_llm, prompts, assignment)
    assert graphs.num_replays > replays  # decode steps ran as graph replays
    # bf16: the base model's GEMMs may round differently at a graph's padded batch size (as in test_engine_gpu).
    assert _agreement(graphed, eager) >= 0.95, (graphed, eager)
    # The adapters matter: rows with one differ from the base model's tokens, rows without one do not.
    with_lora = [i for i, lora in enumerate(assignment) if lora is not None]
    assert _agreement([graphed[i] for i in with_lora], [eager_base[i] for i in with_lora]) < 0.5
    without = [i for i, lora in enumerate(assignment) if lora is None]
    assert _agreement([graphed[i] for i in without], [eager_base[i] for i in without]) >= 0.95


def test_a_decode_graph_replay_reads_each_rows_adapter_slot(lora_setup, graphed_llm):
    """Hidden states of one replay with adapters on two of three rows against the eager forward with the same slots."""
    from engine.attention.metadata import AttentionMetadata
    from engine.forward_context import set_forward_context
    from engine.lora.ops import make_lora_mapping

    _, _, assignment = lora_setup
    worker = graphed_llm.engine_core.executor.worker
    runner, graphs = worker.model_runner, worker.model_runner.cuda_graphs
    qv, full = assignment[0], assignment[2]
    lora_slots = worker.lora_manager.activate(np.array([qv.lora_int_id, 0, full.lora_int_id]),
                                              {qv.lora_int_id: qv, full.lora_int_id: full})
    assert lora_slots.tolist()[1] == -1 and min(lora_slots[[0, 2]]) >= 0
    seq_lens = [5, 40, 17]
    tables = [[1], [2, 3, 4], [5, 6]]

    class Batch:  # the fields replay() reads
        num_reqs = 3
        num_tokens = 3
        input_ids = torch.randint(3, 400, (3,)).numpy()
        positions = torch.tensor([s - 1 for s in seq_lens]).numpy()
        slot_mapping = torch.tensor([t[(s - 1) // 16] * 16 + (s - 1) % 16 for t, s in zip(tables, seq_lens)]).numpy()
        seq_lens_np = torch.tensor(seq_lens, dtype=torch.int32).numpy()
        block_table = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32).numpy()

    Batch.seq_lens = Batch.seq_lens_np
    size = graphs.bucket_for(Batch)
    assert size == (4, 1)
    out = graphs.replay(size, Batch, lora_slots=lora_slots).clone()
    base_out = graphs.replay(size, Batch).clone()  # the same rows, no adapter
    md = AttentionMetadata.build([1, 1, 1], seq_lens, tables, 16, device="cuda")
    with torch.inference_mode(), set_forward_context(md, make_lora_mapping(lora_slots, torch.device("cuda"))):
        ref = runner.model(torch.from_numpy(Batch.input_ids).cuda(), torch.from_numpy(Batch.positions).cuda())
    for row in range(3):
        assert rel_err(out[row], ref[row]) < 1e-2, row
    assert rel_err(base_out[1], out[1]) < 1e-2  # the row without an adapter
    assert rel_err(base_out[0], out[0]) > 5e-2 and rel_err(base_out[2], out[2]) > 5e-2
