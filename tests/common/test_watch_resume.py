"""A watch started without a start revision whose stream breaks before its first event: it resumes after the
revision it started at, so a change made while it was cut off is still delivered (not lost to a resume "from
now"), and a resume the compaction has passed is the typed `WatchCompacted`.

The break is real: the watching store reaches etcd through a TCP relay that the test cuts (every connection
closed, new ones refused) and restores; the writes go to etcd directly, through the fixture's own store.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from libs.common.config import CommonSettings
from libs.common.errors import WatchCompacted
from libs.common.store import Store, WatchEvent
from tests.support import wait_until

WAIT_S = 20.0  # a guard against hanging: the resume itself takes one reconnect (<= 1 s backoff) and 0.5 s


class CuttableRelay:
    """127.0.0.1:<port> -> etcd, byte for byte (TLS passes through untouched); `cut()` closes every
    connection and stops listening, `restore()` listens again on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.connections = 0

    async def restore(self) -> None:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in list(self.writers):
            w.transport.abort()  # a reset, as a dead member's would be: no orderly close to wait for
        self.writers.clear()
        await self.server.wait_closed()
        self.server = None

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self.writers.discard(writer)
            writer.transport.abort()


@contextlib.asynccontextmanager
async def relayed_store(settings: CommonSettings) -> AsyncIterator[tuple[Store, CuttableRelay]]:
    relay = CuttableRelay(settings.etcd_hosts()[0])
    await relay.restore()
    watcher = await Store.connect(settings.model_copy(update={"etcd_endpoints": f"127.0.0.1:{relay.port}"}))
    try:
        yield watcher, relay
    finally:
        await watcher.close()
        if relay.server is not None:
            await relay.cut()


def _watching(store: Store, seen: list[WatchEvent], prefix: str) -> asyncio.Task[None]:
    async def watch() -> None:
        async for ev in store.watch_prefix(prefix):
            seen.append(ev)

    return asyncio.create_task(watch(), name=f"watch:{prefix}")


def watch_created(store: Store) -> bool:
    """etcd has confirmed a watch of this store's: changes from now on reach it (a watch task only starts when
    the loop next runs it, so a write right after creating the task can come before the watch exists)."""
    return bool(store.client._watcher._callbacks)


async def _stop(task: asyncio.Task[None]) -> BaseException | None:
    if not task.done():
        task.cancel()
    results = await asyncio.gather(task, return_exceptions=True)
    return results[0] if isinstance(results[0], BaseException) else None


@contextlib.asynccontextmanager
async def a_fresh_watch_cut_off(settings: CommonSettings, prefix: str) -> AsyncIterator[
        tuple[asyncio.Task[None], list[WatchEvent], CuttableRelay]]:
    """A watch of `prefix` started with no start revision, created on etcd, then cut off before its first event."""
    async with relayed_store(settings) as (watcher, relay):
        seen: list[WatchEvent] = []
        task = _watching(watcher, seen, prefix)
        try:
            await wait_until(lambda: watch_created(watcher), within_s=WAIT_S, what="the watch created")
            await relay.cut()
            yield task, seen, relay
        finally:
            await _stop(task)


async def test_a_change_made_while_a_fresh_watch_is_cut_off_arrives_when_it_resumes(
        settings: CommonSettings, store: Store) -> None:
    async with a_fresh_watch_cut_off(settings, "cut/") as (_, seen, relay):
        await store.put("cut/while-away", 1)  # etcd moves on while the watch cannot hear it
        await relay.restore()
        await store.put("cut/after", 2)
        await wait_until(lambda: [e.key for e in seen] == ["cut/while-away", "cut/after"], within_s=WAIT_S,
                         what="both changes, in order")
        assert relay.connections >= 2  # it did reconnect: the events came over a new connection


async def test_a_fresh_watch_whose_resume_was_compacted_away_raises_watch_compacted(
        settings: CommonSettings, store: Store) -> None:
    async with a_fresh_watch_cut_off(settings, "gone/") as (task, seen, relay):
        await store.put("gone/1", 1)
        await store.put("gone/2", 2)
        _, revision = await store.get_with_revision("gone/2")
        await store.client.compact(revision)  # the change the watch missed is no longer in the history
        await relay.restore()
        done, _ = await asyncio.wait([task], timeout=WAIT_S)
        error = await _stop(task)
        assert done and isinstance(error, WatchCompacted), error
        assert error.compacted_revision == revision and seen == []
