"""Qwen3-MoE against HF transformers on tiny random checkpoints: greedy tokens, routed experts, weight sync of every expert, the TP refusal."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_forward_equivalence import engine_step, load_engine_model

from engine import LLM, SamplingParams
from engine.distributed.parallel_state import TensorParallelState
from engine.models.hf_layout import hf_weight_layout
from engine.models.loader import load_hf_config, load_model
from engine.models.moe import SparseMoeBlock
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from weight_transfer.base import SparseWeightPatch, register_engine_backend
from weight_transfer.checksums import hf_state_checksums
from weight_transfer.local import LocalWeightTransferEngine, make_update_info

PROMPTS = [[5, 17, 99, 230, 41], [300, 12, 7, 88, 150, 201, 33, 60, 9], [77, 78, 79]]
MAX_TOKENS = 8

VARIANTS = {
    "norm-topk": {},
    "no-norm-topk": {"norm_topk_prob": False},
    # 3 layers, the middle one dense (intermediate_size): MoE layers 0 and 2.
    "dense-layer": {"num_hidden_layers": 3, "mlp_only_layers": [1]},
    # transformers v5's in-memory naming of the experts (experts.gate_up_proj / experts.down_proj).
    "stacked-experts": {"stacked_experts": True},
}


def _llm(path: str, **kwargs) -> LLM:
    args = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, enable_prefix_caching=True)
    args.update(kwargs)
    return LLM(path, **args)


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    return model


@torch.no_grad()
def _hf_greedy(model) -> list[list[int]]:
    outs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def _engine_greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf(tiny_checkpoint, variant):
    path = tiny_checkpoint("qwen3_moe", **VARIANTS[variant])
    # A small token budget: prompts are prefilled in chunks beside other requests' decodes.
    assert _engine_greedy(_llm(path, max_num_batched_tokens=4)) == _hf_greedy(_hf_model(path))


def test_sparse_and_dense_layers_follow_hf(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP", "SparseMoeBlock", "LlamaMLP", "LlamaMLP"]  # (i + 1) % 2 == 0, minus layer 3
    hf = _hf_model(path)
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == ["Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeMLP"]


@pytest.mark.parametrize("variant", ["norm-topk", "dense-layer"])
def test_routed_experts_equal_hf_router_top_k(tiny_checkpoint, variant):
    path = tiny_checkpoint("qwen3_moe", **VARIANTS[variant])
    model = load_engine_model(path)
    config = load_hf_config(path)
    num_moe_layers = len([m for m in model.modules() if isinstance(m, SparseMoeBlock)])
    assert num_moe_layers == (2 if variant == "dense-layer" else config.num_hidden_layers)

    hf = _hf_model(path)
    a, b = PROMPTS[1], PROMPTS[0]
    with torch.no_grad():
        expected = []
        for prompt in (a, b):
            router_logits = hf(torch.tensor([prompt]), output_router_logits=True).router_logits  # per MoE layer [T, E]
            assert len(router_logits) == num_moe_layers
            top_k = [torch.topk(torch.softmax(logits.float(), -1), config.num_experts_per_tok, -1).indices for logits in router_logits]
            expected.append(torch.stack(top_k, dim=1).to(torch.int32))  # [T, L, K]

    assert model.routed_expert_ids() is None  # off by default
    model.set_routing_capture(True)
    engine_step(model, [(a, 0, [0, 1, 2]), (b, 0, [3, 4])])  # two requests in one forward: rows in batch order
    routed = model.routed_expert_ids()
    assert routed.shape == (len(a) + len(b), num_moe_layers, config.num_experts_per_tok) and routed.dtype == torch.int32
    assert torch.equal(routed, torch.cat(expected))
    assert len(set(routed.flatten().tolist())) > config.num_experts_per_tok  # the routing really varies

    engine_step(model, [(a + [7], len(a), [0, 1, 2])])  # a decode step: one token, captured anew
    assert model.routed_expert_ids().shape == (1, num_moe_layers, config.num_experts_per_tok)
    model.set_routing_capture(False)
    assert model.routed_expert_ids() is None


class _TogetherBackend(LocalWeightTransferEngine):
    """The local backend declaring its tensors valid for the whole call: the worker lands a call with one
    multi-tensor copy through a reused landing plan (the views_stable_per_call path of ipc)."""

    views_stable_per_call = True

    def parse_update_info(self, update_info):
        info = super().parse_update_info(update_info)
        info.reuse_key = tuple(info.names)
        return info


class _PatchBackend(LocalWeightTransferEngine):
    """The local backend delivering each tensor as a sparse patch of all its coordinates (the sparse_nccl path)."""

    def receive_weights(self, info):
        for name, tensor in super().receive_weights(info):
            flat = tensor.reshape(-1)
            yield name, SparseWeightPatch(name, torch.arange(flat.numel(), dtype=torch.int32), flat, tuple(tensor.shape))


register_engine_backend("moe-test-together", _TogetherBackend)
register_engine_backend("moe-test-patch", _PatchBackend)


def test_weight_update_lands_every_expert(tiny_checkpoint):
    old = tiny_checkpoint("qwen3_moe", **VARIANTS["dense-layer"])
    new = tiny_checkpoint("qwen3_moe", seed=1, **VARIANTS["dense-layer"])
    old_state, new_state = load_file(f"{old}/model.safetensors"), load_file(f"{new}/model.safetensors")
    llm = _llm(old)
    core = llm.engine_core

    info = core.weight_info()["weights"]
    expert = "model.layers.2.mlp.experts.7.up_proj.weight"  # a per-expert HF tensor: its own name, shape and no shard
    assert info[expert]["shape"] == list(new_state[expert].shape) == [32, 64] and info[expert]["shard"] is None
    assert core.weight_checker(hf_state_checksums(old_state))["match"]  # every name of the checkpoint, none more

    def update(backend: str, state: dict, encoding: str = "tensors") -> None:
        items = sorted(state.items())
        core.init_weight_transfer_engine({"backend": backend})
        core.start_weight_update()
        half = len(items) // 2
        core.update_weights(make_update_info(items[:half], encoding))
        core.update_weights(make_update_info(items[half:], encoding))
        core.finish_weight_update()
        result = core.weight_checker(hf_state_checksums(state))
        assert result["match"], (backend, encoding, result)

    # Every landing path, each time from the other weights so every expert must really move.
    for backend, encoding in [("local", "tensors"), ("local", "b64"), ("moe-test-together", "tensors"), ("moe-test-patch", "tensors")]:
        update(backend, new_state, encoding)
        update(backend, old_state, encoding)
    update("moe-test-together", new_state)  # the reused landing plan

    # An aborted update puts every expert back.
    core.init_weight_transfer_engine({"backend": "local"})
    core.start_weight_update()
    core.update_weights(make_update_info(sorted(old_state.items())))
    core.abort_weight_update()
    assert core.weight_checker(hf_state_checksums(new_state))["match"]

    assert _engine_greedy(llm) == _hf_greedy(_hf_model(new))
    core.shutdown_weight_transfer_engine()


def test_layout_names_each_expert_as_a_slice_of_the_stacked_parameters(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    layout = hf_weight_layout(model)
    assert set(layout) == set(load_file(f"{path}/model.safetensors"))
    experts = model.model.layers[1].mlp.experts
    slot = layout["model.layers.1.mlp.experts.5.up_proj.weight"]
    assert slot.param is experts.w13_weight and slot.shape == (32, 64)
    assert torch.equal(slot.tensor(), experts.w13_weight.data[5, 32:])
    assert slot.tensor().data_ptr() == experts.w13_weight.data[5, 32:].data_ptr()  # a view: lands in place
    assert torch.equal(layout["model.layers.1.mlp.experts.5.down_proj.weight"].tensor(), experts.w2_weight.data[5])


def test_missing_expert_tensor_is_reported(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    state = load_file(f"{path}/model.safetensors")
    del state["model.layers.0.mlp.experts.3.gate_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"missing parameters: \['model\.layers\.0\.mlp\.experts\.w13_weight'\]"):
        load_model(str(tmp_path), load_hf_config(str(tmp_path)), torch.float32, "cpu")


def test_dummy_weights_build_from_config_alone(tiny_checkpoint):
    llm = _llm(tiny_checkpoint("qwen3_moe"), load_format="dummy")
    model = llm.engine_core.executor.worker.model
    assert model.model.layers[0].mlp.experts.w13_weight.std() > 0.01  # drawn, not left at zero
    assert all(len(tokens) == MAX_TOKENS for tokens in _engine_greedy(llm))


def test_tensor_parallel_is_refused_clearly(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ValueError, match=r"tensor_parallel_size: .*mixture-of-experts.*tensor_parallel_size 1 only"):
        _llm(path, tensor_parallel_size=2, distributed_executor_backend="mp")  # before any worker starts
    # The model itself refuses too (a worker building it under tensor parallelism).
    monkeypatch.setattr("engine.models.moe.get_tp", lambda: TensorParallelState(rank=0, size=2))
    message = "Qwen3MoeForCausalLM: mixture-of-experts models run with tensor_parallel_size 1"
    with pytest.raises(ValueError, match=message):
        Qwen3MoeForCausalLM(load_hf_config(path))
