"""OpenAI-compatible HTTP frontend: routes, error handlers and `moeserve serve`.

The engine core runs in its own process (runtime/core_process.py); this process serves HTTP,
tokenizes, detokenizes and formats SSE, and talks to the core only through EngineClient's
messages. Every request is validated (pydantic, then SamplingParams, then the core's limits)
before a byte of the response is sent, so each mistake is a 4xx in the OpenAI error shape and a
streaming response only starts for a request the engine accepted. A client that goes away aborts
its requests, which frees their KV blocks at the next step.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.runtime.core_client import EngineClient, EngineDeadError
from moeserve.server.completions import ServerState, create_chat_completion, create_completion
from moeserve.server.errors import ClientGone, lora_error, validation_error
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest, LoadLoRARequest, OpenAIError, UnloadLoRARequest

logger = logging.getLogger("moeserve")

GENERATION_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}


def create_app(engine: EngineClient, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as model `served_model_name` (its adapters by their names)."""
    state = ServerState(engine, served_model_name, api_key)
    app = FastAPI(title="moeserve", version="0.1.0", summary="OpenAI-compatible MoE + multi-LoRA server")
    app.state.moeserve = state

    def error_response(request: Request, err: OpenAIError) -> JSONResponse:
        endpoint = GENERATION_ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            state.metrics.count_request(endpoint, err.status)
        return JSONResponse(err.body(), status_code=err.status)

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
        base = {"id": served_model_name, "object": "model", "created": state.created, "owned_by": "moeserve",
                "root": served_model_name, "parent": None, "max_model_len": state.max_model_len}
        adapters = [{"id": name, "object": "model", "created": state.created, "owned_by": "moeserve",
                     "root": name, "parent": served_model_name, "max_model_len": state.max_model_len}
                    for name in engine.lora_names]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        try:
            return await create_completion(state, body, request)
        except ClientGone:
            state.metrics.count_request("completions", 499)
            return Response(status_code=499)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            return await create_chat_completion(state, body, request)
        except ClientGone:
            state.metrics.count_request("chat_completions", 499)
            return Response(status_code=499)

    @app.post("/v1/load_lora_adapter", dependencies=auth)
    async def load_lora_adapter(body: LoadLoRARequest):
        name = body.lora_name
        if name == served_model_name or name in engine.lora_names:
            raise OpenAIError(400, f"adapter {name!r} is already loaded", param="lora_name",
                              code="adapter_exists")
        if not os.path.exists(body.lora_path):
            raise OpenAIError(404, f"adapter path {body.lora_path!r} does not exist", param="lora_path",
                              code="adapter_not_found")
        try:
            await engine.load_lora(name, body.lora_path, pinned=body.pinned)
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx
            raise lora_error(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=auth)
    async def unload_lora_adapter(body: UnloadLoRARequest):
        name = body.lora_name
        if name not in engine.lora_names:
            raise OpenAIError(404, f"adapter {name!r} is not loaded", param="lora_name",
                              code="adapter_not_found")
        try:
            await engine.unload_lora(name)
        except Exception as e:  # noqa: BLE001
            raise lora_error(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/metrics")
    async def metrics():
        try:
            stats = await engine.stats()
        except EngineDeadError:
            stats = {}
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from moeserve.engine_args import add_engine_args

    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model folder's name)")
    g.add_argument("--api-key", default=os.environ.get("MOESERVE_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1 endpoints (default: $MOESERVE_API_KEY)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level (default: %(default)s)")
    add_engine_args(parser)
    return parser


def serve_main(args: argparse.Namespace) -> int:
    from moeserve.engine_args import engine_config_from_args

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    server = run_server(engine_config_from_args(args), args.host, args.port, args.served_model_name, args.api_key,
                        args.log_level)
    try:
        import uvloop  # the faster event loop, where installed

        return asyncio.Runner(loop_factory=uvloop.new_event_loop).run(server)
    except ImportError:
        return asyncio.run(server)


async def run_server(config, host: str, port: int, served_model_name: str | None = None, api_key: str | None = None,
                     log_level: str = "info", on_start=None) -> int:
    """Start the engine core process, then serve HTTP until told to stop (SIGINT/SIGTERM, or
    `server.should_exit`); the core is shut down either way. `on_start(server, client)` is called once
    the socket listens."""
    import uvicorn

    client = await EngineClient.start(config, log_level.upper())
    try:
        name = served_model_name or Path(client.info["model"]).name
        app = create_app(client, name, api_key=api_key)
        # keep-alive longer than a client's pause between requests: a connection closed by the server
        # exactly as the client reuses it is a dropped request
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, backlog=4096,
                                               timeout_keep_alive=75))
        serving = asyncio.ensure_future(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            adapters = ", ".join(client.lora_names) or "none"
            port = server.servers[0].sockets[0].getsockname()[1]
            print(f"moeserve: serving model {name!r} (adapters: {adapters}) at http://{host}:{port}/v1 "
                  f"(engine core pid {client.proc.pid}, {client.info['device']}, {client.info['dtype']})", flush=True)
            if on_start is not None:
                on_start(server, client)
        await serving
    finally:
        await client.shutdown()
    return 0
