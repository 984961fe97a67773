"""The `rlserve` command: serve, build-model, export-openapi."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, get_args

from app.config_groups import ReasoningParser

DEFAULT_SPEC = Path("openapi/openapi.json")


def bind(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything loads: a port in use stops the
    start at once, saying so (uvicorn's own bind comes after the models have loaded)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"rlserve: cannot listen on {host}:{port}: {exc.strerror}. Is another server "
            f"running there? Choose another port with --port or RLSERVE_HTTP__PORT."
        ) from None
    sock.set_inheritable(True)
    return sock


def _settings_problem(exc: Exception) -> str:
    """A settings error in one line an operator can act on: pydantic's as `group.field: why`."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    problems = []
    for error in exc.errors():
        cause = error.get("ctx", {}).get("error")  # a validator's own exception: its words
        message = str(cause) if isinstance(cause, Exception) else error["msg"]
        where = ".".join(str(part) for part in error["loc"])
        problems.append(f"{where}: {message}" if where else message)
    return "; ".join(problems)


def _serve(args: argparse.Namespace) -> int:
    # Loading shows one log line per model, not progress bars: transformers' own (read when
    # huggingface_hub is imported, below) and any other tqdm's (the GGUF conversion's).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import uvicorn

    from app.config import Settings, nest
    from app.main import create_app
    from app.ops.auth import OpenStart, check_exposure
    from app.ops.logs import configure_logging

    flags = {
        "models.model": args.model,
        "models.ref_model": args.ref_model,
        "models.reward_model": args.reward_model,
        "models.judge_model": args.judge_model,
        "models.served_model_name": args.served_model_name,
        "models.reasoning_parser": args.reasoning_parser,
        "models.return_routed_experts": args.enable_return_routed_experts or None,
        "models.return_tokens_as_token_ids": args.return_tokens_as_token_ids or None,
        "models.backend": args.backend,
        "models.dtype": args.dtype,
        "models.device": args.device,
        "http.host": args.host,
        "http.port": args.port,
    }
    overrides = nest({key: value for key, value in flags.items() if value is not None})
    try:
        settings = Settings(**overrides)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"rlserve: cannot start: {_settings_problem(exc)}", file=sys.stderr)
        return 2
    http = settings.http
    configure_logging(http.log_level, http.log_format)
    try:
        check_exposure(settings.auth, http.host)
    except OpenStart as exc:
        print(f"rlserve: cannot start: {exc}", file=sys.stderr)
        return 2
    if args.replicas is not None:
        return _serve_replicas(overrides, args.replicas, settings, args)
    sock = bind(http.host, http.port)
    if http.port == 0:  # the port the system chose, for the ready line
        http = http.model_copy(update={"port": sock.getsockname()[1]})
        settings = settings.model_copy(update={"http": http})
    logging.getLogger("app.cli").info(
        "listening on %s:%d; loading the models (GET /ready answers true once they serve)",
        http.host,
        http.port,
    )
    config = uvicorn.Config(
        create_app(settings),
        log_level=http.log_level,
        log_config=None,  # keep configure_logging's handlers
        access_log=False,  # the service's access log carries the request id
        timeout_graceful_shutdown=http.shutdown_timeout_s,
        timeout_keep_alive=http.keep_alive_timeout_s,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn shut down gracefully on SIGINT (Ctrl-C), then re-raises it. The app is
        # closed (stores committed, lanes stopped): end as SIGTERM's re-raised signal ends
        # the process, without the seconds the interpreter takes to tear the models down.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGINT)
    return 0


def _serve_replicas(
    overrides: dict[str, Any], replicas: int, settings: Any, args: argparse.Namespace
) -> int:
    """The same server as `replicas` replicas on Ray Serve (app.deploy.ray_serve), on the
    cluster RAY_ADDRESS names or a local one, its HTTP proxy on --host/--port."""
    import ray
    import torch
    from ray import serve

    from app.deploy.ray_serve import build

    # One host's CPUs and GPUs shared among its replicas (Ray sizes each replica's thread
    # pools by its CPUs, and gives it its own CUDA_VISIBLE_DEVICES).
    num_cpus = max(1, (os.cpu_count() or 1) // replicas)
    num_gpus = torch.cuda.device_count() // replicas if torch.cuda.is_available() else 0
    shape = {
        "proxy_host": settings.http.host,  # checked again there (app.ops.auth.check_exposure)
        "replicas": replicas,
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "sticky_sessions": args.sticky_sessions,
        **({"affinity_threshold": args.affinity_threshold} if args.affinity_threshold else {}),
    }
    application = build({**overrides, **shape})
    # SIGTERM ends the process through Python (not at once), so Ray's exit hook stops a
    # local cluster this process started along with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # A cluster only when RAY_ADDRESS names one: else a fresh local one, never a stale
    # address a crashed cluster left behind.
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local")
    serve.start(http_options={"host": settings.http.host, "port": settings.http.port})
    serve.run(application, name="rlserve", route_prefix="/", blocking=True)
    return 0


def _build_model(args: argparse.Namespace) -> int:
    from app.engine.builtin_model import build_model

    path = build_model(
        Path(args.directory),
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        seed=args.seed,
    )
    print(path)
    return 0


def openapi_document() -> dict[str, Any]:
    from app.config import Settings
    from app.main import create_app

    return create_app(Settings(), load_models=False).openapi()


def render_openapi() -> str:
    return json.dumps(openapi_document(), indent=2, sort_keys=True) + "\n"


def _export_openapi(args: argparse.Namespace) -> int:
    text = render_openapi()
    if args.path == "-":
        sys.stdout.write(text)
    else:
        path = Path(args.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="rlserve", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the HTTP server")
    serve.add_argument(
        "--model",
        help="model directory, hub id, or builtin:smollm2-135m-instruct (the default) or "
        "builtin:tiny (random weights, for tests)",
    )
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--backend", choices=["auto", "transformers", "vllm"])
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    serve.add_argument(
        "--ref-model", help="reference model for /v1/kl, as --model (default: policy copy)"
    )
    serve.add_argument(
        "--reward-model",
        help="a sequence-classification reward model served beside the policy (/v1/rewards)",
    )
    serve.add_argument(
        "--judge-model",
        help="a third model served as 'judge', for judges (RLSERVE_REWARDS__JUDGES)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="more names for the policy, as vLLM's flag (a trainer's configured model name)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=list(get_args(ReasoningParser)),
        help="split chat replies' <think>...</think> into reasoning, as vLLM's flag",
    )
    serve.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="a mixture-of-experts policy's routing in every choice of vLLM's generate and "
        "the OpenAI routes, as vLLM's flag",
    )
    serve.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="the OpenAI routes' log-probs name tokens 'token_id:<id>', as vLLM's flag (what "
        "ART's tokenizing reads)",
    )
    serve.add_argument(
        "--replicas",
        type=int,
        help="run N replicas on Ray Serve (needs "
        "RLSERVE_STORAGE__SESSION_STORE=redis://... when N > 1)",
    )
    serve.add_argument(
        "--sticky-sessions",
        action="store_true",
        help="with --replicas: send an environment's or trajectory's requests to one replica "
        "(by their x-session-id header) while it stands and is not loaded past "
        "--affinity-threshold",
    )
    serve.add_argument(
        "--affinity-threshold",
        type=int,
        metavar="N",
        help="with --sticky-sessions: a session's requests leave its replica for a less "
        "loaded one while it has N requests in flight or more (default: 32, one engine batch)",
    )
    serve.set_defaults(func=_serve)

    build = commands.add_parser("build-model", help="write the built-in random-weights model")
    build.add_argument("directory")
    build.add_argument("--hidden-size", type=int, default=64)
    build.add_argument("--num-layers", type=int, default=2)
    build.add_argument("--seed", type=int, default=0)
    build.set_defaults(func=_build_model)

    export = commands.add_parser("export-openapi", help="write the OpenAPI spec")
    export.add_argument("path", nargs="?", default=str(DEFAULT_SPEC), help="file, or - for stdout")
    export.set_defaults(func=_export_openapi)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
