"""What tests of several subsystems share: a fake clock, waiting on a condition, the records a node side writes.

Waits are on conditions, never fixed sleeps: a test states what it waits for, and a slow machine only makes it
wait longer, up to a bound that fails the test with what was awaited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from libs.common.bus import Bus
from libs.common.events import IntentResult
from libs.common.store import Store


class Clock:
    """A clock the test moves: `now` is what it reads, `step` what each read adds first (0: it stands still)."""

    def __init__(self, now: float = 100.0, step: float = 0.0) -> None:
        self.now = now
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


async def wait_until(cond: Callable[[], Any | Awaitable[Any]], within_s: float = 20.0, every: float = 0.05,
                     what: str = "condition") -> Any:
    """Poll `cond` (plain or async) until it returns something truthy, and return that; an AssertionError naming
    `what` after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_s} s waiting for {what}")
        await asyncio.sleep(every)


async def put_node(store: Store, node: str, *, datacenter: str = "dc-1", gpu_bytes: int = 10 * 2**30) -> None:
    """A node with one healthy GPU, as its agent and gpu_manager record them."""
    await store.put(f"nodes/{node}", {"node": node, "datacenter": datacenter, "started_at": time.time(), "gpus": [0]})
    await store.put(f"gpus/{node}/0", {"healthy": True, "total_bytes": gpu_bytes})


async def intent_results(bus: Bus, incident: str) -> list[IntentResult] | None:
    """The dc_manager's results for `incident` so far (None while there is none: a `wait_until` condition)."""
    got = [e.data for e in await bus.replay("intent.result")
           if isinstance(e.data, IntentResult) and e.data.incident_id == incident]
    return got or None


async def ended_then_current_term(store: Any) -> tuple[int, Any]:
    """A controller term that has ended (its leader resigned: a paused leader's lease expires the same way) and the
    election of the leader after it, still leading: (the ended term, the current election; resign it after)."""
    from libs.common.store import LeaderElection

    old = LeaderElection(store, "controller", "c-old", ttl=2)
    await old.campaign()
    stale = old.term
    await old.resign()
    new = LeaderElection(store, "controller", "c-new", ttl=5)
    await new.campaign()
    assert new.term > stale
    return stale, new


FLOOD = """
import asyncio, json, sys
port, n, path, body, key = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].encode(), sys.argv[5]
async def refused():
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST %s HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\nConnection: close\\r\\n"
            b"Content-Length: %d\\r\\n\\r\\n" % (path.encode(), len(body)) + body)
    got = await r.read()
    w.close()
    head, _, answer = got.partition(b"\\r\\n\\r\\n")
    return [int(head.split()[1]), json.loads(answer)["error"][key]]
async def main():
    print(json.dumps(await asyncio.gather(*(refused() for _ in range(n)))))
asyncio.run(main())
"""


def flood(port: int | str, n: int, path: str, body: dict[str, Any], key: str = "code") -> list[list[Any]]:
    """`n` POSTs of `body` to `path` at once, from a process of its own (its loop is not the test's), each on a
    connection of its own: each answer's [status, its JSON error's `key`]."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FLOOD, str(port), str(n), path, json.dumps(body), key],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return list(json.loads(out))


class OwnNats:
    """A nats-server of a test's own (the session's config: TLS, nkeys), on one port for its whole life, so that the
    test may stop, stall (SIGSTOP) or restart it under connections that reconnect to the same address."""

    def __init__(self, tmp_path: Any, nats_conf: Any) -> None:
        from libs.common import procs

        self.port = procs.free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._args = (tmp_path / "nats", tmp_path / "nats.log")
        self._conf = nats_conf
        self.child = self.start()

    def start(self) -> Any:
        from libs.common import procs

        self.child = procs.nats_server(self.port, *self._args, config=self._conf).start()
        procs.wait_port(self.port, self.child)
        return self.child

    def stop(self) -> None:
        self.child.stop()
