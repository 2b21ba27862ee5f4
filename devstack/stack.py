"""The local stack without Docker: nats-server, etcd and every service as child processes on loopback.

Used by `holdfast up`, `holdfast demo`, the benchmarks and the end-to-end tests, so all of them run the
same processes the same way. Each child runs in its own session (a SIGKILL of one takes no other with
it), logs to `<base_dir>/logs/<name>.log`, and `stop()` ends them in reverse order, SIGKILL after a
deadline, so nothing is left behind.

`supervise_once()` (called in a loop by `holdfast up`) restarts a child that died, as compose's
`restart: unless-stopped` does: infra (nats, etcd) included, each restart logged, after a delay that doubles
with each death in a row (0.5 s up to 30 s; `ChildRestarts`) and starts over once the child has run for
`STABLE_S`. Stopping the stack is never undone by it (it is not called once stop begins).

With `ha` (`holdfast up --ha`): a 3-member etcd cluster and a 3-server NATS cluster (JetStream, the stream in 3
copies; devstack/clusters.py), 3 nodes (a gpu_manager and an agent each, with the node's own name and state
dir `<base>/state/<node>`; the engines file is the first node's), 2 controllers (the second's API on
`api_port_2`), 2 dc_managers (one deliver group) and the router; every child is told every member.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from devstack import clusters
from libs.common import procs
from libs.common.backoff import Backoff
from libs.common.bus import Bus
from libs.common.config import (
    DEFAULT_API_PORT,
    DEFAULT_ETCD_PORT,
    DEFAULT_NATS_PORT,
    DEFAULT_ROUTER_PORT,
    CommonSettings,
)
from libs.common.security.infra import SecureInfra
from libs.common.service import check_health

STABLE_S = 60.0  # a child that ran this long before dying is restarted after the shortest delay again


@dataclass
class ChildRestarts:
    """One child's restart bookkeeping (pure: the caller passes the clock)."""

    backoff: Backoff = field(default_factory=lambda: Backoff(first_s=0.5, max_s=30.0))
    started_at: float = 0.0
    due_at: float | None = None  # when the dead child is to be started again; None while it runs
    count: int = 0

    def died(self, now: float) -> float:
        """The child was found dead: the delay before its restart."""
        if now - self.started_at >= STABLE_S:
            self.backoff.reset()
        delay = self.backoff.next_delay()
        self.due_at = now + delay
        return delay

    def restarted(self, now: float) -> None:
        self.due_at = None
        self.started_at = now
        self.count += 1


# Start order: memory first (engines need it), then the agent, then the cluster side, then the router.
SERVICES = ("gpu_manager", "agent", "dc_manager", "controller", "router")
HA_NODES = ("node-1", "node-2", "node-3")
HA_COPIES = {"controller": 2, "dc_manager": 2}  # the cluster side's instances with --ha (a node's: one each)


@dataclass(frozen=True)
class Instance:
    """One service process of the stack: its child name (log file, `children` key) and health instance."""

    name: str
    service: str
    instance: str | None  # None: ask the service's bare health subject (instances that share a name)
    env: tuple[tuple[str, str], ...] = ()


def ha_instances(nodes: tuple[str, ...], api_port_2: int, state: Path) -> list[Instance]:
    """Every service process of an HA stack, in start order (pure)."""
    out = [Instance(f"{svc}-{n}", svc, n, (("HF_NODE", n), ("HF_STATE_DIR", str(state / n))))
           for svc in ("gpu_manager", "agent") for n in nodes]
    out += [Instance(f"dc_manager-{i + 1}", "dc_manager", None) for i in range(HA_COPIES["dc_manager"])]
    for i in range(HA_COPIES["controller"]):
        env = (("HF_INSTANCE", f"controller-{i + 1}"),) + ((("HF_API_PORT", str(api_port_2)),) if i else ())
        out.append(Instance(f"controller-{i + 1}", "controller", f"controller-{i + 1}", env))
    return [*out, Instance("router", "router", None)]


@dataclass
class StackConfig:
    base_dir: Path | None = None  # None: a fresh temporary directory, removed on stop
    nats_port: int = DEFAULT_NATS_PORT
    etcd_port: int = DEFAULT_ETCD_PORT
    etcd_peer_port: int = DEFAULT_ETCD_PORT + 1
    api_port: int = DEFAULT_API_PORT
    router_port: int = DEFAULT_ROUTER_PORT
    node: str = "node-1"
    backend: str = "auto"
    services: tuple[str, ...] = SERVICES
    engines_file: Path | None = None
    api_token: str = "holdfast-dev-admin"
    extra_env: dict[str, str] = field(default_factory=dict)
    # Auth and TLS on NATS and etcd (libs/common/security), credentials minted once into <state>/credentials.
    # False only to measure what they cost (bench pairs) or to debug with plain clients.
    secure: bool = True
    other_nodes: tuple[str, ...] = ()  # nodes besides `node` whose agent/gpu_manager get credentials
    ha: bool = False  # clustered etcd and NATS, 3 nodes, 2 controllers and dc_managers (module docstring)
    api_port_2: int = DEFAULT_API_PORT + 1  # the second controller's API (ha)
    etcd_members: tuple[clusters.Member, ...] = ()  # ha; empty: etcd_port + 2i (client), + 2i + 1 (peer)
    nats_members: tuple[clusters.Member, ...] = ()  # ha; empty: nats_port + i (client), + 100 + i (routes)

    @classmethod
    def ephemeral(cls, **kw: object) -> StackConfig:
        """Free ports everywhere: for tests and demos that must not collide with a running stack."""
        ports: dict[str, object] = {k: procs.free_port() for k in (
            "nats_port", "etcd_port", "etcd_peer_port", "api_port", "router_port", "api_port_2")}
        if kw.get("ha"):
            ports |= {"etcd_members": clusters.members("etcd"), "nats_members": clusters.members("nats")}
        return cls(**{**ports, **kw})  # type: ignore[arg-type]

    def members(self, kind: str) -> tuple[clusters.Member, ...]:
        """The cluster members of `kind` ('etcd', 'nats') of an HA stack; empty without ha."""
        if not self.ha:
            return ()
        if kind == "etcd":
            return self.etcd_members or tuple(clusters.Member(f"etcd-{i}", self.etcd_port + 2 * i,
                                                              self.etcd_port + 2 * i + 1) for i in range(3))
        return self.nats_members or tuple(clusters.Member(f"nats-{i}", self.nats_port + i, self.nats_port + 100 + i)
                                          for i in range(3))


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self._own_dir = config.base_dir is None
        self.base_dir = config.base_dir or Path(tempfile.mkdtemp(prefix="holdfast-stack-"))
        self.logs = self.base_dir / "logs"
        self.children: dict[str, procs.Child] = {}
        self.restarts: dict[str, ChildRestarts] = {}

    # ------------------------------------------------------------ settings every child shares

    @property
    def nats_url(self) -> str:
        ms = self.config.members("nats")
        return clusters.client_urls("nats", ms) if ms else f"nats://127.0.0.1:{self.config.nats_port}"

    @property
    def etcd_endpoints(self) -> str:
        ms = self.config.members("etcd")
        return clusters.client_urls("etcd", ms) if ms else f"127.0.0.1:{self.config.etcd_port}"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.config.api_port}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.config.router_port}"

    def router_key(self) -> str:
        """The router's API key: the one it made into the state dir, if it asks for one (on loopback it asks for
        none unless configured: services/router/README.md)."""
        path = self.base_dir / "state" / "router-api-key"
        return path.read_text().strip() if path.exists() else ""

    def router_headers(self) -> dict[str, str]:
        key = self.router_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def env(self) -> dict[str, str]:
        c = self.config
        env = {
            "HF_NATS_URL": self.nats_url,
            "HF_ETCD_ENDPOINTS": self.etcd_endpoints,
            "HF_STREAM_REPLICAS": "3" if c.ha else "1",
            "HF_NODE": c.node,
            "HF_STATE_DIR": str(self.base_dir / "state"),
            "HF_BACKEND": c.backend,
            "HF_API_PORT": str(c.api_port),
            "HF_ADMIN_TOKEN": c.api_token,
            "HF_ROUTER_PORT": str(c.router_port),
            **self.infra.env(),
            "PYTHONUNBUFFERED": "1",
        }
        if c.engines_file is not None and not c.ha:
            env["HF_ENGINES_FILE"] = str(c.engines_file)
        return {**env, **c.extra_env}

    @property
    def credentials_dir(self) -> Path:
        return self.base_dir / "state" / "credentials"

    def settings(self) -> CommonSettings:
        env = self.env()
        return CommonSettings(nats_url=env["HF_NATS_URL"], etcd_endpoints=env["HF_ETCD_ENDPOINTS"],
                              stream_replicas=int(env["HF_STREAM_REPLICAS"]), node=self.config.node, state_dir=Path(env["HF_STATE_DIR"]),
                              credentials_dir=self.credentials_dir, insecure=not self.config.secure)

    @property
    def infra(self) -> SecureInfra:
        nodes = [self.config.node, *self.config.other_nodes, *(HA_NODES if self.config.ha else ())]
        return SecureInfra(self.credentials_dir, list(dict.fromkeys(nodes)), self.config.secure)

    def instances(self) -> list[Instance]:
        """The service processes this stack runs, in start order."""
        if self.config.ha:
            return ha_instances(HA_NODES, self.config.api_port_2, self.base_dir / "state")
        return [Instance(s, s, None) for s in self.config.services]

    def _ports(self) -> dict[str, int]:
        """Each infra child's client port (restart waits for it)."""
        c = self.config
        ports = {"nats": c.nats_port, "etcd": c.etcd_port}
        return ports | {m.name: m.port for kind in ("etcd", "nats") for m in c.members(kind)}

    # ------------------------------------------------------------ lifecycle

    def start_infra(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.base_dir / "state").mkdir(parents=True, exist_ok=True, mode=0o700)
        c = self.config
        infra, settings = self.infra, self.settings()
        nats_conf = infra.nats_config(self.base_dir / "nats.conf", settings)
        if c.ha:
            self._start_clusters(nats_conf)
            return
        nats = procs.nats_server(c.nats_port, self.base_dir / "nats", self.logs / "nats.log", config=nats_conf).start()
        self.children["nats"] = nats
        etcd = procs.etcd_server(c.etcd_port, c.etcd_peer_port, self.base_dir / "etcd", self.logs / "etcd.log",
                                 tls_flags=infra.etcd_flags()).start()
        self.children["etcd"] = etcd
        procs.wait_port(c.nats_port, nats)
        procs.wait_port(c.etcd_port, etcd)
        infra.etcd_ready(c.etcd_port, settings)  # users, roles, key ranges (a restarted stack finds them in place)
        # the event stream, as a deployment's control plane makes it (a node's services only look for it:
        # libs/common/security/policy.py), so that a stack run without a controller (a bench's) has it too
        asyncio.run(self._wait_stream())

    def _start_clusters(self, nats_conf: Path | None) -> None:
        c, infra = self.config, self.infra
        nats_ms, etcd_ms = c.members("nats"), c.members("etcd")
        kids = clusters.nats_children(nats_ms, self.base_dir, self.logs, config=nats_conf)
        kids += clusters.etcd_children(etcd_ms, self.base_dir, self.logs, tls_flags=infra.etcd_flags())
        for k in kids:
            self.children[k.name] = k
        clusters.start(nats_ms + etcd_ms, kids)
        infra.etcd_ready(etcd_ms[0].port, self.settings())
        asyncio.run(self._wait_stream())

    async def _wait_stream(self, timeout: float = 30.0) -> None:
        """The stream created before any service starts (as an operator: only the control plane and operators may).
        A fresh NATS cluster elects its JetStream meta leader seconds after it listens: created (in its 3 copies)
        once it can be, so that no service starts against a cluster that refuses it."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                bus = await Bus.connect(self.settings(), "holdfast-up")
                await bus.close()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)

    def start_service(self, service: str, *args: str, name: str | None = None,
                      env_extra: dict[str, str] | None = None) -> procs.Child:
        """Start `services.<service>`; `name` tells a second instance apart (its log file and key)."""
        name = name or service
        argv = [sys.executable, "-m", f"services.{service}", *args]
        child = procs.Child(name, argv, env={**self.env(), **(env_extra or {})},
                            log_path=self.logs / f"{name}.log").start()
        self.children[name] = child
        return child

    def start(self, timeout: float = 60.0) -> None:
        self.start_infra()
        for inst in self.instances():
            self.start_service(inst.service, name=inst.name, env_extra=self._instance_env(inst))
        asyncio.run(self.wait_healthy([i.name for i in self.instances()], timeout))

    def _instance_env(self, inst: Instance) -> dict[str, str]:
        env = dict(inst.env)
        if self.config.ha and inst.instance == HA_NODES[0] and self.config.engines_file is not None:
            env["HF_ENGINES_FILE"] = str(self.config.engines_file)  # the first node's agent runs the engines
        return env

    async def wait_healthy(self, services: tuple[str, ...] | list[str], timeout: float = 60.0) -> dict[str, dict]:
        """Ask each service's health subject until all answer ok; raise naming the ones that do not."""
        deadline = time.monotonic() + timeout
        bus = await asyncio.wait_for(Bus.connect(self.settings(), "holdfast-up", stream=False), timeout)
        health: dict[str, dict] = {}
        by_name = {i.name: i for i in self.instances()}
        try:
            pending = list(services)
            while pending:
                for name in list(pending):
                    child = self.children.get(name)
                    if child is not None and not child.alive():
                        raise RuntimeError(f"{name} exited with {child.returncode}; log: {child.log_path}\n"
                                           + self.tail(name))
                    inst = by_name.get(name, Instance(name, name, None))
                    try:
                        reply = await check_health(bus, inst.service, inst.instance, timeout=0.5)
                    except Exception:  # noqa: BLE001 - not up yet
                        continue
                    if reply.ok:
                        health[name] = reply.detail
                        pending.remove(name)
                if pending and time.monotonic() > deadline:
                    raise TimeoutError(f"not healthy after {timeout}s: {', '.join(pending)}")
                if pending:
                    await asyncio.sleep(0.1)
        finally:
            await bus.close()
        return health

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.children[name].kill(sig)

    def restart(self, name: str) -> procs.Child:
        """Stop `name` (if still running) and start it again with the same command line and data (in its
        place in the start order, so `stop()` still ends the services before the infra)."""
        old = self.children[name]
        old.stop()
        child = procs.Child(name, old.argv, env=old.env, log_path=old.log_path).start()
        self.children[name] = child
        port = self._ports().get(name)
        if port is not None:
            procs.wait_port(port, child)
        return child

    def supervise_once(self, say: Callable[[str], None], now: float | None = None,
                       skip: Collection[str] = ()) -> None:
        """One supervision pass: note each child found dead, and restart each whose delay is over; the children
        in `skip` are left alone this pass (someone else is restarting them: `holdfast chaos`)."""
        now = time.monotonic() if now is None else now
        for name, child in list(self.children.items()):
            if name in skip:
                continue
            r = self.restarts.setdefault(name, ChildRestarts(started_at=now))
            if r.due_at is None:
                if not child.alive():
                    delay = r.died(now)
                    say(f"{name} exited ({child.returncode}); restarting in {delay:.1f} s (see {child.log_path})")
                continue
            if now < r.due_at:
                continue
            try:
                new = self.restart(name)
            except Exception as e:  # noqa: BLE001 - it died again while starting: the next pass backs off more
                say(f"{name} failed to restart: {e}")
                r.restarted(now)
                continue
            r.restarted(now)
            say(f"{name} restarted (pid {new.pid}, restart {r.count})")

    def pids(self) -> dict[str, int]:
        return {name: c.pid for name, c in self.children.items() if c.proc is not None}

    def stop(self) -> None:
        for name in reversed(list(self.children)):
            self.children[name].stop()
        self._stop_strays()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def _stop_strays(self) -> None:
        """Processes the services started detached (the gpu_manager's fd keeper, engines) carry the
        stack's state dir in their environment; end any still running so no orphan outlives the stack."""
        procs.kill_pids_with_env("HF_STATE_DIR", str(self.base_dir / "state"))
        for node in HA_NODES if self.config.ha else ():
            procs.kill_pids_with_env("HF_STATE_DIR", str(self.base_dir / "state" / node))
