"""Adapter weight sync (issue 26, step 3): a trainer's PEFT adapter tensors into a running engine's adapter, by name.

After a sync, the adapter's requests equal HF + PEFT merged with the new tensors, every other request is
unchanged bit for bit, the engine's adapter checksums are the trainer's, and only the adapter's bytes moved.
Bad syncs are refused naming the problem and change nothing; an aborted one restores the old adapter; no
prefix-cache block computed with the old tensors is hit after the sync.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from engine import LLM, SamplingParams
from weight_transfer.base import trainer_init
from weight_transfer.checksums import lora_state_checksums
from weight_transfer.clients import LocalWeightSyncClient
from weight_transfer.local import make_update_info
from weight_transfer.lora import adapter_source
from peft_reference import MAX_TOKENS, _hf_model, make_prompts, reference, reference_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
PROMPTS = make_prompts(seed=7)[4:]  # four prompts of 21..50 tokens (full blocks of 16 to hit in the prefix cache)
ENGINE_ARGS = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, enable_lora=True, max_loras=2,
                   max_lora_rank=16, disable_log_stats=True)
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"  # a tensor adapter "qv" has (rank 4)


def _trained(base_model: str, adapter_path: str, seed: int) -> PeftModel:
    """The adapter as a trainer holds it (a PeftModel), its LoRA tensors moved as a training step would."""
    model = PeftModel.from_pretrained(_hf_model(base_model), adapter_path, is_trainable=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


def _refs(base_model: str, adapter_path: str):
    merged = reference_model(base_model, adapter_path)
    return [reference(merged, p, MAX_TOKENS) for p in PROMPTS]


def sync_fixtures(seed: int, tag: str):
    """The old_refs, trained and llm fixtures of a sync test module, its trained adapter made with `seed`:
    `old_refs, trained, llm = sync_fixtures(...)` at the module's top level."""

    @pytest.fixture(scope="module")
    def old_refs(base_model, adapters):
        """HF + PEFT merged with adapter "qv" as loaded."""
        return _refs(base_model, adapters["qv"].lora_path)

    @pytest.fixture(scope="module")
    def trained(base_model, adapters, tmp_path_factory):
        """(the trainer's PeftModel for adapter "qv" after a step, HF + PEFT merged with its tensors)."""
        model = _trained(base_model, adapters["qv"].lora_path, seed=seed)
        saved = tmp_path_factory.mktemp(f"qv-trained{tag}")
        model.save_pretrained(str(saved))
        return model, _refs(base_model, str(saved))

    @pytest.fixture
    def llm(base_model):
        llm = LLM(base_model, **ENGINE_ARGS)
        yield llm
        llm.shutdown()

    return old_refs, trained, llm


old_refs, trained, llm = sync_fixtures(seed=11, tag="")


def _run(generate, lora) -> list[tuple[list[int], list[float], int]]:
    """(tokens, their logprobs, cached prompt tokens) per prompt, one request at a time (so the cache can serve)."""
    out = []
    for prompt in PROMPTS:
        [o] = generate([{"prompt_token_ids": prompt}], PARAMS, lora_request=lora)
        c = o.outputs[0]
        out.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], o.num_cached_tokens))
    return out


def _outputs(runs):
    return [(tokens, logprobs) for tokens, logprobs, _ in runs]


def _assert_matches(runs, refs) -> None:
    for i, ((tokens, logprobs, _), want) in enumerate(zip(runs, refs)):
        assert tokens == want.token_ids, f"prompt {i}"
        assert max(abs(g - w) for g, w in zip(logprobs, want.logprobs)) < 1e-4, f"prompt {i}"


def _peft_tensors(model: PeftModel) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in adapter_source(model, "qv").iter_full()}


def _lora_sums(engine, lora_name: str) -> dict[str, str]:
    prefix = f"lora:{lora_name}:"
    return {k: v for k, v in engine.weight_checker()["checksums"].items() if k.startswith(prefix)}


def _gen(llm):
    return lambda prompts, params, lora_request: llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)


def test_local_sync_serves_the_new_adapter_and_changes_nothing_else(llm, base_model, adapters, old_refs, trained):
    """The local backend in-process: HF + PEFT with the new tensors, others bit for bit, checksums, bytes, versions,
    and the prefix cache: the synced adapter hits nothing of before, the others and the base model keep theirs."""
    qv, mixed = adapters["qv"], adapters["mixed"]
    model, new_refs = trained
    generate = _gen(llm)
    base_first, mixed_first, qv_before = _run(generate, None), _run(generate, mixed), _run(generate, qv)
    # Run again, with their prompts cached: what they must give after the sync (whose cache they keep), bit for bit.
    base_before, mixed_before = _run(generate, None), _run(generate, mixed)
    _assert_matches(qv_before, old_refs)
    assert [cached for *_, cached in _run(generate, qv)] == [16 * (len(p) // 16) for p in PROMPTS]  # all cached now
    old_sums = _lora_sums(llm, "qv")
    new_tensors = _peft_tensors(model)
    assert sorted(old_sums) == sorted(lora_state_checksums("qv", new_tensors))  # the same tensors by name...
    assert old_sums != lora_state_checksums("qv", new_tensors)  # ... with other values

    source = adapter_source(model, "qv")
    trainer = trainer_init({"backend": "local"}, client=LocalWeightSyncClient(llm), source=source)
    stats = trainer.send_weights(weight_version="step-1")
    trainer.shutdown()

    # Only the adapter's bytes moved: its PEFT tensors, a small fraction of the model's.
    adapter_bytes = sum(t.nbytes for t in new_tensors.values())
    model_bytes = sum(p.nbytes for name, p in model.named_parameters() if ".lora_" not in name)
    assert stats.bytes_sent == adapter_bytes == source.num_bytes and stats.num_tensors == len(new_tensors)
    assert stats.bytes_sent * 20 < model_bytes

    qv_after = _run(generate, qv)
    _assert_matches(qv_after, new_refs)
    # No block of the old tensors is hit: the prompts hit only what they share with each other since the sync,
    # as they did in a cache that was empty (the base model's first run).
    assert [cached for *_, cached in qv_after] == [cached for *_, cached in base_first]
    assert qv_after[0][2] == 0
    assert [cached for *_, cached in _run(generate, qv)] == [16 * (len(p) // 16) for p in PROMPTS]  # the new ones are
    base_after, mixed_after = _run(generate, None), _run(generate, mixed)
    assert _outputs(base_after) == _outputs(base_before) and _outputs(mixed_after) == _outputs(mixed_before)
    assert [r[2] for r in base_after + mixed_after] == [r[2] for r in base_before + mixed_before]  # caches stayed
    # The engine holds exactly the trainer's tensors; the model's and the other adapter's checksums are unchanged.
    assert _lora_sums(llm, "qv") == lora_state_checksums("qv", new_tensors)
    report = llm.weight_checker()["checksums"]
    baseline = {k: v for k, v in report.items() if not k.startswith("lora:qv:")} | lora_state_checksums("qv", new_tensors)
    assert llm.weight_checker(baseline=baseline)["match"]
    stale = llm.weight_checker(baseline={**baseline, **old_sums})
    assert not stale["match"] and stale["mismatches"] == sorted(old_sums)
    base_only = {k: v for k, v in report.items() if not k.startswith("lora:")}
    assert llm.weight_checker(baseline=base_only)["match"]  # a base-model baseline needs no adapter entries
    # The adapter has its own version; the base model's stays.
    assert llm.get_weight_version(lora_name="qv") == "step-1"
    assert llm.get_weight_version(lora_name="mixed") == "default"
    assert llm.get_weight_version() == "default"
    assert _token_versions(generate, [qv, mixed, None]) == ["step-1", "default", "default"]


def _token_versions(generate, loras) -> list[str]:
    """The weight version each adapter's (None: the base model's) new tokens are labelled with: one span each."""
    versions = []
    for lora in loras:
        [out] = generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, lora_request=lora)
        [(version, start, end)] = out.outputs[0].weight_versions
        assert (start, end) == (0, len(out.outputs[0].token_ids))
        versions.append(version)
    return versions


def _bad_syncs(model) -> list[tuple[dict, str]]:
    good = _peft_tensors(model)
    nan = good[Q_A].clone()
    nan[0, 0] = float("nan")
    k_a = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"  # a module "qv" does not target
    return [
        ({"lora_name": "qv", **make_update_info({**good, Q_A: good[Q_A][:, :-1]}.items())},
         rf"'{Q_A}': shape \[4, 63\] does not match adapter 'qv''s \[4, 64\]"),
        ({"lora_name": "nope", **make_update_info(good.items())}, r"update_info.lora_name: no adapter named 'nope'"),
        ({"lora_name": "qv", **make_update_info([*good.items(), (k_a, torch.zeros(4, 64))])},
         rf"'{k_a}': adapter 'qv' has no LoRA weights for"),
        ({"lora_name": "qv", **make_update_info([*good.items(), ("model.norm.weight", torch.ones(64))])},
         r"'model.norm.weight' is not a LoRA A/B weight"),
        ({"lora_name": "qv", **make_update_info({**good, Q_A: nan}.items())}, rf"'{Q_A}': contains NaN or inf"),
    ]


def test_bad_syncs_are_refused_by_name_and_an_abort_restores_the_adapter(llm, adapters, old_refs, trained):
    qv = adapters["qv"]
    model, _ = trained
    generate = _gen(llm)
    _assert_matches(_run(generate, qv), old_refs)
    old_sums = _lora_sums(llm, "qv")
    core = llm.engine_core
    core.init_weight_transfer_engine({"backend": "local"})
    core.start_weight_update()
    for update_info, message in _bad_syncs(model):
        with pytest.raises(ValueError, match=message):
            core.update_weights(update_info)
    # Refused calls staged nothing: finishing now changes no adapter (an update without adapter tensors is the
    # model's, as before: its version moves).
    core.finish_weight_update(weight_version="after-refusals")
    assert _lora_sums(llm, "qv") == old_sums
    assert core.get_weight_version(lora_name="qv") == "default" and core.get_weight_version() == "after-refusals"
    _assert_matches(_run(generate, qv), old_refs)
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        core.get_weight_version(lora_name="nope")

    # A good call staged, then the update aborted: the adapter keeps its old tensors, version and cache.
    core.start_weight_update()
    new_tensors = _peft_tensors(model)
    assert core.update_weights({"lora_name": "qv", **make_update_info(new_tensors.items())}) == len(new_tensors)
    assert _lora_sums(llm, "qv") == old_sums  # staged, not serving
    assert core.abort_weight_update() is True
    assert _lora_sums(llm, "qv") == old_sums
    assert core.get_weight_version(lora_name="qv") == "default"
    after = _run(generate, qv)
    _assert_matches(after, old_refs)
    assert all(cached > 0 for *_, cached in after)


@pytest.mark.slow
def test_nccl_sync_over_gloo_into_an_engine_process(base_model, adapters, old_refs, trained):
    """The nccl backend (gloo on CPU) from this process into a RolloutWorker's engine process: a NaN sync is
    refused and leaves the group usable, then a sync lands the trainer's tensors and moves only their bytes."""
    from rollout import RolloutWorker
    from weight_transfer.clients import WeightSyncError
    from weight_transfer.nccl import NCCLTrainerInitInfo

    qv = adapters["qv"]
    model, new_refs = trained
    new_tensors = _peft_tensors(model)
    with RolloutWorker(model=base_model, multiprocess=True, **ENGINE_ARGS) as worker:
        generate = lambda prompts, params, lora_request: worker.generate(prompts, params, lora_request=lora_request)
        assert worker.add_lora(qv) is True
        _assert_matches(_run(generate, qv), old_refs)
        _run(generate, None)
        base_before = _outputs(_run(generate, None))  # with its prompts cached, as after the sync (which keeps them)
        trainer = trainer_init(NCCLTrainerInitInfo("127.0.0.1", 0, 2, packed_buffer_size_bytes=16 << 10, timeout_s=20.0),
                               client=LocalWeightSyncClient(worker), source=adapter_source(model, "qv"))
        try:
            nan = dict(new_tensors)
            nan[Q_A] = nan[Q_A].clone()
            nan[Q_A][1, 2] = float("inf")
            with pytest.raises((ValueError, WeightSyncError), match=rf"'{Q_A}': contains NaN or inf"):
                trainer.send_weights(adapter_source(nan, "qv"), weight_version="bad")
            assert worker.get_weight_version(lora_name="qv") == "default"
            stats = trainer.send_weights(weight_version="nccl-1")  # the same group: the refused call drained it
        finally:
            trainer.shutdown()
        assert stats.bytes_sent == sum(t.nbytes for t in new_tensors.values())
        assert _lora_sums(worker, "qv") == lora_state_checksums("qv", new_tensors)
        assert worker.get_weight_version(lora_name="qv") == "nccl-1" and worker.get_weight_version() == "default"
        assert _token_versions(generate, [qv, None]) == ["nccl-1", "default"]  # labels cross the process boundary
        _assert_matches(_run(generate, qv), new_refs)
        assert _outputs(_run(generate, None)) == base_before
