"""`loom serve`: every `EngineArgs` field as a flag (generated from the dataclass, so the two
never drift), the server's own flags, then uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from loom.engine.config import EngineArgs
from loom.loader.resolve import SMOLLM2_135M_INSTRUCT_ALIAS
from loom.server.reasoning import PARSER_CHOICES

if typing.TYPE_CHECKING:
    from loom.engine.client import EngineClient
    from loom.server.state import ServerConfig

# `loom serve` answers chat out of the box: its default model is the instruction-tuned one
# (its GGUF carries a chat template), not EngineArgs' default, the base Gemma 3 270M, which
# continues text but gives non-answers to chat.
SERVE_DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT_ALIAS

# Fields a flag cannot carry (Python objects); the server's flags cover what they do.
_NOT_FLAGS = {"hooks", "special_kwargs"}
_DICT_FIELDS = {"speculative_config", "kv_transfer_config", "kv_events_config"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of a field annotation."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return annotation, False


def _json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineArgs` field, with its default and its comment's type."""
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine (EngineArgs)")
    for field in dataclasses.fields(EngineArgs):
        if field.name in _NOT_FLAGS:
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        flag = _flag(field.name)
        if field.name in _DICT_FIELDS:
            group.add_argument(flag, type=_json_dict, default=None,
                               help=f"JSON object (EngineArgs.{field.name})")
            continue
        kind, optional = _base_type(hints[field.name])
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=f"EngineArgs.{field.name}")
        elif typing.get_origin(kind) is list:  # e.g. --cuda-graph-sizes 1 2 4 8
            (item,) = typing.get_args(kind)
            group.add_argument(flag, type=item, nargs="+", default=default,
                               help=f"EngineArgs.{field.name} (a list)")
        else:
            convert = kind if kind in (int, float, str) else str
            group.add_argument(flag, type=convert, default=default,
                               help=f"EngineArgs.{field.name}" + (" (optional)" if optional
                                                                  else ""))


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` the parsed flags describe."""
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs)
              if f.name not in _NOT_FLAGS}
    return EngineArgs(**values)


def add_serve_parser(sub: Any) -> None:
    """The `serve` subcommand."""
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (0.0.0.0 exposes the server to the network)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", default=None,
                        help="the model name clients use (None: --model)")
    server.add_argument("--api-key", action="append", default=None,
                        help="require 'Authorization: Bearer KEY' (repeat for several keys; "
                             "also LOOM_API_KEY)")
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file (None: the model's own)")
    server.add_argument("--max-sessions-per-key", type=int, default=64)
    server.add_argument("--max-request-body-bytes", type=int, default=4 * 2**20)
    server.add_argument("--max-tokens-cap", type=int, default=None,
                        help="most tokens one request may generate (None: the context left)")
    server.add_argument("--allowed-origins", nargs="*", default=[],
                        help="CORS origins allowed (none: no CORS)")
    server.add_argument("--promise-token", default=None,
                        help="token that forks a child sharing the KV (<promise>)")
    server.add_argument("--sync-token", default=None,
                        help="token that waits for the children and joins them (<sync>)")
    server.add_argument("--response-ttl-s", type=float, default=3600.0,
                        help="a stored response's session closes after this long idle (its "
                             "conversation stays continuable, recomputed); 0: never")
    server.add_argument("--max-stored-responses", type=int, default=10_000,
                        help="responses kept for previous_response_id (oldest go first)")
    server.add_argument("--reasoning-parser", default="auto", choices=PARSER_CHOICES,
                        help="split a think-tag model's reasoning (<think>...</think>) into "
                             "reasoning_content; auto: qwen3 when the chat template mentions "
                             "<think> or enable_thinking")
    server.add_argument("--log-level", default="info")
    replicas = serve.add_argument_group("replicas (Ray Serve)")
    replicas.add_argument("--replicas", type=int, default=1,
                          help="engine replicas behind this server; more than 1 (or "
                               "--ray-address) runs them on Ray Serve, sessions pinned to "
                               "their replica")
    replicas.add_argument("--ray-address", default=None,
                          help="join this Ray cluster ('auto': the one `ray start` runs "
                               "here) instead of starting a local instance")
    replicas.add_argument("--replica-threads", type=int, default=None,
                          help="compute threads per replica (None: the cluster's cores "
                               "split over the replicas)")
    replicas.add_argument("--route-imbalance", type=int, default=8,
                          help="a new request goes to the replica with the longest prefix "
                               "match unless it has this many more queued sequences than "
                               "the least loaded")
    add_engine_args(serve)
    # A server streams: a newcomer's prompt is chunked to keep running streams' steps near
    # 100 ms (the offline engine keeps whole chunks).
    serve.set_defaults(model=SERVE_DEFAULT_MODEL, max_step_ms=100.0)


def server_config_from(namespace: argparse.Namespace, env_api_keys: str = "") -> ServerConfig:
    """The `ServerConfig` the parsed flags describe; `env_api_keys` is LOOM_API_KEY's value
    (comma-separated), used when no --api-key is given."""
    from loom.server.state import ServerConfig

    keys = tuple(namespace.api_key or ()) or tuple(k for k in env_api_keys.split(",") if k)
    return ServerConfig(
        served_model_name=namespace.served_model_name or namespace.model,
        api_keys=keys,
        chat_template=namespace.chat_template,
        max_sessions_per_key=namespace.max_sessions_per_key,
        max_request_body_bytes=namespace.max_request_body_bytes,
        max_tokens_cap=namespace.max_tokens_cap,
        allowed_origins=tuple(namespace.allowed_origins),
        response_ttl_s=namespace.response_ttl_s or None,
        max_stored_responses=namespace.max_stored_responses,
        reasoning_parser=namespace.reasoning_parser,
    )


def serve(namespace: argparse.Namespace) -> int:
    """Load the model, build the app, run uvicorn until interrupted."""
    import os

    import uvicorn

    from loom.engine.promise_sync import SpecialKwargs
    from loom.server.app import build_app

    args = engine_args_from(namespace)
    if namespace.promise_token or namespace.sync_token:
        if not (namespace.promise_token and namespace.sync_token):
            raise SystemExit("--promise-token and --sync-token go together")
        args.special_kwargs = SpecialKwargs(promise_token_id=namespace.promise_token,
                                            sync_token_id=namespace.sync_token)
    config = server_config_from(namespace, os.environ.get("LOOM_API_KEY", ""))
    engine = engine_client(args, namespace)
    print(f"loaded {args.model} ({engine.config.mode_summary})", flush=True)
    app = build_app(engine, config)
    try:
        uvicorn.run(app, host=namespace.host, port=namespace.port, log_level=namespace.log_level)
    finally:  # Ctrl-C or SIGTERM: uvicorn returns; stop workers and replicas with us
        engine.shutdown()
    return 0


def engine_client(args: EngineArgs, namespace: argparse.Namespace) -> EngineClient:
    """One engine in this process, or `--replicas` engines on Ray Serve (also with one
    replica when `--ray-address` is given)."""
    if namespace.replicas < 1:
        raise SystemExit("--replicas must be at least 1")
    if namespace.replicas == 1 and namespace.ray_address is None:
        from loom.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine.from_engine_args(args)
    from loom.distributed.launch import start_replicas

    return start_replicas(args, namespace.replicas, namespace.ray_address,
                          threads=namespace.replica_threads,
                          imbalance_threshold=namespace.route_imbalance)
