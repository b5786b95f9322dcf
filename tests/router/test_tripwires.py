"""``Tripwires``: a trip ends the awaits armed on that engine (and kind) at once, with
its cause, and nothing else; a cancel from elsewhere stays a cancel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvatlas.router.tripwires import Tripped, Tripwires


def test_tripwires_end_only_the_awaits_of_the_engine_at_fault() -> None:
    async def scenario() -> None:
        wires = Tripwires()
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def wait(url: str, kind: Any) -> str:
            try:
                async with wires.arm(url, kind):
                    await asyncio.shield(never)
            except Tripped as exc:
                return f"{exc.url} {exc.cause}"
            return "done"

        a = asyncio.create_task(wait("http://a", "first_byte"))
        b = asyncio.create_task(wait("http://a", "stream"))
        c = asyncio.create_task(wait("http://b", "first_byte"))
        await asyncio.sleep(0)
        assert (wires.armed("http://a", "first_byte"), wires.armed("http://a", "stream")) == (1, 1)
        assert wires.trip("http://a", "breaker", ("first_byte",)) == 1
        assert await a == "http://a breaker"
        assert wires.trip("http://a", "frozen") == 1
        assert await b == "http://a frozen"
        assert not c.done() and wires.armed("http://a", "first_byte") == 0
        c.cancel()  # a cancel from elsewhere stays a cancel
        with pytest.raises(asyncio.CancelledError):
            await c
        assert wires.armed("http://b", "first_byte") == 0
        never.set_result(None)
        assert await wait("http://b", "stream") == "done"

    asyncio.run(scenario())
