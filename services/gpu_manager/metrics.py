"""gpu_manager metrics in Prometheus form (`GET /metrics` on `metrics_port`).

Every figure is read at scrape time from the tables the service keeps anyway (the lease book, the GPU board,
the connection count, the engine socket's server), so nothing on the allocate path records anything and a
figure cannot drift from what health reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.common.events import LeaseState
from libs.common.wire import FrameServer
from services.gpu_manager.limits import ConnectionCount
from services.gpu_manager.manager import LeaseBook


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


class BookCollector(Collector):
    def __init__(self, book: LeaseBook, conns: ConnectionCount, server: FrameServer,
                 fd_usage: Callable[[], tuple[int, int]]) -> None:
        self.book = book
        self.conns = conns
        self.server = server
        self.fd_usage = fd_usage

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        leases = GaugeMetricFamily("holdfast_gpu_manager_leases", "Leases in the table, per state", labels=["state"])
        leased = GaugeMetricFamily("holdfast_gpu_manager_leased_bytes", "Bytes leased, per GPU and lease state",
                                   labels=["gpu", "state"])
        count = {s: 0 for s in LeaseState}
        by_gpu: dict[tuple[int, LeaseState], int] = {}
        for rec in list(self.book.records.values()):
            info = rec.info
            count[info.state] += 1
            by_gpu[(info.gpu, info.state)] = by_gpu.get((info.gpu, info.state), 0) + info.size
        for state, n in count.items():
            leases.add_metric([str(state)], n)
        for (gpu, state), size in sorted(by_gpu.items()):
            leased.add_metric([str(gpu), str(state)], size)
        yield leases
        yield leased
        cap = GaugeMetricFamily("holdfast_gpu_manager_capacity_bytes", "Bytes this manager may lease, per GPU",
                                labels=["gpu"])
        board = self.book.board
        for entry in (board.gpus if board is not None else []):
            if entry.total_bytes is not None:
                cap.add_metric([str(entry.index)], entry.total_bytes)
        yield cap
        open_fds, limit = self.fd_usage()
        yield _gauge("holdfast_gpu_manager_open_fds", "File descriptors open in the gpu_manager", open_fds)
        yield _gauge("holdfast_gpu_manager_fd_limit", "Soft RLIMIT_NOFILE of the gpu_manager", limit)
        yield _gauge("holdfast_gpu_manager_connections", "Engine connections open",
                     sum(list(self.conns.by_uid.values())))
        yield _gauge("holdfast_gpu_manager_accept_failing",
                     "1 while accepting engine connections fails (EMFILE...), 0 otherwise",
                     0 if self.server.accept_trouble is None else 1)
        yield _counter("holdfast_gpu_manager_refused_connections",
                       "Engine connections refused by the per-uid limit", self.conns.refused)
        yield _counter("holdfast_gpu_manager_rejected_frames",
                       "Malformed frames answered with an error (the connection then closed)", self.book.rejected)


def gpu_manager_registry(book: LeaseBook, conns: ConnectionCount, server: FrameServer,
                         fd_usage: Callable[[], tuple[int, int]]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(BookCollector(book, conns, server, fd_usage))
    return registry
