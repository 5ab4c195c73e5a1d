"""OpenAI-compatible HTTP frontend: routes, error handlers and `moeserve serve`.

The engine core runs in its own process (engine/core_process.py); this process serves HTTP,
tokenizes, detokenizes and formats SSE, and talks to the core only through EngineClient's
messages. Every request is validated (pydantic, then SamplingParams, then the core's limits)
before a byte of the response is sent, so each mistake is a 4xx in the OpenAI error shape and a
streaming response only starts for a request the engine accepted. A client that goes away aborts
its requests, which frees their KV blocks at the next step. A body over --max-request-body-bytes is a 413 before it
is read. With runtime adapter loading on and a --lora-dir, a request naming an adapter that is not loaded but is a
folder there loads it first (once, however many such requests arrive together).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import hmac
import json
import logging
import os
import socket
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.engine_args import add_engine_args, engine_config_from_args
from moeserve.errors import AdapterPathError, EngineDeadError, InvalidAdapterNameError, UnknownAdapterError
from moeserve.frontend.core_client import EngineClient, resolve_adapter_path
from moeserve.frontend.dp_client import DataParallelClient
from moeserve.log_filter import filter_repeats
from moeserve.lora.names import validate_adapter_name
from moeserve.server.completions import ServerState, create_chat_completion, create_completion
from moeserve.server.connections import (HTTPLimits, guarded_protocol_class, limit_request_body,
                                         raise_open_files_limit, raw_response)
from moeserve.server.errors import ClientGone, engine_error, lora_error, queue_full, validation_error
from moeserve.server.lifecycle import Drain, ServerWithoutSignals, StopSignals, listening_socket, stop_resource_tracker
from moeserve.server.protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRARequest, OpenAIError,
                                      UnloadLoRARequest)

logger = logging.getLogger("moeserve")

DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0  # a stop's drain: under Kubernetes' 30 s grace period (docker stop gives 10 s: -t)
GENERATION_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}


def error_body(err: OpenAIError) -> bytes:
    # ASCII-escaped: a message quoting the client's input stays encodable even with a lone surrogate in it
    return json.dumps(err.body(), ensure_ascii=True).encode("ascii")


class Admission:
    """Refuses a generation request while the engine's queue is full, before its body is read or parsed (parsing
    and validating are most of what a request costs): at the connection's first packet (`shed`, consulted by the
    protocol class) or, when the head came in pieces, first thing in the app (`middleware`). Requests with a wrong
    API key are let through, to be answered 401."""

    def __init__(self, state: ServerState):
        self.state = state
        self.auth = f"Bearer {state.api_key}".encode() if state.api_key is not None else None
        self._raw_refusals: dict[str, bytes] = {}  # message -> whole response: the same few bytes each time

    def refusal(self, path: str, authorization: bytes | None) -> OpenAIError | None:
        endpoint = GENERATION_ENDPOINTS.get(path)
        engine = self.state.engine
        if endpoint is None or not engine.is_running or engine.queue_room() > 0:
            return None
        if self.auth is not None and not hmac.compare_digest(authorization or b"", self.auth):
            return None
        self.state.metrics.count_request(endpoint, 503)
        return queue_full(str(engine.queue_full_error()))

    def shed(self, method: bytes, path: bytes, head: bytes) -> bytes | None:
        if method != b"POST" or path not in _GENERATION_PATHS:
            return None
        err = self.refusal(path.decode("ascii"), _raw_header(head, b"authorization") if self.auth else None)
        if err is None:
            return None
        response = self._raw_refusals.get(err.message)
        if response is None:
            extra = "".join(f"{k}: {v}\r\n" for k, v in err.headers.items())
            response = self._raw_refusals[err.message] = raw_response(f"{err.status} Service Unavailable",
                                                                      err.body(), extra)
        return response

    def middleware(self, app):
        async def admit(scope, receive, send):
            if scope["type"] == "http" and scope["method"] == "POST":
                auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
                err = self.refusal(scope["path"], auth)
                if err is not None:
                    body = error_body(err)
                    await send({"type": "http.response.start", "status": err.status, "headers": [
                        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        *((k.lower().encode(), v.encode()) for k, v in err.headers.items())]})
                    await send({"type": "http.response.body", "body": body})
                    return
            await app(scope, receive, send)

        return admit


_GENERATION_PATHS = {p.encode() for p in GENERATION_ENDPOINTS}


def _raw_header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return None


def create_app(engine: EngineClient, served_model_name: str, api_key: str | None = None,
               max_request_body_bytes: int = HTTPLimits.max_request_body_bytes) -> FastAPI:
    """The FastAPI app serving `engine` as model `served_model_name` (its adapters by their names)."""
    state = ServerState(engine, served_model_name, api_key)
    app = FastAPI(title="moeserve", version="0.1.0", summary="OpenAI-compatible MoE + multi-LoRA server")
    app.state.moeserve = state
    admission = Admission(state)
    app.state.admission = admission
    app.add_middleware(limit_request_body, max_bytes=max_request_body_bytes)
    app.add_middleware(admission.middleware)  # added last: runs first
    runtime_loading = engine.config.enable_lora_runtime_loading
    lora_dir = engine.config.lora_dir

    def error_response(request: Request, err: OpenAIError) -> Response:
        endpoint = GENERATION_ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            state.metrics.count_request(endpoint, err.status)
        return Response(error_body(err), status_code=err.status, media_type="application/json", headers=err.headers)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request, OpenAIError(exc.status_code, str(exc.detail), code=kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(request, OpenAIError(500, f"internal error: {type(exc).__name__}",
                                                   type="server_error", code="internal_error"))

    async def check_api_key(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise OpenAIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                              type="authentication_error", code="invalid_api_key")

    auth = [Depends(check_api_key)]

    @app.get("/health")
    async def health():
        if not engine.is_running:
            raise OpenAIError(503, f"engine unavailable: {engine.dead}", type="server_error", code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=auth)
    async def list_models():
        # OpenAI's card, with vLLM's max_model_len, and vocab_size: the token ids a prompt may hold ([0, vocab_size)),
        # which a client sending token ids (bench serve's random prompts) needs
        shape = {"max_model_len": state.max_model_len, "vocab_size": engine.info.vocab_size}
        base = {"id": served_model_name, "object": "model", "created": state.created, "owned_by": "moeserve",
                "root": served_model_name, "parent": None, **shape}
        # "version": 1 at an adapter's first load, +1 per reload under its name (load_inplace)
        adapters = [{"id": name, "object": "model", "created": state.created, "owned_by": "moeserve",
                     "root": name, "parent": served_model_name, **shape, "version": version}
                    for name, version in engine.lora_versions.items()]
        return {"object": "list", "data": [base, *adapters]}

    async def load_on_demand(model: str) -> None:
        """An adapter not loaded but found in --lora-dir is loaded at its first request (runtime loading on)."""
        if not engine.loads_on_demand or model == served_model_name:
            return
        base, sep, adapter = model.partition(":")
        name = adapter if sep and base == served_model_name else model
        try:
            await engine.ensure_adapter(name)
        except UnknownAdapterError:
            pass  # the request is answered 404 as for any unknown model
        except Exception as e:  # noqa: BLE001 - engine gone, queue full
            raise engine_error(e, "model") from e

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        await load_on_demand(body.model)
        try:
            return await create_completion(state, body, request)
        except ClientGone:
            state.metrics.count_request("completions", 499)
            return Response(status_code=499)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        await load_on_demand(body.model)
        try:
            return await create_chat_completion(state, body, request)
        except ClientGone:
            state.metrics.count_request("chat_completions", 499)
            return Response(status_code=499)

    def check_runtime_loading(name: str) -> None:
        if not runtime_loading:
            raise OpenAIError(403, "runtime LoRA adapter loading is disabled on this server (start it with "
                              "--enable-lora-runtime-loading)", code="runtime_lora_loading_disabled")
        try:
            validate_adapter_name(name)
        except InvalidAdapterNameError as e:
            raise OpenAIError(400, str(e), param="lora_name", code="invalid_value") from None

    @app.post("/v1/load_lora_adapter", dependencies=auth)
    async def load_lora_adapter(body: LoadLoRARequest):
        name = body.lora_name
        check_runtime_loading(name)
        if name == served_model_name:
            raise OpenAIError(400, f"{name!r} is the base model's name; an adapter needs another",
                              param="lora_name", code="invalid_value")
        # load_inplace (vLLM's field): reload a loaded name as a new version; started requests finish on the old
        if name in engine.lora_versions and not body.load_inplace:
            raise OpenAIError(400, f"adapter {name!r} is already loaded (set load_inplace to reload it)",
                              param="lora_name", code="adapter_exists")
        path = None
        try:  # stat calls off the event loop: a slow filesystem must not stall every request
            path = await asyncio.to_thread(resolve_adapter_path, name, body.lora_path, lora_dir)
            await engine.load_lora(name, path, pinned=body.pinned, replace=body.load_inplace)
        except AdapterPathError as e:
            raise OpenAIError(400, str(e), param="lora_path", code="invalid_value") from None
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx, paths redacted
            raise lora_error(e, tuple(p for p in (body.lora_path, path, lora_dir) if p)) from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=auth)
    async def unload_lora_adapter(body: UnloadLoRARequest):
        name = body.lora_name
        check_runtime_loading(name)
        if name not in engine.lora_names:
            raise OpenAIError(404, f"adapter {name!r} is not loaded", param="lora_name",
                              code="adapter_not_found")
        try:
            await engine.unload_lora(name)
        except Exception as e:  # noqa: BLE001
            raise lora_error(e, tuple(p for p in (lora_dir,) if p)) from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/metrics")
    async def metrics():
        try:
            stats = await engine.stats_per_core()
        except EngineDeadError:
            stats = None
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model folder's name)")
    g.add_argument("--api-key", default=os.environ.get("MOESERVE_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1 endpoints (default: $MOESERVE_API_KEY)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level (default: %(default)s)")
    d = HTTPLimits()
    g.add_argument("--timeout-header", type=float, default=d.timeout_header, metavar="SECONDS",
                   help="close a connection whose request headers are not complete this long after it opened or "
                        "began a request (default: %(default)s)")
    g.add_argument("--timeout-body", type=float, default=d.timeout_body, metavar="SECONDS",
                   help="close a connection whose request body is not complete this long after its headers "
                        "(default: %(default)s)")
    g.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive, metavar="SECONDS",
                   help="close an idle kept-alive connection after this long (default: %(default)s)")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes, metavar="BYTES",
                   help="largest request body accepted; a larger one is answered 413 before it is read "
                        "(default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                   help="on SIGTERM or SIGINT, how long requests in flight may take to finish before they are aborted "
                        "(a second signal aborts them at once) (default: %(default)s)")
    g.add_argument("--limit-concurrency", type=int, default=None, metavar="N",
                   help="most open connections; more are answered 503 and closed at once (default: the open-files "
                        "limit, raised towards its hard limit at start, less a reserve)")
    add_engine_args(parser)
    return parser


def http_limits_from_args(args: argparse.Namespace) -> HTTPLimits:
    return HTTPLimits(timeout_header=args.timeout_header, timeout_body=args.timeout_body,
                      timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
                      max_request_body_bytes=args.max_request_body_bytes)


def check_serve_args(args: argparse.Namespace) -> None:
    """The server flags' values (ValueError naming the flag), before anything is bound or loaded."""
    http_limits_from_args(args)
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")


def serve_main(args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """`moeserve serve`: serve until SIGTERM or SIGINT, then exit 0. `sock`: the listening socket, bound already
    (else bound here, before the engine starts)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    check_serve_args(args)
    server = run_server(engine_config_from_args(args), args.host, args.port, args.served_model_name, args.api_key,
                        args.log_level, limits=http_limits_from_args(args), sock=sock,
                        shutdown_timeout=args.shutdown_timeout)
    try:
        return run_on_server_loop(server)
    finally:
        stop_resource_tracker()  # the engine core is reaped by now; the tracker would outlive this process


def run_on_server_loop(coro):
    """asyncio.run(coro) on the event loop the server runs on: uvloop where installed (a flood of connections
    is answered ~2x faster than on asyncio's own loop), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)  # not asyncio.Runner: Python 3.10 has none


async def run_server(config, host: str, port: int, served_model_name: str | None = None, api_key: str | None = None,
                     log_level: str = "info", on_start=None, limits: HTTPLimits | None = None,
                     sock: socket.socket | None = None, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> int:
    """Bind host:port (unless `sock` is given, listening already), start the engine core process, then serve HTTP
    until told to stop (SIGINT/SIGTERM on the main thread, or `server.should_exit`); the core is shut down either
    way. `on_start(server, client)` is called once the server runs. `limits`: connection deadlines and cap
    (defaults: HTTPLimits()). A stop signal gives requests in flight `shutdown_timeout` seconds, then aborts them
    (server/lifecycle.py)."""
    limits = limits or HTTPLimits()
    raise_open_files_limit()  # before the cap is derived from it
    sock = sock if sock is not None else listening_socket(host, port)
    try:
        with filter_repeats():
            return await _serve(config, sock, host, served_model_name, api_key, log_level, on_start, limits,
                                shutdown_timeout)
    finally:
        sock.close()  # uvicorn closed it if it ran; not if the engine failed to start


async def _serve(config, sock, host, served_model_name, api_key, log_level, on_start, limits: HTTPLimits,
                 shutdown_timeout: float) -> int:
    import uvicorn

    # --data-parallel-size N: N engine cores behind this one frontend
    client_class = EngineClient if config.data_parallel_size == 1 else DataParallelClient
    starting = asyncio.ensure_future(client_class.start(config, log_level.upper()))
    # a stop while the engine starts abandons the start (once: a second cancel would cut short its cleanup)
    with StopSignals(on_stop=lambda why, count: count == 1 and starting.cancel()) as signals:
        try:
            client = await starting
        except asyncio.CancelledError:
            if not signals.received:
                raise
            print("moeserve: stopped while the engine was starting", flush=True)
            return 0
        drain = None
        try:
            name = served_model_name or Path(client.info.model).name
            app = create_app(client, name, api_key=api_key, max_request_body_bytes=limits.max_request_body_bytes)
            # keep-alive (default 75 s) longer than a client's pause between requests: a connection closed by the
            # server exactly as the client reuses it is a dropped request. The connection cap is enforced by the
            # protocol class (uvicorn's limit_concurrency would still accept the sockets, and answer in plain text)
            server = ServerWithoutSignals(uvicorn.Config(
                app, host=host, port=sock.getsockname()[1], log_level=log_level, backlog=4096,
                timeout_keep_alive=limits.timeout_keep_alive,
                http=guarded_protocol_class(limits, app.state.admission.shed)))
            drain = Drain(server, client, shutdown_timeout)
            signals.on_stop = drain.stop
            if signals.received:  # a signal between the engine's start and now
                drain.stop("stop signal", 1)
            serving = asyncio.ensure_future(server.serve(sockets=[sock]))
            while not server.started and not serving.done():
                await asyncio.sleep(0.01)
            if server.started:
                # everything alive now (transformers, the tokenizer, the app) lives as long as the server: freezing it keeps
                # the oldest-generation collections, which a burst of connections triggers, from scanning it each
                # time (a few hundred ms a pass, during which nothing is answered)
                gc.collect()
                gc.freeze()
                adapters = ", ".join(client.lora_names) or "none"
                port = server.servers[0].sockets[0].getsockname()[1]
                print(f"moeserve: serving model {name!r} (adapters: {adapters}) at http://{host}:{port}/v1 "
                      f"({client.where()})",
                      flush=True)
                if on_start is not None:
                    on_start(server, client)
            await serving
        finally:
            signals.on_stop = None  # from here on the engine is being stopped anyway
            if drain is not None:
                drain.cancel()
            gc.unfreeze()  # what the server held may go now (and leaks checkers at exit see no frozen objects)
            await client.shutdown()
    return 0
