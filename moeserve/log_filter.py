"""Repeated log lines rate-limited: a flood (of connections, of failing requests, of failing steps) must not
turn the log into the bottleneck or fill the disk. Used by the HTTP frontend and the engine-core process."""
from __future__ import annotations

import logging
import threading
import time


class RepeatFilter(logging.Filter):
    """Lets a WARNING-or-worse message through at most once per `interval` seconds; the next one that passes says
    how many were suppressed. Messages are the same when their first lines are (asyncio's accept error, say,
    differs per socket only after the first line). Quieter records pass untouched."""

    def __init__(self, interval: float = 10.0, max_keys: int = 1024, clock=time.monotonic):
        super().__init__()
        self.interval = interval
        self.max_keys = max_keys
        self.clock = clock
        self._last: dict[tuple, list] = {}  # key -> [time let through, suppressed since]
        self._lock = threading.Lock()  # handlers may run on any thread (the engine client's, uvicorn's)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        try:
            first = record.getMessage().split("\n", 1)[0]
        except Exception:  # noqa: BLE001 - a broken record is logging's business, not ours
            return True
        key = (record.name, record.levelno, first)
        now = self.clock()
        with self._lock:
            seen = self._last.get(key)
            if seen is not None and now - seen[0] < self.interval:
                seen[1] += 1
                return False
            suppressed = seen[1] if seen is not None else 0
            if len(self._last) >= self.max_keys:
                self._last = {k: v for k, v in self._last.items() if now - v[0] < self.interval}
            self._last[key] = [now, 0]
        if suppressed:
            record.msg = f"{record.getMessage()} [{suppressed} more like this suppressed in the last " \
                         f"{self.interval:g}s]"
            record.args = None
        return True


class filter_repeats:
    """Context manager: one RepeatFilter on `loggers` (by default those a flood of connections or requests
    writes to in the frontend) while the block runs."""

    FRONTEND_LOGGERS = ("asyncio", "uvicorn.error", "uvicorn.access", "moeserve")

    def __init__(self, interval: float = 10.0, loggers: tuple[str, ...] = FRONTEND_LOGGERS):
        self.filter = RepeatFilter(interval)
        self.loggers = loggers

    def __enter__(self) -> RepeatFilter:
        for name in self.loggers:
            logging.getLogger(name).addFilter(self.filter)
        return self.filter

    def __exit__(self, *exc) -> None:
        for name in self.loggers:
            logging.getLogger(name).removeFilter(self.filter)
