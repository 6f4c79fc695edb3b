"""GPU tier: the ipc backend over real CUDA IPC - this process is the trainer, an EngineCore process on the same GPU receives."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.sampling_params import SamplingParams
from rollout.worker import RolloutWorker
from weight_transfer.base import ModuleSource, WeightSource, trainer_init
from weight_transfer.checksums import hf_state_checksums
from weight_transfer.clients import LocalWeightSyncClient
from weight_transfer.ipc import IPCTrainerInitInfo

pytestmark = pytest.mark.gpu

BUFFER = 32 << 10  # bf16 tiny llama: several packs, and the embedding / lm_head (64 KiB) do not fit one


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def worker(checkpoint):
    """A bf16 engine in its own process (multiprocess=True) on cuda:0, the GPU this process trains on."""
    worker = RolloutWorker(
        checkpoint, multiprocess=True, device="cuda", dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=1 << 26
    )
    yield worker
    worker.shutdown()


def _trainer_model(path: str, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Master weights of `dtype` on the GPU, every parameter changed (deterministically by seed)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.to(dtype).cuda()


def _source(model: torch.nn.Module) -> ModuleSource:
    return ModuleSource(model, dtype=torch.bfloat16)  # float32 master weights -> bf16 engine


def _engine_has(worker: RolloutWorker, model: torch.nn.Module) -> bool:
    return worker.weight_checker(hf_state_checksums(model.state_dict(), dtype=torch.bfloat16))["match"]


def _allocated() -> int:
    """Bytes this process holds on the GPU; exported buffers an importer still maps would stay counted (limbo)."""
    gc.collect()  # a caught error's traceback may hold the frame of the tensor being copied
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    return torch.cuda.memory_allocated()


class _FailingSource(WeightSource):
    def __init__(self, model: torch.nn.Module, at: str) -> None:
        self.inner, self.at = _source(model), at

    def _metadata(self):
        return self.inner.metadata

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.inner.iter_full():
            if name == self.at:
                raise OSError("shard lost")
            yield name, tensor

    def iter_local(self):
        return self.iter_full()


def test_cuda_ipc_sync_exports_once_reuses_handles_and_frees_everything(worker, checkpoint):
    model = _trainer_model(checkpoint, seed=21)
    baseline = _allocated()
    engine = trainer_init(
        IPCTrainerInitInfo(packed_buffer_size_bytes=BUFFER, timeout_s=60),
        client=LocalWeightSyncClient(worker),
        source=_source(model),
    )
    try:
        first = engine.send_weights(weight_version="gpu-1")
        assert _engine_has(worker, model) and worker.get_weight_version() == "gpu-1"
        out = worker.generate({"prompt_token_ids": [5, 17, 99]}, SamplingParams(temperature=0.0, max_tokens=4))[0]
        assert len(out.outputs[0].token_ids) == 4

        with torch.no_grad():  # the next training step: same tensors, new values
            for p in model.parameters():
                p.mul_(-0.5)
        second = engine.send_weights(weight_version="gpu-2")
        assert _engine_has(worker, model) and worker.get_weight_version() == "gpu-2"
        assert first.extra["num_packs"] >= 4 and first.extra["num_exports"] == 3  # 2 ring buffers + oversize
        assert second.extra["num_exports"] == 0 and second.extra["buffer_ids"] == first.extra["buffer_ids"]
        assert _allocated() > baseline  # kept buffers live between syncs
    finally:
        engine.shutdown()
    # The engine closed every handle it opened, so no exported block waits in limbo: all freed.
    assert _allocated() == baseline


def test_cuda_ipc_fresh_buffers_per_sync_and_a_failed_sync_restores(worker, checkpoint):
    model = _trainer_model(checkpoint, seed=22)
    other = _trainer_model(checkpoint, seed=23)
    baseline = _allocated()
    info = IPCTrainerInitInfo(packed_buffer_size_bytes=BUFFER, packed_num_buffers=3, timeout_s=60, keep_buffers=False)
    engine = trainer_init(info, client=LocalWeightSyncClient(worker))
    try:
        engine.send_weights(_source(model), weight_version="fresh-1")
        assert _engine_has(worker, model)
        assert _allocated() == baseline  # freed right after the sync: the engine let go at finish

        with pytest.raises(RuntimeError, match=r"reading 'model.layers.1.mlp.up_proj.weight' from the source failed"):
            engine.send_weights(_FailingSource(other, "model.layers.1.mlp.up_proj.weight"), weight_version="broken")
        assert _engine_has(worker, model) and worker.get_weight_version() == "fresh-1"  # old weights restored
        assert _allocated() == baseline  # also after a failure: every export was closed or released

        engine.send_weights(_source(other), weight_version="fresh-2")
        assert _engine_has(worker, other) and worker.get_weight_version() == "fresh-2"
    finally:
        engine.shutdown()
    assert _allocated() == baseline


@pytest.fixture(scope="module")
def lora_worker(checkpoint):
    """A bf16 engine process with LoRA on cuda:0: one device slot, rank up to 8."""
    worker = RolloutWorker(checkpoint, multiprocess=True, device="cuda", dtype="bfloat16", max_model_len=128,
                           kv_cache_memory_bytes=1 << 26, enable_lora=True, max_loras=1, max_lora_rank=8)
    yield worker
    worker.shutdown()


def test_cuda_ipc_adapter_syncs_in_one_call_land_bit_identical(lora_worker, checkpoint, tmp_path):
    """A trainer's bf16 PEFT adapter (every projection, fused q/k/v and gate/up included) synced back to back
    over CUDA IPC: each sync one engine call (apply_weight_update) into the adapter's two recurring versions in
    turn; after each, the engine's adapter is the trainer's bit for bit under the sync's version, the base model
    untouched; a NaN sync is refused and changes nothing, and the next one lands."""
    from peft import LoraConfig, get_peft_model

    from engine.lora.request import LoRARequest
    from weight_transfer.checksums import lora_state_checksums
    from weight_transfer.lora import adapter_source

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32),
                                LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    peft_model.save_pretrained(str(tmp_path))
    lora = LoRARequest("gpu", 1, str(tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    lora_worker.add_lora(lora)
    lora_worker.generate([{"prompt_token_ids": [5, 6, 7]}], params, lora_request=lora)  # it holds the slot now
    base = lora_worker.weight_checker()["checksums"]
    base = {k: v for k, v in base.items() if not k.startswith("lora:")}
    peft_model = peft_model.to(torch.bfloat16).cuda()
    source = adapter_source(peft_model, "gpu")
    assert source.plain_tensors() is not None  # the planned fill (one multi-tensor copy a sync)

    def trainer_tensors() -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in source.iter_full()}

    trainer = trainer_init(IPCTrainerInitInfo(timeout_s=60.0), client=LocalWeightSyncClient(lora_worker),
                           source=source)
    try:
        for i in range(4):
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if ".lora_" in name:
                        param.add_(torch.randn_like(param) * 0.01)
            stats = trainer.send_weights(weight_version=f"gpu-{i}")
            assert stats.extra["num_packs"] == 1 and set(stats.extra["phases_s"]) == {"send", "apply"}
            assert lora_worker.weight_checker({**base, **lora_state_checksums("gpu", trainer_tensors())})["match"]
            assert lora_worker.get_weight_version(lora_name="gpu") == f"gpu-{i}"
        good = trainer_tensors()
        with torch.no_grad():
            next(p for n, p in peft_model.named_parameters() if ".lora_A" in n)[0, 0] = float("nan")
        with pytest.raises(RuntimeError, match="contains NaN or inf"):
            trainer.send_weights(weight_version="gpu-nan")
        assert lora_worker.weight_checker({**base, **lora_state_checksums("gpu", good)})["match"]
        assert lora_worker.get_weight_version(lora_name="gpu") == "gpu-3"
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if ".lora_" in name:
                    param.copy_(good[name.replace(".default", "")])
            next(p for n, p in peft_model.named_parameters() if ".lora_A" in n).mul_(2)
        trainer.send_weights(weight_version="gpu-after")
        assert lora_worker.weight_checker({**base, **lora_state_checksums("gpu", trainer_tensors())})["match"]
    finally:
        trainer.shutdown()
    [out] = lora_worker.generate([{"prompt_token_ids": [5, 6, 7]}], params, lora_request=lora)
    assert [version for version, _, _ in out.outputs[0].weight_versions] == ["gpu-after"]
    assert lora_worker.get_weight_version() == "default"
