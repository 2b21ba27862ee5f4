"""The manager keeps answering while its policy writes a multi-GiB host tier copy and while a snapshot replaces it
(issue 21): health over NATS and another engine's heartbeats over the socket are timed every few ms from the commit
until the copy is held, then through the replacing write (the old copy's memory freed: 0.17 s a GiB here, which
the event loop must not pay), and none may take long. A real gpu_manager on the host backend (the cuda path
differs by the device copies and the registration: tests/gpu_manager/test_tier_pins.py,
test_host_tier_cuda.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np

from libs.client.memory import MemoryClient
from libs.common.events import SnapshotLease, SnapshotReply
from tests.gpu_manager.harness import until

GIB = 1024**3
SIZE = 2 * GIB
# The most one answer may take meanwhile: 3x the slowest seen on 2 shared cores (20-80 ms), below the 0.35 s that
# freeing the replaced 2 GiB copy took when its fds were closed on the event loop.
BOUND_S = 0.25


def _commit(m, size: int):  # noqa: ANN001, ANN202
    """An engine of the tiered class with its weights lease filled (not yet committed), and the lease's id."""
    c = MemoryClient.connect("eng-big", socket_path=m.socket, engine_class="tiered")
    lease = c.allocate(size, tag="weights", name="w")
    view = lease.numpy("uint8", (size,))
    view[:] = 7  # touched: the copy reads resident pages, as an engine's loaded weights are
    c.register([lease.meta("t", "uint8", (size,))])
    return c, lease.id


def _beats(m, stop: threading.Event, out: list[float]) -> None:  # noqa: ANN001
    """Another engine's heartbeats, back to back, each one's round trip recorded."""
    c = MemoryClient.connect("eng-beat", socket_path=m.socket, engine_class="other")
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.heartbeat()
            out.append(time.perf_counter() - t0)
            time.sleep(0.01)
    finally:
        c.close()


async def test_health_and_heartbeats_are_answered_while_a_large_tier_copy_is_written(manager_factory, bus, settings):
    m = manager_factory(HF_CHUNK_MIB="256", HF_HOST_TIER_CLASSES='["tiered"]', HF_HOST_TIER_BYTES=str(SIZE + GIB),
                        HF_GRACE_S="600").start()
    subject = f"{settings.subject_prefix}.health.gpu_manager"
    engine, lease_id = await asyncio.to_thread(_commit, m, SIZE)
    stop, beats = threading.Event(), []
    beater = threading.Thread(target=_beats, args=(m, stop, beats), daemon=True)
    beater.start()
    await until(lambda: len(beats) > 3)
    health: list[float] = []

    async def poll(done) -> None:  # noqa: ANN001
        while not await done():
            t = time.perf_counter()
            msg = await bus.nc.request(subject, b"", timeout=60)  # a stall shows as a figure, not a timeout
            health.append(time.perf_counter() - t)
            tiers.append(json.loads(msg.data)["detail"]["host_tier"])
            await asyncio.sleep(0.01)

    tiers: list[dict] = [{"copies": []}]
    t0 = time.perf_counter()
    await asyncio.to_thread(engine.commit)  # the policy starts the copy

    async def held() -> bool:
        return "tiered.w" in tiers[-1]["copies"] or time.perf_counter() - t0 > 300

    await poll(held)
    write_s = time.perf_counter() - t0
    replaced = asyncio.create_task(bus.request("node-1", SnapshotLease(lease_id=lease_id, artifact="tiered.w",
                                                                       host_tier=True), SnapshotReply, timeout=300))
    writes = len(health)

    async def replaced_done() -> bool:
        return replaced.done()

    await poll(replaced_done)
    reply = replaced.result()
    stop.set()
    await asyncio.to_thread(beater.join, 30)
    engine.close()
    during = beats[4:]
    print(f"copy of {SIZE / GIB:.0f} GiB held in {write_s:.2f} s, replaced in {reply.seconds:.2f} s; health: "
          f"{len(health)} answers, max {max(health[:writes]) * 1e3:.1f} ms in the write, "
          f"{max(health[writes:]) * 1e3:.1f} ms in the replacing, p50 {np.median(health) * 1e3:.1f} ms; heartbeats: "
          f"{len(during)}, max {max(during) * 1e3:.1f} ms")
    assert "tiered.w" in tiers[-1]["copies"] and reply.host_tier
    assert max(health) < BOUND_S, f"health waited {max(health):.2f} s while the copy was written or replaced"
    assert max(during) < BOUND_S, f"a heartbeat waited {max(during):.2f} s while the copy was written or replaced"
