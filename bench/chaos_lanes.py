"""Which faults of a chaos run may be in flight at once (pure logic: no I/O; bench/chaos_run.py acquires).

A fault holds *resources* from its injection until what it hit serves again (chaos_run.Chaos.settle_after):
- `model:<m>`: the engines of model m (an engine fault waits for its target, and the model's recovery, alone);
- `gpu`: the GPU (one XID at a time: the GPU is reset after each). An XID takes down every engine of the GPU,
  yet holds no model: an engine fault on a model it hit waits for that model's next ready engine and lands
  during the recovery, as a second failure during a cold start would;
- `svc:<name>`: one service (a second kill of it lands on a service that runs again, never on one still
  being restarted by chaos, and an etcd stall is never undone by an etcd restart's new process);
- `api`: the admin API's large-body load (one at a time: 3 loops of 8 MiB bodies).
Faults with disjoint resources overlap: a NATS restart while one model fails over and another's gpu_manager is
under fd pressure, as a real outage would.

Invariants (tests/e2e/test_chaos_lanes.py):
1. two faults in flight never share a resource;
2. requests are granted in order among those that conflict: a fault waiting for a model or service is not
   overtaken by a later one that wants the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SERVICE_OF = {
    "gpu_manager_sigkill": "gpu_manager", "agent_sigkill": "agent", "dc_manager_sigkill": "dc_manager",
    "router_sigkill": "router", "controller_leader_sigkill": "controller", "nats_restart": "nats",
    "etcd_restart": "etcd", "etcd_stall": "etcd",
}
ENGINE_FAULTS = ("engine_sigkill", "engine_sigstop", "engine_cuda_error")


def resources(fault: str, model: str, models: list[str], *, via_xid: bool = False) -> frozenset[str]:
    """What `fault` holds while in flight; `model` is the one an engine fault targets, `via_xid` says an
    allocation catch is triggered by an XID (every model restarts) rather than by killing `model`'s standby."""
    if fault == "gpu_xid":
        return frozenset({"gpu", "svc:agent"})  # the XID is read by the agent's NVML watcher
    if fault == "engine_sigkill_allocating" and via_xid:
        return frozenset({"gpu", "svc:agent", f"model:{model}"})  # the catch is of `model`'s first new engine
    if fault in ENGINE_FAULTS or fault == "engine_sigkill_allocating":
        return frozenset({f"model:{model}"})
    if fault == "gpu_manager_fd_pressure":
        return frozenset({"svc:gpu_manager", f"model:{model}"})  # an engine of `model` is killed under it
    if fault == "admin_api_load":
        return frozenset({"api", f"model:{model}"})
    if fault in SERVICE_OF:
        return frozenset({f"svc:{SERVICE_OF[fault]}"})
    raise ValueError(f"unknown fault kind {fault!r}")


@dataclass
class Claims:
    """Resources held by faults in flight, and the requests waiting, first come first served among conflicts."""

    held: dict[int, frozenset[str]] = field(default_factory=dict)
    waiting: list[tuple[int, frozenset[str]]] = field(default_factory=list)
    _next: int = 0

    def request(self, want: frozenset[str]) -> int:
        self._next += 1
        self.waiting.append((self._next, want))
        return self._next

    def grant(self) -> list[int]:
        """The waiting requests that may go now (moved to `held`): each is free of what is held and of what any
        earlier waiting request wants."""
        busy = set().union(*self.held.values()) if self.held else set()
        granted, still = [], []
        for ticket, want in self.waiting:
            if want & busy:
                still.append((ticket, want))
            else:
                granted.append(ticket)
                self.held[ticket] = want
            busy |= want  # an earlier request's wants are reserved for it, granted or not
        self.waiting = still
        return granted

    def release(self, ticket: int) -> None:
        self.held.pop(ticket, None)
