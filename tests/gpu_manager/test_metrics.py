"""The gpu_manager's Prometheus /metrics (issue 24, part 4): served on `metrics_port` when set, off otherwise,
and its figures follow the lease table, the engine connections and the fds."""

from __future__ import annotations

import json

import nats.errors

from services.gpu_manager.settings import GpuManagerSettings
from tests.gpu_manager.harness import until
from tests.scrape import scrape

MIB = 1024 * 1024


async def _health(bus, settings) -> dict:  # noqa: ANN001
    try:
        msg = await bus.nc.request(f"{settings.subject_prefix}.health.gpu_manager", b"", timeout=3)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):  # not announced yet: asked again
        return {}
    return json.loads(msg.data)["detail"]



def leases(m: dict, state: str) -> float:
    return m[("holdfast_gpu_manager_leases", (("state", state),))]


async def test_metrics_follow_an_allocate_and_an_engine_death(manager_factory, engines, bus, settings) -> None:  # noqa: ANN001
    manager = manager_factory(HF_METRICS_PORT="0", HF_HOST_CAPACITY_BYTES=str(64 * MIB)).start()
    port = (await until(lambda: _health(bus, settings)))["metrics_port"]
    before = scrape(port)
    assert leases(before, "ACTIVE") == 0
    assert before[("holdfast_gpu_manager_capacity_bytes", (("gpu", "0"),))] == 64 * MIB
    assert before[("holdfast_gpu_manager_connections", ())] == 0
    assert before[("holdfast_gpu_manager_open_fds", ())] > 0

    engine = engines(manager, "metrics-e1")
    engine.ask(f"write {3 * MIB} 1")
    during = scrape(port)
    assert leases(during, "ACTIVE") == 1
    assert during[("holdfast_gpu_manager_leased_bytes", (("gpu", "0"), ("state", "ACTIVE")))] == 3 * MIB
    assert during[("holdfast_gpu_manager_connections", ())] == 1
    assert during[("holdfast_gpu_manager_open_fds", ())] >= before[("holdfast_gpu_manager_open_fds", ())] + 3

    engine.kill()  # its lease is orphaned (kept for a successor), its connection gone
    after = await until(lambda: _orphaned(port))
    assert leases(after, "ACTIVE") == 0
    assert after[("holdfast_gpu_manager_leased_bytes", (("gpu", "0"), ("state", "ORPHANED")))] == 3 * MIB
    assert after[("holdfast_gpu_manager_connections", ())] == 0


async def _orphaned(port: int) -> dict | None:
    m = scrape(port)
    return m if leases(m, "ORPHANED") == 1 and m[("holdfast_gpu_manager_connections", ())] == 0 else None


def test_metrics_are_off_by_default_and_on_loopback() -> None:
    s = GpuManagerSettings()
    assert (s.metrics_port, s.metrics_host) == (None, "127.0.0.1")
