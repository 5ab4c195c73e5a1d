"""What an adapter may be called and what its folder holds: checked where a name arrives (flags, HTTP requests,
the offline API), in the HTTP process too, which imports neither the parser (adapter.py) nor torch."""
from __future__ import annotations

import re

from moeserve.errors import InvalidAdapterNameError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9._/-]{1,128}")


def validate_adapter_name(name: str) -> None:
    """Raise LoRAAdapterError unless `name` is 1-128 characters of [A-Za-z0-9._-/], with '/' only between
    non-empty components none of which is '.' or '..' (names show up in URLs, logs and cache paths)."""
    if not isinstance(name, str):
        raise InvalidAdapterNameError(f"adapter name must be a string, got {type(name).__name__}")
    shown = repr(name if len(name) <= 64 else name[:64] + "...")
    if not _ADAPTER_NAME_RE.fullmatch(name):
        raise InvalidAdapterNameError(f"invalid adapter name {shown}: use 1-128 characters of A-Z a-z 0-9 . _ - /")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise InvalidAdapterNameError(f"invalid adapter name {shown}: '/' may only separate components, and no "
                                      "component may be empty, '.' or '..'")
