"""`lead_forever`: campaign, lead one term, step down when it ends, campaign again (in-process, with backoff).

A term ends when the election lease is lost (etcd expired it: a partition, a stalled etcd), when a fenced
write finds the leader key no longer this term's, or when a term task fails. Stepping down is what a
kubelet or an etcd client does through a partition, not an exit: stop every leader-only task, unsubscribe
the pipeline's consumers (their unacked events are redelivered to whoever leads next), let the term's
queued writes fail against the fence (`LeaderElection.fence`: the old term's key is gone, so none of them
can land, even if this process leads again), resign, wait a backoff, campaign again.

Invariants: at most one term of this process is running at any moment; a term's writes hold only while
its leader key exists; a campaign that fails (etcd unreachable) is retried with exponential backoff, never
fatal. A broken invariant (`InvariantBroken`) still ends the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from libs.common.backoff import Backoff
from libs.common.errors import InvariantBroken
from libs.common.store import LeaderElection, Store

log = logging.getLogger("holdfast.controller.leadership")

STEP_DOWN_DEADLINE_S = 10.0  # the old term's tasks and queued writes get this long to end
STABLE_TERM_S = 60.0  # a term that lasted this long resets the backoff
LEASE_LOST = "election lease expired"
FENCED = ("a written-behind record could not be kept (a fenced write found another term's leader key, or etcd "
          "refused or did not answer the write)")


class Term(Protocol):
    """One tenure's work: `tasks` run until the term ends; `stop` ends what they leave (consumers, writes)."""

    lost: asyncio.Event  # set by the term itself when it finds it can no longer write (fenced out)

    def tasks(self) -> dict[str, Coroutine[Any, Any, Any]]: ...

    async def stop(self) -> None: ...


async def _until_over(election: LeaderElection, term: Term, tasks: dict[str, asyncio.Task[Any]]) -> str:
    """Why the term is over: the lease, the fence, or a task's end (a failure is re-raised if it is a bug)."""
    lease = asyncio.create_task(election.lost.wait(), name="term:lease")
    fence = asyncio.create_task(term.lost.wait(), name="term:fence")
    try:
        done, _ = await asyncio.wait([lease, fence, *tasks.values()], return_when=asyncio.FIRST_COMPLETED)
    finally:
        lease.cancel()
        fence.cancel()
    if lease in done:
        return LEASE_LOST
    if fence in done:
        return FENCED
    task = next(iter(done))
    exc = task.exception()
    if isinstance(exc, InvariantBroken):
        raise exc
    return f"task {task.get_name()} ended: {exc!r}"


async def _stop(term: Term, tasks: dict[str, asyncio.Task[Any]]) -> None:
    for t in tasks.values():
        t.cancel()
    if tasks:
        await asyncio.wait(tasks.values(), timeout=STEP_DOWN_DEADLINE_S)
    try:
        await asyncio.wait_for(term.stop(), STEP_DOWN_DEADLINE_S)
    except Exception as e:  # noqa: BLE001 - a stop that cannot finish (etcd away) must not keep us from campaigning
        log.warning("stepping down: the old term did not stop cleanly: %r", e)


async def lead_forever(election: LeaderElection, begin: Callable[[], Awaitable[Term]],
                       on_change: Callable[[bool], None], backoff: Backoff | None = None) -> None:
    """Lead whenever elected, for as long as this runs. `begin` starts a term (after the election is won);
    `on_change(True/False)` tells the rest of the process whether it leads."""
    backoff = backoff or Backoff(first_s=0.5, max_s=15.0)
    while True:
        try:
            await election.campaign()
            term = await begin()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - etcd or NATS unreachable: temporary, campaign again later
            delay = backoff.next_delay()
            log.warning("campaign or term start failed (%r); campaigning again in %.1f s", e, delay)
            await _resign(election)
            await pause(election.store, delay)
            continue
        on_change(True)
        started = time.monotonic()
        tasks = {name: asyncio.create_task(coro, name=name) for name, coro in term.tasks().items()}
        try:
            why = await _until_over(election, term, tasks)
        finally:
            on_change(False)
            await _stop(term, tasks)
            await _resign(election)
        if time.monotonic() - started >= STABLE_TERM_S or why in (LEASE_LOST, FENCED):
            # a term lost to etcd (its lease, a fenced write) is no fault of this process's to back off from: the
            # campaign waits on etcd itself (repeated etcd stalls 25 s apart had grown the pause to 15 s, the
            # next term starting 15 s after etcd answered; probe of 2026-12-07)
            backoff.reset()
        delay = backoff.next_delay()
        log.error("controller leadership lost (%s): stepping down; campaigning again in %.1f s", why, delay)
        await pause(election.store, delay)


PROBE_S = 0.5  # how often a pause asks whether etcd answers again


async def pause(store: Store, delay_s: float, probe_s: float = PROBE_S) -> None:
    """`delay_s` before campaigning again, or less: when etcd did not answer as the pause began and answers now, at
    once. The backoff doubles on each failure while etcd is away, so a term lost to an etcd outage of seconds waited
    out doublings taken during it (a 7 s outage left no leader for 6-15 s after etcd was back: incidents waited, and
    the routers read etcd's stale level meanwhile; probe of 2026-12-07). An etcd that answers throughout (a term
    that fails with etcd there) waits the whole delay: no hammering."""
    deadline = time.monotonic() + delay_s
    away = not await store.answers(probe_s)
    while (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(probe_s, left))
        if away and await store.answers(probe_s):
            log.info("etcd answers again: campaigning now")
            return


async def _resign(election: LeaderElection) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(election.resign(), STEP_DOWN_DEADLINE_S)
