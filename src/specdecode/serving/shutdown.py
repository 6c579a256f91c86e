"""Graceful shutdown: on SIGTERM or SIGINT the server drains before it exits.

uvicorn's own handling closes the listening socket at once, so a client that arrives during the
shutdown gets a refused connection, and requests in flight are cancelled without a word when its
graceful timeout passes. Here the first signal instead starts ``ServerState.drain``: new
requests get a 503 with an OpenAI error body, requests in flight get ``drain_timeout`` seconds
to finish, the rest are ended cleanly (a stream's last events are an error and ``[DONE]``), and
only then does uvicorn shut down. A second signal exits within a second: every request still
in flight is ended at once (a stream's last events are the same error and ``[DONE]``), their
responses get up to ``EXIT_FLUSH_SECONDS`` to go out (then uvicorn stops waiting for them,
``force_exit``, instead of its graceful timeout), and once uvicorn has shut down the process ends
(``os._exit``, status 128 + the signal) without the interpreter's teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from specdecode.serving.connections import uvicorn_config

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# After a second signal: how long the ended responses get, at most, to send their last events.
EXIT_FLUSH_SECONDS = 0.5


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, drain_timeout: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain: asyncio.Future[None] | None = None  # held so the task is not collected
        self._exit: asyncio.Future[None] | None = None
        self._exit_code: int | None = None  # set by a second signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, and after a second signal the process ends as soon as the server has shut
        down: tearing down an interpreter that holds models and a torch runtime takes a second
        or more, which a second signal asks to skip."""
        try:
            with super().capture_signals():
                yield
        finally:
            if self._exit_code is not None:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(self._exit_code)

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig not in DRAIN_SIGNALS or self._loop is None:
            super().handle_exit(sig, frame)  # before start-up: uvicorn's own handling
            return
        if self._drain_requested:  # a second signal: end everything now
            self._exit_code = 128 + sig  # what a shell reports for a process the signal killed
            self._loop.call_soon_threadsafe(self._exit_now)
            return
        self._drain_requested = True
        self._captured_signals.append(sig)  # uvicorn re-raises it after shutdown, as it would have
        # Signal handlers run between two bytecodes of the loop's thread: schedule, do not run.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.state.draining = True
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    def _exit_now(self) -> None:
        self._captured_signals.clear()  # not re-raised: capture_signals ends the process
        self.state.end_all()
        self.should_exit = True
        self._exit = asyncio.ensure_future(self._force_exit_once_flushed())

    async def _force_exit_once_flushed(self, poll: float = 0.02) -> None:
        """Give the ended responses ``EXIT_FLUSH_SECONDS`` to go out (they leave
        ``state.inflight``); if some are still open then, stop uvicorn waiting for them. Once all
        have gone, uvicorn's own shutdown is quick and runs the application's lifespan end,
        which ``force_exit`` would skip (its task then cancelled, with a traceback)."""
        assert self._loop is not None
        deadline = self._loop.time() + EXIT_FLUSH_SECONDS
        while self.state.inflight and self._loop.time() < deadline:
            await asyncio.sleep(poll)
        if self.state.inflight:
            self.force_exit = True

    async def _drain_then_exit(self) -> None:
        try:
            await self.state.drain(self.drain_timeout)
        finally:
            self.should_exit = True


def run_draining(app: Any, state: Any, host: str, port: int, log_level: str) -> None:
    options = state.options
    config = uvicorn_config(app, host, port, log_level, options.keep_alive_timeout, options.max_connections,
                            options.header_timeout)
    DrainingServer(config, state, options.drain_timeout).run()
