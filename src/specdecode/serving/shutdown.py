"""Graceful shutdown: on SIGTERM or SIGINT the server drains before it exits.

uvicorn's own handling closes the listening socket at once, so a client that arrives during the
shutdown gets a refused connection, and requests in flight are cancelled without a word when its
graceful timeout passes. Here the first signal instead starts ``ServerState.drain``: new
requests get a 503 with an OpenAI error body, requests in flight get ``drain_timeout`` seconds
to finish, the rest are ended cleanly (a stream's last events are an error and ``[DONE]``), and
only then does uvicorn shut down. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType
from typing import Any

import uvicorn

# uvicorn's own graceful wait, after the drain: the ended responses only need to flush.
FLUSH_TIMEOUT_SECONDS = 3.0
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, drain_timeout: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain: asyncio.Future[None] | None = None  # held so the task is not collected

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig not in DRAIN_SIGNALS or self._loop is None or self._drain_requested:
            super().handle_exit(sig, frame)  # a second signal (or one before start-up): exit now
            return
        self._drain_requested = True
        self._captured_signals.append(sig)  # uvicorn re-raises it after shutdown, as it would have
        # Signal handlers run between two bytecodes of the loop's thread: schedule, do not run.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.state.draining = True
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.state.drain(self.drain_timeout)
        finally:
            self.should_exit = True


def run_draining(app: Any, state: Any, host: str, port: int, log_level: str, drain_timeout: float) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(FLUSH_TIMEOUT_SECONDS))
    DrainingServer(config, state, drain_timeout).run()
