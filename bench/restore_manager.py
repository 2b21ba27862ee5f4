"""`holdfast bench restore --manager` (host-tier-only runs): the host tier restore through a real gpu_manager, as a
cold-starting engine gets it, at the size of the in-process part (bench/restore.py) and after it (its tier copy
closed first: the machine holds one copy of the weights in RAM at a time).

Real parts: nats, etcd and a gpu_manager (devstack.stack, `services=("gpu_manager",)`) whose host tier takes the
weights of engine class `bench-host` by policy after a first load (`host_tier_classes`: the tier only, no artifact
on disk), as a node keeps a class's weights. Here, through the SDK (libs/client/memory.py):
1. a writer allocates a weights lease, fills it with the synthetic weights (bench/restore_synth.py), registers one
   tensor and commits; the policy copies it to the host tier and, on cuda, page-locks the copy there; `write_s` is
   commit to the copy held and registered (health's `host_tier`: the copy listed, `registered_bytes` its size),
   polled every 50 ms, each answer timed (`health_max_ms`: the longest, the manager's event loop busy that long while
   it wrote; `health_timeouts`: polls unanswered within 10 s, retried until the write's own bound); then the writer
   releases its lease (nothing of it left on the device);
2. per trial a new client asks `restore("bench-host.weights", sources=["host"])`: `to_ready_s` is the request to
   the new lease granted and mapped in this process (the gpu_manager allocated it, filled it, registered its
   tensors; the client imported and mapped its chunks): from nothing on the device to the weights lease ready.
   The manager's own figures (`fill_s`, `register_s`: 0 when the copy was registered at its write,
   `registered_dma`) come with it; the lease is checked against the pattern, then released.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import restore_synth
from bench.stats import pct

CLASS = "bench-host"
NAME = f"{CLASS}.weights"
GIB = 1024**3
POLL_S = 0.05
HEALTH_TIMEOUT_S = 10.0  # one health poll; a slower answer is a stall, counted and reported, not a crash


async def _wait_copy(stack: Any, size: int, cuda: bool, t0: float, timeout_s: float) -> dict[str, Any]:
    """Health's `host_tier` polled until the copy is held and (cuda) registered: the policy writes it, then registers
    it; a registration refused leaves `registered_bytes` short, so that wait ends after its own bound. Each poll's
    answer time is kept: the manager must answer while it writes (`health_max_ms`, the longest; a poll unanswered
    within HEALTH_TIMEOUT_S counts as that long, in `health_timeouts`, and the next poll goes on)."""
    from nats.errors import TimeoutError as NatsTimeout

    from libs.common.bus import Bus

    settings = stack.settings()
    bus = await Bus.connect(settings, "bench-restore-manager", stream=False)
    longest, timeouts, polls = 0.0, 0, 0
    tier: dict[str, Any] | None = None  # the last answer's (a copy listed stays listed)
    try:
        while True:
            asked = time.perf_counter()
            try:
                msg = await bus.nc.request(f"{settings.subject_prefix}.health.gpu_manager", b"",
                                           timeout=HEALTH_TIMEOUT_S)
                tier = json.loads(msg.data)["detail"]["host_tier"]
            except NatsTimeout:
                timeouts += 1
            polls += 1
            longest = max(longest, time.perf_counter() - asked)
            held = tier is not None and NAME in tier["copies"]
            registered = tier is not None and tier["registered_bytes"] >= size
            waited = time.perf_counter() - t0
            if (held and (registered or not cuda)) or waited > timeout_s:
                return {"write_s": round(waited, 3), "tier": tier, "held": held, "registered_at_write": registered,
                        "health_max_ms": round(longest * 1e3, 1), "health_timeouts": timeouts, "health_polls": polls}
            await asyncio.sleep(POLL_S)
    finally:
        await bus.close()


def _write(stack: Any, socket: str, size: int, cuda: bool, timeout_s: float) -> dict[str, Any]:
    """The writer's lease, filled and committed; the policy's copy waited for; then the lease released."""
    from libs.client.memory import MemoryClient

    c = MemoryClient.connect("bench-writer", socket_path=socket, engine_class=CLASS)
    try:
        lease = c.allocate(size, tag="weights", name="weights")
        restore_synth.fill(lease.mapping, size)
        c.register([lease.meta("w", "uint8", (size,))])
        t0 = time.perf_counter()  # write_s: the commit to the copy seen held (and registered), a poll late at most
        c.commit()
        out = asyncio.run(_wait_copy(stack, size, cuda, t0, timeout_s))
        c.release(lease.id)
        return out
    finally:
        c.close()


def _restore(socket: str, size: int, engine_id: str) -> dict[str, Any]:
    from libs.client.memory import MemoryClient

    c = MemoryClient.connect(engine_id, socket_path=socket, engine_class=CLASS)
    try:
        t0 = time.perf_counter()
        lease = c.restore(NAME, sources=["host"])
        ready = time.perf_counter() - t0
        row = {"to_ready_s": round(ready, 4), **c.last_restore, "verified": restore_synth.matches(lease.mapping, size)}
        c.release(lease.id)
        return row
    finally:
        c.close()


def run(report: dict[str, Any], backend: str, size: int, trials: int, step: Callable[[str], None],
        timeout_s: float = 600.0) -> None:
    """`report["manager"]`: the write, each trial's row and the p50s; a failure in `report["errors"]["manager"]`."""
    from devstack.stack import Stack, StackConfig

    m: dict[str, Any] = {"name": NAME, "bytes": size, "trials": []}
    report["manager"] = m
    stack = None
    try:
        stack = Stack(StackConfig.ephemeral(backend=backend, services=("gpu_manager",),
                                            extra_env={"HF_HOST_TIER_BYTES": str(size + GIB),
                                                       "HF_HOST_TIER_CLASSES": json.dumps([CLASS])}))
        stack.start(timeout=120)
        socket = str(Path(stack.base_dir) / "state" / "gpu_manager.sock")
        step("manager: stack up")
        m.update(_write(stack, socket, size, backend == "cuda", timeout_s))
        if not m["held"]:
            raise RuntimeError(f"the host tier did not take the copy within {timeout_s} s: {m['tier']}")
        step("manager: host tier copy written")
        for i in range(trials):
            m["trials"].append(_restore(socket, size, f"bench-cold-{i}"))
            step(f"manager: restore {i + 1}")
        for key in ("to_ready_s", "fill_s", "register_s", "total_s"):
            m[key] = pct([float(t[key]) for t in m["trials"]], digits=4, keys=("p50", "max"))
        m["verified"] = all(t["verified"] for t in m["trials"])
    except Exception as e:  # noqa: BLE001 - in the report, which is printed either way
        report["errors"]["manager"] = f"{type(e).__name__}: {e}"
    finally:
        if stack is not None:
            stack.stop()
        step("manager: done")
