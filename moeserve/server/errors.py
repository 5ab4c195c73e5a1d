"""How engine and request errors become HTTP errors in the OpenAI shape."""
from __future__ import annotations

import logging
import re

from fastapi.exceptions import RequestValidationError

from moeserve.errors import (AdapterInUseError, EngineDeadError, EngineStepError, LoRAAdapterError, QueueFullError,
                             UnknownAdapterError)
from moeserve.server.protocol import RETRY_AFTER_S, OpenAIError

logger = logging.getLogger("moeserve")

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop", "stop_token_ids")


# an absolute path in an engine message: after a space, quote, paren or '=' (so "n/a", "1/2" and adapter names,
# which never start with '/', stay)
_PATH_RE = re.compile(r"(?:(?<=^)|(?<=[\s'\"(=\[]))/[^\s'\"(),;\]]+?(?=[:.]?(?:[\s'\"(),;\]]|$))")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def redact_paths(message: str, known: tuple[str, ...] = ()) -> str:
    """`message` without filesystem paths: clients learn nothing of the server's files from an error (the
    server's log keeps the full message)."""
    for path in sorted((p for p in known if p and "/" in p and p != "/"), key=len, reverse=True):
        message = message.replace(path, "<path>")
    return _PATH_RE.sub("<path>", message)


def queue_full(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


def engine_error(e: BaseException, prompt_param: str) -> OpenAIError:
    """Map an exception from the engine to the HTTP error the client sees."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, QueueFullError):
        return queue_full(str(e))
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), type="server_error", code="engine_unavailable")
    if isinstance(e, UnknownAdapterError):  # a KeyError or IndexError is a bug: 500 below
        return OpenAIError(404, redact_paths(str(e)), param="model", code="model_not_found")
    if isinstance(e, ValueError):
        param = getattr(e, "param", None)  # RequestError: the field at fault
        param = "model" if isinstance(e, LoRAAdapterError) else param if param in _SAMPLING_FIELDS else prompt_param
        return OpenAIError(400, redact_paths(str(e)), param=param, code="invalid_value")
    if not isinstance(e, EngineStepError):  # already logged by the engine core
        logger.error("internal error", exc_info=e)
    return OpenAIError(500, redact_paths(f"internal error: {type(e).__name__}: {e}"), type="server_error",
                       code="internal_error")


ADAPTER_NOT_FOUND = "LoRA adapter not found: lora_path is not a readable PEFT adapter folder"


def lora_error(e: BaseException, paths: tuple[str, ...] = ()) -> OpenAIError:
    """Map a load/unload failure to the HTTP error; `paths` (what the request named and where it resolved) are
    redacted from the message, which the server logs in full."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, (ValueError, OSError, RuntimeError)) and not isinstance(e, (EngineDeadError,
                                                                                  AdapterInUseError)):
        logger.warning("LoRA adapter request failed: %s", e)
    if isinstance(e, (FileNotFoundError, NotADirectoryError)):  # one answer for "missing", "not a folder"
        return OpenAIError(404, ADAPTER_NOT_FOUND, param="lora_path", code="adapter_not_found")
    if isinstance(e, UnknownAdapterError):
        return OpenAIError(404, redact_paths(str(e), paths), param="lora_name", code="adapter_not_found")
    if isinstance(e, AdapterInUseError):
        return OpenAIError(409, redact_paths(str(e), paths), param="lora_name", code="adapter_in_use")
    if isinstance(e, (ValueError, PermissionError, IsADirectoryError)):  # other OSErrors are the server's: 500
        return OpenAIError(400, redact_paths(str(e), paths), param="lora_path", code="invalid_adapter")
    return engine_error(e, "lora_path")


def validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return OpenAIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}",
                           code="invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # drop pydantic's union-branch names ("str", "list[int]", ...) from the parameter path
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool",
                                                                          "dict", "list")]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        msg = "field required"
    return OpenAIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")
