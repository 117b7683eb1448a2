"""A private asyncio loop in a daemon thread.

Engines whose clients bind to one event loop (vLLM's AsyncLLM, an HTTP connection pool) live on
such a loop, so callers can await them from any loop: reroll's rollouts open a fresh one per
call with `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


class BackgroundLoop:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine) -> Any:
        """Run on the private loop and block this (non-loop) thread until done."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def wait(self, coroutine: Coroutine) -> Any:
        """Run on the private loop and await the result from the caller's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    def call_soon(self, callback, *args) -> None:
        self.loop.call_soon_threadsafe(callback, *args)

    def close(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
