"""Checkpoints by hub name, offline: a Hugging Face cache layout built here (models--org--tiny/{blobs,refs,snapshots})
serves `LLM("org/tiny")`, `org/tiny@v2` and a real `rollout launch --model org/tiny`; uncached names, typo'd paths and
conflicting revisions fail with errors naming them and saying what to do. No test reaches a network."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.model_source import hub_repo_id, resolve_checkpoint, split_hub_name

REPO_ROOT = Path(__file__).resolve().parent.parent
REPO_ID = "org/tiny"


def add_snapshot(cache_dir: Path, repo_id: str, checkpoint: str, ref: str) -> Path:
    """Writes `checkpoint`'s files into `cache_dir` as huggingface_hub lays a download out: content-addressed
    blobs, a snapshot folder of relative symlinks named by a commit hash, and refs/<ref> holding that hash."""
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in Path(checkpoint).iterdir() if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files) + ref.encode()).hexdigest()
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for p in files:
        blob = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, repo_dir / "blobs" / blob)
        (snapshot / p.name).symlink_to(os.path.join("..", "..", "blobs", blob))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """This process's huggingface_hub reads no network (conftest sets HF_HUB_OFFLINE=1; constants may predate it)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    """(main, v2): two tiny llama checkpoints with different weights."""
    return tiny_checkpoint("llama"), tiny_checkpoint("llama", seed=1)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, checkpoints):
    """An HF_HOME whose hub cache holds org/tiny at main and at v2."""
    home = tmp_path_factory.mktemp("hf-home")
    main, v2 = checkpoints
    add_snapshot(home / "hub", REPO_ID, main, "main")
    add_snapshot(home / "hub", REPO_ID, v2, "v2")
    return home


@pytest.fixture
def hub_cache(monkeypatch, hf_home):
    """The module's cache as this process's default (HF_HUB_CACHE is read once, when huggingface_hub is imported)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    return hf_home / "hub"


def _snapshot_of(cache: Path, ref: str) -> str:
    repo_dir = cache / "models--org--tiny"
    return str(repo_dir / "snapshots" / (repo_dir / "refs" / ref).read_text())


# ---- names and paths ----------------------------------------------------------------------------


@pytest.mark.parametrize("name, parts", [
    ("org/tiny", ("org/tiny", None)),
    ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", None)),
    ("org/tiny@v2", ("org/tiny", "v2")),
    ("meta-llama/Llama-3.2-1B@0123456789abcdef0123456789abcdef01234567",
     ("meta-llama/Llama-3.2-1B", "0123456789abcdef0123456789abcdef01234567")),
    ("tiny", None), ("./org/tiny", None), ("/abs/org/tiny", None), ("a/b/c", None), ("org/../x", None),
    ("org/tiny@", None), ("~/ckpt", None), ("org/ti ny", None),
])
def test_hub_name_shapes(name, parts):
    assert split_hub_name(name) == parts


def test_local_directory_is_unchanged(checkpoints):
    main, _ = checkpoints
    assert resolve_checkpoint(main) == main
    assert hub_repo_id(main) == main


def test_typo_local_path_keeps_the_not_a_directory_error(tmp_path):
    with pytest.raises(ValueError, match=r"model: '\./chekpoints/tiny' is not a directory with a config.json"):
        resolve_checkpoint("./chekpoints/tiny")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a directory with a config.json"):
        resolve_checkpoint(str(tmp_path / "empty"))


def test_hub_name_resolves_to_its_snapshot(hub_cache):
    assert resolve_checkpoint(REPO_ID) == _snapshot_of(hub_cache, "main")
    assert resolve_checkpoint("org/tiny@v2") == _snapshot_of(hub_cache, "v2")
    assert resolve_checkpoint(REPO_ID, revision="v2") == _snapshot_of(hub_cache, "v2")
    commit = Path(_snapshot_of(hub_cache, "v2")).name
    assert resolve_checkpoint(f"org/tiny@{commit}") == _snapshot_of(hub_cache, "v2")


def test_download_dir_is_the_cache(tmp_path, checkpoints):
    main, _ = checkpoints
    add_snapshot(tmp_path, "org/elsewhere", main, "main")
    assert resolve_checkpoint("org/elsewhere", download_dir=str(tmp_path)).startswith(str(tmp_path.resolve()))


def test_uncached_offline_name_says_what_to_do(hub_cache):
    with pytest.raises(ValueError) as info:
        resolve_checkpoint("org/missing")
    message = str(info.value)
    assert message.startswith("model: 'org/missing' is not a local directory")
    assert str(hub_cache) in message and "HF_HUB_OFFLINE" in message
    assert "`huggingface-cli download org/missing`" in message and "local checkpoint directory" in message
    with pytest.raises(ValueError, match=r"'org/tiny@v3'.*huggingface-cli download org/tiny --revision v3"):
        resolve_checkpoint("org/tiny@v3")


def test_conflicting_revisions_are_refused(hub_cache):
    with pytest.raises(ValueError, match="model: 'org/tiny@v2' names revision 'v2' but the revision given is 'main'"):
        resolve_checkpoint("org/tiny@v2", revision="main")


def test_hf_home_and_hf_hub_cache_from_the_environment(hf_home, tmp_path):
    """A fresh process reads HF_HOME / HF_HUB_CACHE as huggingface_hub does (the in-process tests patch them)."""
    code = "from engine.model_source import resolve_checkpoint; print(resolve_checkpoint('org/tiny'))"
    for env in ({"HF_HOME": str(hf_home)}, {"HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(hf_home / "hub")}):
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE")} | env
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env={**env, "HF_HUB_OFFLINE": "1"},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == _snapshot_of(hf_home / "hub", "main")


# ---- the engine's ModelConfig and the trainers' -----------------------------------------------


def test_model_config_holds_the_snapshot_and_serves_the_name(hub_cache):
    from engine.engine_args import create_engine_config

    config = create_engine_config(model="org/tiny@v2", hf_token="hf_secret", device="cpu")
    model = config.model
    assert model.model == model.tokenizer == _snapshot_of(hub_cache, "v2")
    assert model.model_name == REPO_ID and model.revision == "v2" and model.tokenizer_revision == "v2"
    assert model.hf_token is None  # used to resolve, then dropped: /server_info never shows it
    assert model.max_model_len == model.hf_config_dict()["max_position_embeddings"]

    other_revision = create_engine_config(model="org/tiny", tokenizer_revision="v2", device="cpu")
    assert (other_revision.model.model, other_revision.model.tokenizer) == (
        _snapshot_of(hub_cache, "main"), _snapshot_of(hub_cache, "v2"))
    split = create_engine_config(model="org/tiny@v2", tokenizer="org/tiny", tokenizer_revision="main", device="cpu")
    assert (split.model.model, split.model.tokenizer) == (_snapshot_of(hub_cache, "v2"), _snapshot_of(hub_cache, "main"))


def test_trainer_paths_by_name(hub_cache):
    from trainers.config import ModelConfig
    from trainers.critic import CriticConfig

    assert ModelConfig(path=REPO_ID).path == _snapshot_of(hub_cache, "main")
    assert CriticConfig(path="org/tiny@v2").path == _snapshot_of(hub_cache, "v2")
    with pytest.raises(ValueError, match="model.path: 'org/missing' is not a local directory.*HF_HUB_OFFLINE"):
        ModelConfig(path="org/missing")
    with pytest.raises(ValueError, match="critic.path: 'nowhere' is not a directory with a config.json"):
        CriticConfig(path="nowhere")


# ---- LLM and `rollout launch` ---------------------------------------------------------------------

PROMPTS = ["The quick brown fox", "Hello, my name is"]


def _greedy(llm) -> list[list[int]]:
    from engine import SamplingParams

    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def local_greedy(checkpoints):
    from engine import LLM

    tokens = []
    for path in checkpoints:
        with LLM(path, dtype="float32", device="cpu") as llm:
            tokens.append(_greedy(llm))
    return tokens  # [main, v2]


def test_llm_by_name_equals_llm_by_directory(hub_cache, local_greedy):
    from engine import LLM

    with LLM(REPO_ID, dtype="float32", device="cpu") as llm:
        assert llm.config.model.model == _snapshot_of(hub_cache, "main")
        assert _greedy(llm) == local_greedy[0]
        llm.sleep(level=2)  # reload_weights reads the resolved snapshot again
        llm.wake_up(reload_weights=True)
        assert _greedy(llm) == local_greedy[0]
    assert local_greedy[0] != local_greedy[1]  # so the revision below is told apart by its tokens
    with LLM("org/tiny@v2", dtype="float32", device="cpu") as llm:
        assert _greedy(llm) == local_greedy[1]


def test_rollout_worker_by_name(hub_cache, local_greedy):
    from rollout.worker import RolloutWorker

    with RolloutWorker(model="org/tiny@v2", device="cpu", dtype="float32", disable_log_stats=True) as worker:
        assert worker.engine.model_name == REPO_ID and worker.config.model.model == _snapshot_of(hub_cache, "v2")
        assert _greedy(worker) == local_greedy[1]


@pytest.mark.slow
def test_rollout_launch_serves_a_hub_name_offline(monkeypatch, launch_server, hf_home, local_greedy, checkpoints):
    import openai
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HOME", str(hf_home))  # the server process's environment (server_launch copies ours)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = launch_server(REPO_ID)
    assert server.served_model == REPO_ID
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [REPO_ID]
    answer = client.completions.create(model=REPO_ID, prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert answer.model == REPO_ID
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[0])
    assert answer.choices[0].text == tokenizer.decode(local_greedy[0][0])


def test_rollout_launch_uncached_name_offline_fails_naming_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"} | {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rollout.cli", "launch", "--model", "org/tiny", "--port", "0"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert out.returncode == 2, out.stderr
    assert "rollout launch: error: model: 'org/tiny' is not a local directory" in out.stderr
    assert "HF_HUB_OFFLINE" in out.stderr and "huggingface-cli download org/tiny" in out.stderr
    assert out.stdout == ""
    print(f"uncached offline launch refused after {elapsed:.2f}s (process start included)")


def test_the_model_is_checked_before_torch_is_imported(tmp_path):
    # The refusal comes before torch and the engine are imported (seconds on a 2-core machine), so a
    # typo'd name fails at once; -X importtime lists every module the process imported.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"} | {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "rollout.cli", "launch", "--model", "org/tiny"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "'org/tiny' is not a local directory" in out.stderr
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "rollout.server.config" in imported and "engine.config" in imported  # the listing is the real one
    assert "torch" not in imported and "engine.async_llm" not in imported


def test_launch_flags_are_vllms():
    from rollout.cli import build_parser

    args = build_parser().parse_args(["launch", "--model", "org/tiny", "--revision", "v2", "--tokenizer-revision",
                                      "main", "--hf-token", "hf_x", "--download-dir", "/cache"])
    assert (args.revision, args.tokenizer_revision, args.hf_token, args.download_dir) == ("v2", "main", "hf_x", "/cache")
