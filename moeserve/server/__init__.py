"""OpenAI-compatible HTTP server (FastAPI) on the engine's async interface."""
from moeserve.server.app import add_serve_args, create_app, serve_main

__all__ = ["create_app", "add_serve_args", "serve_main"]
