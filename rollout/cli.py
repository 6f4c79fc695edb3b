"""The `rollout` command: `rollout launch --model DIR|ORG/NAME|tiny-name` serves a model over HTTP until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import logging
import os
import signal
import sys
from typing import Any, Sequence

from engine.config import ENGINE_CONFIG_SECTIONS
from engine.model_source import hub_repo_id
from rollout.cli_args import add_dataclass_arguments, dataclass_kwargs
from rollout.server.config import ServerConfig

logger = logging.getLogger("rollout.cli")

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _check_unique_flags() -> None:
    import dataclasses

    from engine.engine_args import engine_arg_names

    rollout_names = [f.name for f in dataclasses.fields(ServerConfig)]
    clash = set(engine_arg_names()) & set(rollout_names)
    assert not clash and len(set(rollout_names)) == len(rollout_names), f"config field names clash: {sorted(clash)}"


def build_parser() -> argparse.ArgumentParser:
    """`rollout` and its subcommands; launch's flags come from the config dataclasses."""
    from engine.tiny_models import BUILTIN_TINY_MODELS

    _check_unique_flags()
    parser = argparse.ArgumentParser(prog="rollout", description="RL rollout toolkit: serve and drive an inference engine.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    launch = commands.add_parser(
        "launch",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Starts the engine in its own process (or --data-parallel-size engines, each in its own) and an "
        "OpenAI-compatible HTTP server in front of it. "
        "Prints `rollout: serving MODEL at URL` once it accepts connections; SIGINT/SIGTERM stop both.",
    )
    tiny = ", ".join(sorted(BUILTIN_TINY_MODELS))
    for section, cls in ENGINE_CONFIG_SECTIONS.items():
        add_dataclass_arguments(
            launch,
            cls,
            f"engine: {section}",
            required=("model",) if section == "model" else (),
            extra_help={"model": f"Or the name of a built-in tiny model ({tiny}), built offline on first use."},
        )
    add_dataclass_arguments(launch, ServerConfig, "server")
    launch.set_defaults(func=launch_command)
    return parser


def resolve_model(model: str) -> str:
    """A checkpoint directory for --model: built-in tiny names are built (once) into the user cache."""
    if "/" in model or os.path.isdir(model):  # a path or ORG/NAME (no built-in name has a slash): no torch import
        return model
    from engine.tiny_models import BUILTIN_TINY_MODELS, builtin_model_dir

    if model in BUILTIN_TINY_MODELS and not os.path.isdir(model):
        return builtin_model_dir(model)
    return model


def launch_command(args: argparse.Namespace) -> int:
    engine_kwargs: dict[str, Any] = {}
    for cls in ENGINE_CONFIG_SECTIONS.values():
        engine_kwargs.update(dataclass_kwargs(args, cls))
    try:
        server_config = ServerConfig(**dataclass_kwargs(args, ServerConfig))
        if runtime_lora_updating_from_env():
            server_config.allow_runtime_lora_updating = True
        if server_config.lora_modules and not engine_kwargs.get("enable_lora"):
            raise ValueError("--lora-modules needs --enable-lora")
        served_name = server_config.served_model_name or hub_repo_id(engine_kwargs["model"])
        engine_kwargs["model"] = resolve_model(engine_kwargs["model"])
        spec = engine_kwargs.get("speculative_config")
        if isinstance(spec, dict) and isinstance(spec.get("model"), str):  # a built-in tiny draft, like --model
            engine_kwargs["speculative_config"] = {**spec, "model": resolve_model(spec["model"])}
        # Validate the whole config here, so bad flags fail before any process starts.
        from engine.engine_args import create_engine_config

        model_config = create_engine_config(**engine_kwargs).model
        # Every engine reads the snapshot resolved here: a hub name is looked up (or downloaded) once.
        engine_kwargs.update(model=model_config.model, tokenizer=model_config.tokenizer)
    except (TypeError, ValueError) as e:
        print(f"rollout launch: error: {e}", file=sys.stderr)
        return 2
    if server_config.enable_rl_routes and server_config.api_key is None and server_config.host not in _LOOPBACK:
        logger.warning(
            "--enable-rl-routes on %s without --api-key: anyone who reaches the port can pause the engine "
            "and replace its weights", server_config.host,
        )
    data_parallel_size = engine_kwargs.pop("data_parallel_size", 1)  # the group sets it on each engine
    # uvloop's event loop (as uvicorn's "auto" picks): request handling is most of a refusal's cost.
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_serve(engine_kwargs, server_config, served_name, data_parallel_size))


def runtime_lora_updating_from_env() -> bool:
    """vLLM's switch for its LoRA load/unload routes, honoured beside --allow-runtime-lora-updating (vLLM's parse)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def _loop_factory():
    try:
        import uvloop
    except ImportError:  # an optional speed-up: the standard loop serves the same
        return None
    return uvloop.new_event_loop


class _Server:
    """uvicorn's Server with our own signal handling: uvicorn re-raises the signal after its
    shutdown, which would kill this process before the engine process is stopped."""

    def __init__(self, app, server_config: ServerConfig) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield  # signals are installed by _serve on the event loop

        log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
        log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # stdout carries the ready line only
        config = uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=server_config.uvicorn_log_level,
            log_config=log_config,
            access_log=not server_config.disable_access_log,
            timeout_keep_alive=server_config.timeout_keep_alive,
            # A backstop only: _serve stops the engine after shutdown_grace_s, which ends every request.
            timeout_graceful_shutdown=server_config.shutdown_grace_s + 3,
            lifespan="off",
        )
        if not server_config.disable_access_log:  # one line per request, whatever uvicorn's own level
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        self.server = Server(config)

    def request_exit(self) -> None:
        # A second signal means "now": stop waiting for open connections.
        if self.server.should_exit:
            self.server.force_exit = True
        self.server.should_exit = True

    def bound_address(self) -> tuple[str, int]:
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return host, port


def _start_engine(engine_kwargs: dict[str, Any], served_name: str, data_parallel_size: int):
    """One AsyncLLM, or a RolloutGroup of data_parallel_size of them: the server cannot tell them apart."""
    engine_kwargs = {"usage_context": "api_server", **engine_kwargs}  # the server's default step budget
    if data_parallel_size > 1:
        from rollout.group import RolloutGroup

        return RolloutGroup.from_engine_args(  # sets each engine's data_parallel_size and data_parallel_rank
            data_parallel_size=data_parallel_size, multiprocess=True, model_name=served_name, **engine_kwargs
        )
    from engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(multiprocess=True, model_name=served_name, **engine_kwargs)


async def _serve(
    engine_kwargs: dict[str, Any], server_config: ServerConfig, served_name: str, data_parallel_size: int = 1
) -> int:
    from rollout.server.app import build_app
    from rollout.server.lora import load_lora_modules, parse_lora_modules

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    engine = _start_engine(engine_kwargs, served_name, data_parallel_size)
    try:
        if stop.is_set():
            return 0
        try:
            await load_lora_modules(engine, parse_lora_modules(server_config.lora_modules), served_name)
        except ValueError as e:
            print(f"rollout launch: error: {e}", file=sys.stderr)
            return 2
        server = _Server(build_app(engine, server_config, model_name=served_name), server_config)
        # What start-up made (torch, transformers, the tokenizer, the app) lives as long as the server:
        # out of the collector's view, a full collection under load walks only what requests made
        # (one over ~1M start-up objects held up a burst of requests for ~150 ms). As in EngineCore.
        gc.collect()
        gc.freeze()
        serve_task = asyncio.create_task(server.server.serve())
        announce_task = asyncio.create_task(_announce_when_started(server, served_name))
        stop_task = asyncio.create_task(stop.wait())
        watched = [serve_task, stop_task]
        death_task = None
        if not engine.config.fault_tolerance.enable_fault_tolerance:
            # A dead engine never comes back without fault tolerance: exit non-zero, as vLLM's server
            # does, so that a supervisor restarts us (with it, /health says 503 until an operator acts).
            death_task = asyncio.create_task(_engine_death(engine))
            watched.append(death_task)
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        engine_died = death_task is not None and death_task.done()
        if death_task is not None:
            death_task.cancel()  # from here on the engine is stopped on purpose
        server.request_exit()
        # A second signal while draining forces the exit.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_exit)
        done, _ = await asyncio.wait([serve_task], timeout=server_config.shutdown_grace_s)
        if not done:
            # Grace is over: stopping the engine ends each in-flight request with an error
            # response (503, or in-band for streams), so uvicorn's connections close by themselves.
            engine.shutdown()
        await serve_task
        announce_task.cancel()
        stop_task.cancel()
        return 0 if server.server.started and not engine_died else 1
    finally:
        engine.shutdown()
        print("rollout: stopped", file=sys.stderr, flush=True)


_DEATH_POLL_S = 0.2


async def _engine_death(engine) -> None:
    """Returns once the engine (or any engine of a group) is dead."""
    while not engine.is_dead:
        await asyncio.sleep(_DEATH_POLL_S)
    logger.error("the engine is dead and fault tolerance is off: the server exits (status 1)")


async def _announce_when_started(server: _Server, served_name: str) -> None:
    while not server.server.started:
        await asyncio.sleep(0.05)
    host, port = server.bound_address()
    shown = f"[{host}]" if ":" in host else host
    print(f"rollout: serving {served_name} at http://{shown}:{port}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
