"""A real `moeserve serve` stack for tests: the engine core in its own process, uvicorn + the
frontend on a random loopback port in a thread of this process (so tests can reach the frontend's
EngineClient), on the event loop `moeserve serve` runs, and helpers that use the core's test hooks
(MOESERVE_TEST_HOOKS=1)."""
from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
from contextlib import contextmanager

import httpx
import openai

from moeserve import EngineConfig
from moeserve.messages import EngineStats, FailNextSteps, Hold
from moeserve.server.app import run_on_server_loop, run_server

os.environ["MOESERVE_TEST_HOOKS"] = "1"  # inherited by the engine-core processes started from here


def wait_until(cond, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


class RunningServer:
    def __init__(self, config: EngineConfig, model: str, api_key: str | None = None):
        started = threading.Event()
        self.error: BaseException | None = None

        def on_start(server, client):
            self.server, self.engine, self.loop = server, client, asyncio.get_running_loop()
            started.set()

        def run():
            try:
                run_on_server_loop(run_server(config, "127.0.0.1", 0, model, api_key, "warning", on_start))
            except BaseException as e:  # noqa: BLE001 - reported by the constructor
                self.error = e
                started.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(180), "server did not start"
        if self.error is not None:
            raise self.error
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0, timeout=60)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def run(self, coro, timeout: float = 60):
        """Run a coroutine on the server's event loop (where its EngineClient lives)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stats(self) -> EngineStats:
        return self.run(self.engine.stats())

    def wait_idle(self, timeout: float = 20.0) -> EngineStats:
        deadline = time.time() + timeout
        while True:
            s = self.stats()
            if s.num_running == 0 and s.num_waiting == 0 or time.time() > deadline:
                return s
            time.sleep(0.02)

    @contextmanager
    def engine_paused(self):
        """Hold the engine core between steps: requests pile up, nothing runs until the block ends."""
        flag = tempfile.mktemp(prefix="moeserve-hold-")
        open(flag, "w").close()
        done = asyncio.run_coroutine_threadsafe(self.engine.call(Hold(flag)), self.loop)
        wait_until(lambda: os.path.exists(flag + ".held"))
        try:
            yield
        finally:
            os.remove(flag)
            done.result(30)
            os.remove(flag + ".held")

    def fail_next_steps(self, n: int, message: str) -> None:
        self.run(self.engine.call(FailNextSteps(n, message)))

    def close(self):
        self.http.close()
        self.server.should_exit = True
        self.thread.join(60)
