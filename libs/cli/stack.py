"""The local stack without Docker: nats-server, etcd and every service as child processes on loopback.

Used by `holdfast up`, `holdfast demo`, the benchmarks and the end-to-end tests, so all of them run the
same processes the same way. Each child runs in its own session (a SIGKILL of one takes no other with
it), logs to `<base_dir>/logs/<name>.log`, and `stop()` ends them in reverse order, SIGKILL after a
deadline, so nothing is left behind.

`supervise_once()` (called in a loop by `holdfast up`) restarts a child that died, as compose's
`restart: unless-stopped` does: infra (nats, etcd) included, each restart logged, after a delay that doubles
with each death in a row (0.5 s up to 30 s; `ChildRestarts`) and starts over once the child has run for
`STABLE_S`. Stopping the stack is never undone by it (it is not called once stop begins).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import (
    DEFAULT_API_PORT,
    DEFAULT_ETCD_PORT,
    DEFAULT_NATS_PORT,
    DEFAULT_ROUTER_PORT,
    CommonSettings,
)
from libs.common.security.infra import SecureInfra
from libs.common.service import Backoff, check_health

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

    @classmethod
    def ephemeral(cls, **kw: object) -> StackConfig:
        """Free ports everywhere: for tests and demos that must not collide with a running stack."""
        ports = {k: procs.free_port() for k in ("nats_port", "etcd_port", "etcd_peer_port", "api_port", "router_port")}
        return cls(**{**ports, **kw})  # type: ignore[arg-type]


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
        return f"nats://127.0.0.1:{self.config.nats_port}"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.config.api_port}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.config.router_port}"

    def env(self) -> dict[str, str]:
        c = self.config
        env = {
            "HF_NATS_URL": self.nats_url,
            "HF_ETCD_ENDPOINTS": f"127.0.0.1:{c.etcd_port}",
            "HF_NODE": c.node,
            "HF_STATE_DIR": str(self.base_dir / "state"),
            "HF_BACKEND": c.backend,
            "HF_API_PORT": str(c.api_port),
            "HF_ADMIN_TOKEN": c.api_token,
            "HF_ROUTER_PORT": str(c.router_port),
            **self.infra.env(),
            "PYTHONUNBUFFERED": "1",
        }
        if c.engines_file is not None:
            env["HF_ENGINES_FILE"] = str(c.engines_file)
        return {**env, **c.extra_env}

    @property
    def credentials_dir(self) -> Path:
        return self.base_dir / "state" / "credentials"

    def settings(self) -> CommonSettings:
        env = self.env()
        return CommonSettings(nats_url=env["HF_NATS_URL"], etcd_endpoints=env["HF_ETCD_ENDPOINTS"],
                              node=self.config.node, state_dir=Path(env["HF_STATE_DIR"]),
                              credentials_dir=self.credentials_dir, insecure=not self.config.secure)

    @property
    def infra(self) -> SecureInfra:
        return SecureInfra(self.credentials_dir, [self.config.node, *self.config.other_nodes], self.config.secure)

    # ------------------------------------------------------------ lifecycle

    def start_infra(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.base_dir / "state").mkdir(parents=True, exist_ok=True, mode=0o700)
        c = self.config
        infra, settings = self.infra, self.settings()
        nats_conf = infra.nats_config(self.base_dir / "nats.conf", settings)
        nats = procs.nats_server(c.nats_port, self.base_dir / "nats", self.logs / "nats.log", config=nats_conf).start()
        self.children["nats"] = nats
        etcd = procs.etcd_server(c.etcd_port, c.etcd_peer_port, self.base_dir / "etcd", self.logs / "etcd.log",
                                 tls_flags=infra.etcd_flags()).start()
        self.children["etcd"] = etcd
        procs.wait_port(c.nats_port, nats)
        procs.wait_port(c.etcd_port, etcd)
        infra.etcd_ready(c.etcd_port, settings)  # users, roles, key ranges (a restarted stack finds them in place)

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
        for name in self.config.services:
            self.start_service(name)
        asyncio.run(self.wait_healthy(self.config.services, timeout))

    async def wait_healthy(self, services: tuple[str, ...] | list[str], timeout: float = 60.0) -> dict[str, dict]:
        """Ask each service's health subject until all answer ok; raise naming the ones that do not."""
        bus = await Bus.connect(self.settings(), "holdfast-up", stream=False)
        deadline = time.monotonic() + timeout
        health: dict[str, dict] = {}
        try:
            pending = list(services)
            while pending:
                for name in list(pending):
                    child = self.children.get(name)
                    if child is not None and not child.alive():
                        raise RuntimeError(f"{name} exited with {child.returncode}; log: {child.log_path}\n"
                                           + self.tail(name))
                    try:
                        reply = await check_health(bus, name, timeout=0.5)
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
        port = {"nats": self.config.nats_port, "etcd": self.config.etcd_port}.get(name)
        if port is not None:
            procs.wait_port(port, child)
        return child

    def supervise_once(self, say: Callable[[str], None], now: float | None = None) -> None:
        """One supervision pass: note each child found dead, and restart each whose delay is over."""
        now = time.monotonic() if now is None else now
        for name, child in list(self.children.items()):
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
