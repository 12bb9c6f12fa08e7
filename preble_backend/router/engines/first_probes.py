"""The router routes nothing before it knows the engines it starts with.

Until an engine's first health probe answers, the policy knows neither its role (a
prefill engine would be taken for one that decodes whole requests) nor its KV capacity
or host tier (the defaults stand in). So a request that arrives in that window waits
until every engine the router started with has answered a probe or been found down, at
most ``timeout_s``; after that it is routed on what is known, so an engine that neither
answers nor fails never holds the router. Engines that join later are not waited for:
they take requests only once a probe answers (``EngineMonitor.watch``).
"""

from __future__ import annotations

import asyncio


class FirstProbes:
    """Which starting engines have not yet been heard from; ``settled`` on the event loop."""

    def __init__(self, num_engines: int) -> None:
        self.unheard = set(range(num_engines))
        self._heard = asyncio.Event()
        if not self.unheard:
            self._heard.set()

    def settled(self, instance: int) -> None:
        """The engine answered a probe or was found down: either way the router knows it."""
        self.unheard.discard(instance)
        if not self.unheard:
            self._heard.set()

    async def wait(self, timeout_s: float) -> bool:
        """True once every starting engine is known; False when ``timeout_s`` ran out first."""
        if self._heard.is_set():
            return True
        try:
            await asyncio.wait_for(self._heard.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
