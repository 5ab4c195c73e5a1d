"""Every failure the engine reports, one class per kind, defined once.

The engine core raises them; they cross the process boundary by type (moeserve/messages.py carries an error as
its class's tag and its message) and the frontend re-raises the same class, which the HTTP layer maps to a status
by type (server/errors.py). Nothing anywhere tells errors apart by their message text or class name.
"""
from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something moeserve does not implement (refused at start, by name)."""


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, limits, sampling values); the message says why. HTTP 400.
    `param`: the request field at fault, where one is (reported in the HTTP error; it does not cross processes)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFullError(RequestError):
    """The engine's waiting queue holds max_queue_len requests; retry later. HTTP 503 with Retry-After."""


class AdapterPathError(RequestError):
    """A load names no path where one is needed, or a path outside --lora-dir. HTTP 400."""


class LoRAAdapterError(ValueError):
    """The adapter cannot be served; the message names the adapter, the file or key, and the problem. HTTP 400."""


class InvalidAdapterNameError(LoRAAdapterError):
    """An adapter name that is not allowed (characters, '/' components, ':'). HTTP 400."""


class PatternKeyError(ValueError):
    """A rank_pattern / alpha_pattern table that cannot be used as PEFT would use it (lora/pattern_keys.py).
    `about_names`: the adapter's module names (its weights file) are at fault rather than the table's keys (its
    config); the adapter parser reports it as that file's LoRAAdapterError (it does not cross processes)."""

    def __init__(self, message: str = "", about_names: bool = False):
        super().__init__(message)
        self.about_names = about_names


class UnknownAdapterError(LookupError):
    """A request or call names an adapter the engine does not serve. HTTP 404."""


class AdapterInUseError(RuntimeError):
    """A LoRA call refused because of the adapter's requests: pinning it would take the last slot that queued or
    running requests for other adapters need. (An unload never answers this: it drains.) HTTP 409."""


class CheckpointError(ValueError):
    """The checkpoint does not match its config (missing tensor, wrong shape, unreadable file); refused at start."""


class InsufficientMemoryError(ValueError):
    """The weights, the LoRA slot pool and the smallest useful KV cache do not fit the device; the message gives the
    accounting and names the flags that change it. Refused at start."""


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on and says which rank. HTTP 500."""


class EngineShutdownError(RuntimeError):
    """The engine was shut down: it takes no more requests or calls."""


class EngineDeadError(RuntimeError):
    """The engine core is not running (it died, or was shut down). HTTP 503."""


class EngineStartError(RuntimeError):
    """The engine core failed to start for a reason other than the configuration (its log has the traceback; the
    error the core raised is this one's __cause__, of its own type)."""


class EngineStepError(RuntimeError):
    """The engine failed this request (a failed step, an adapter that could not be read). HTTP 500."""


# what a user can get wrong (a path, a flag's value): reported as one line, without a traceback
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               PermissionError)
