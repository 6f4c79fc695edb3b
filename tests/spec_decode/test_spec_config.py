"""Bad speculative_config values fail before anything starts, with a ValueError (or CLI exit 2) naming the key."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.config import parse_speculative_config
from rollout.cli import build_parser, main

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


def make_llm(path, speculative_config, **kw):
    kw = {"max_model_len": 256, **kw}
    return LLM(path, dtype="float32", device="cpu", speculative_config=speculative_config, **kw)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "eagle", "num_speculative_tokens": 2},
         r"method must be one of \['draft_model', 'ngram'\], got 'eagle'"),
        ({"num_speculative_tokens": 2}, "method must be one of"),
        ({**NGRAM, "lookahead": 3}, r"unknown keys for method 'ngram': \['lookahead'\]"),
        ({**NGRAM, "model": "x"}, r"unknown keys for method 'ngram': \['model'\]"),  # a draft_model key
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens must be an int in .*got 0"),
        ({**NGRAM, "num_speculative_tokens": "3"}, "num_speculative_tokens must be an int in .*got '3'"),
        ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens must be an int"),
        ({**NGRAM, "num_speculative_tokens": 17}, "num_speculative_tokens must be an int in"),
        ({"method": "ngram"}, "num_speculative_tokens must be an int in .*got None"),
        ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "prompt_lookup_min <= prompt_lookup_max.*got 4 and 2"),
        ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({**NGRAM, "prompt_lookup_max": 2.5}, "prompt_lookup_max"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model must be a checkpoint directory"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": 3}, "model must be a checkpoint directory"),
    ],
)
def test_bad_values_name_the_key(tiny_checkpoint, config, match):
    with pytest.raises(ValueError, match=match):
        parse_speculative_config(config)
    with pytest.raises(ValueError, match="speculative_config: .*" + match):  # the engine argument says the same
        make_llm(tiny_checkpoint("llama"), config)


def test_not_a_dict():
    with pytest.raises(ValueError, match="speculative_config must be a dict .*got str"):
        parse_speculative_config(json.dumps(NGRAM))
    assert parse_speculative_config(None) is None


def test_draft_model_directory_without_config_json(tiny_checkpoint, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    for model in (tmp_path, tmp_path / "missing"):
        config = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(model)}
        with pytest.raises(ValueError, match="speculative_config: model must be a checkpoint directory with a config"):
            make_llm(tiny_checkpoint("llama"), config)


def test_draft_model_with_another_vocabulary(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    other = tiny_checkpoint("llama", vocab_size=576)  # the builder's default is 512 (the tokenizer's size)
    config = {"method": "draft_model", "num_speculative_tokens": 2, "model": other}
    with pytest.raises(ValueError, match=r"speculative_config: the draft model's vocab_size \(576\) differs .*\(512\)"):
        make_llm(path, config)


def test_draft_model_attention_backend_is_checked(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    config = {"method": "draft_model", "num_speculative_tokens": 2, "model": path, "attention_backend": "nope"}
    with pytest.raises(ValueError, match="speculative_config: attention_backend must be one of .*got 'nope'"):
        make_llm(path, config)


def test_tensor_parallel_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="speculative_config: .*tensor_parallel_size 1 only, got 2"):
        make_llm(tiny_checkpoint("llama"), NGRAM, tensor_parallel_size=2)


def test_draft_model_shorter_than_max_model_len_is_refused(tiny_checkpoint):
    """A draft reads every position the model does: one whose max_position_embeddings is below max_model_len
    is refused up front, naming both (it used to crash at the first draft step past its limit)."""
    path = tiny_checkpoint("llama")
    short = tiny_checkpoint("llama", max_position_embeddings=32)
    config = {"method": "draft_model", "num_speculative_tokens": 3, "model": short}
    with pytest.raises(ValueError, match=r"max_position_embeddings \(32\) is below max_model_len \(128\)"):
        make_llm(path, config, max_model_len=128)
    make_llm(path, config, max_model_len=32).engine_core.shutdown()  # within the draft's limit: fine


# ---------------------------------------------------------------------------- CLI


def test_cli_parses_the_json_object():
    args = build_parser().parse_args(
        ["launch", "--model", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert "speculative_config" not in vars(build_parser().parse_args(["launch", "--model", "m"]))


@pytest.mark.parametrize("text, message", [
    ("{method: ngram}", "not valid JSON"),
    ('{"method": "ngram",', "not valid JSON"),
    ('["ngram", 2]', "expected a JSON object"),
    ('"ngram"', "expected a JSON object"),
    ("null", "expected a JSON object"),
])
def test_cli_refuses_invalid_json_and_non_objects(text, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["launch", "--model", "m", "--speculative-config", text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err


@pytest.mark.parametrize("config, flags, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, [], "method must be one of"),
    ({**NGRAM, "num_speculative_tokens": 0}, [], "num_speculative_tokens"),
    ({**NGRAM, "prompt_lookahead": 1}, [], "unknown keys for method 'ngram': ['prompt_lookahead']"),
    (NGRAM, ["--tensor-parallel-size", "2"], "tensor_parallel_size 1 only"),
])
def test_launch_with_a_bad_speculative_config_exits_2(tiny_checkpoint, config, flags, message, capsys):
    argv = ["launch", "--model", tiny_checkpoint("llama"), "--device", "cpu", "--port", "0",
            "--speculative-config", json.dumps(config), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "rollout launch: error: speculative_config" in err and message in err


def test_launch_with_a_draft_directory_without_config_json_exits_2(tiny_checkpoint, tmp_path, capsys):
    config = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(tmp_path)}
    argv = ["launch", "--model", tiny_checkpoint("llama"), "--device", "cpu",
            "--speculative-config", json.dumps(config)]
    assert main(argv) == 2
    assert "speculative_config: model must be a checkpoint directory" in capsys.readouterr().err


def test_launch_resolves_a_built_in_tiny_draft_name(capsys):
    """`"model": "tiny-qwen3"` in --speculative-config names a built-in tiny model, as --model does: validation
    gets past the draft's directory (and stops at tensor_parallel_size, before any process starts)."""
    spec = json.dumps({"method": "draft_model", "model": "tiny-qwen3", "num_speculative_tokens": 2})
    assert main(["launch", "--model", "tiny-llama", "--speculative-config", spec, "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel_size 1 only" in err and "checkpoint directory" not in err


def test_batch_invariant_mode_is_a_no_op_on_cpu(tiny_checkpoint):
    """The flag is accepted everywhere; on CPU tensors (the torch reference path) the invariant GEMM never applies."""
    import torch

    from engine.kernels import batch_invariant

    llm = make_llm(tiny_checkpoint("llama"), NGRAM, batch_invariant=True)
    try:
        assert batch_invariant.batch_invariant()
        assert not batch_invariant.applies(torch.ones(2, 3), torch.ones(4, 3))
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.engine_core.shutdown()
        batch_invariant.set_batch_invariant(False)
