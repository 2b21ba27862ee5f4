"""The gpu_manager with its state dir's disk full (ENOSPC), as an operator's node hits it: a real manager with its
state dir on a small tmpfs, real engines on the SDK, a filler file taking the last block.

What must hold (manager.py invariant 8): a request that needs a write of the lease table gets the typed
`unavailable` reply and changes nothing; everyone else is served as before (heartbeats, mappings, listings); an
engine that dies meanwhile does not stop the manager (its reconciler retries); once space is back the same requests
work without a restart, and every lease of before holds the same bytes. A restart over a full disk comes up with
every lease of before.

Mounting needs root (CAP_SYS_ADMIN): elsewhere these tests skip, saying why."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from libs.common.bus import Bus
from libs.common.errors import RemoteError
from libs.common.events import (
    Freeze,
    FreezeReply,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    SnapshotLease,
    SnapshotReply,
)
from tests.gpu_manager.harness import Engine, ManagerProc, until, wait_for

DISK_KIB = 1024  # the manager's table, WAL and sockets take ~170 KiB of it; the filler takes the rest
NODE = "node-1"


class StateDisk:
    """A tmpfs of DISK_KIB mounted on the manager's state dir, and a file that fills it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler"

    def fill(self) -> None:
        """Write the filler until the disk refuses a block (ENOSPC): from now on nothing more fits."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink()


@pytest.fixture
def state_disk(settings_env: dict[str, str]) -> Iterator[StateDisk]:
    """Requested before `manager_factory`, so the managers (and their keepers) stop before it is unmounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = Path(settings_env["HF_STATE_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    # mode 0700: a tmpfs is mounted 1777 by default, and a state directory others may write in is refused
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_KIB}k,mode=0700", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (EPERM in a container?): {got.stderr.strip()}")
    try:
        yield StateDisk(path)
    finally:
        keeper = path / "gpu_keeper.sock.pid"  # stopped (SIGTERM) by manager_factory; it holds files here till it exits
        if keeper.exists():
            pid = int(keeper.read_text())
            wait_for(lambda: not Path(f"/proc/{pid}").exists())
        subprocess.run(["umount", str(path)], check=True)


async def leases(bus: Bus) -> dict[str, tuple[str, LeaseState, int, bool]]:
    """lease id -> (owner, state, epoch, committed), as the manager lists them."""
    got = await bus.request(NODE, ListLeases(), ListLeasesReply)
    return {i.id: (i.owner, i.state, i.epoch, i.layout_hash is not None) for i in got.leases}


def table(disk: StateDisk) -> tuple[list[tuple[str, str, int]], str]:
    """The live rows of the SQLite table as a second reader sees them, and its integrity check."""
    db = sqlite3.connect(f"file:{disk.path / 'gpu_manager.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT id, state, epoch FROM leases WHERE state != 'RECLAIMED' ORDER BY id").fetchall()
        return rows, db.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        db.close()


@dataclass
class Node:
    """A manager, engine A with a committed 64 KiB lease (`wrote`), and an engine with one more (`doomed`) to kill."""

    manager: ManagerProc
    a: Engine
    wrote: dict
    dying: Engine
    doomed: str
    before: dict


async def node_with_two_engines(manager_factory, engines, bus: Bus) -> Node:  # noqa: ANN001
    m = manager_factory(HF_GRACE_S="300").start()  # a grace far past the test: no reclaim by deadline
    a, dying = engines(m, "eng-a"), engines(m, "eng-dying")
    wrote = a.ask("write 65536 1")
    doomed = dying.ask("write 8192 2")["lease"]
    return Node(m, a, wrote, dying, doomed, await leases(bus))


def outlives_its_reconciler(m: ManagerProc) -> None:
    """Once the reconciler met the unwritable table (its warning), or the manager stopped on it: it must live."""
    wait_for(lambda: not m.child.alive() or "reconciler:" in m.log())  # type: ignore[union-attr]
    assert m.child.alive(), m.log()  # type: ignore[union-attr]


async def orphaned(bus: Bus, lease_id: str) -> None:
    """Until the reconciler's pass orphaned the dead engine's lease, as it would have with room on the disk."""

    async def seen() -> bool:
        return (await leases(bus))[lease_id][1] == LeaseState.ORPHANED

    await until(seen)


async def test_a_full_disk_refuses_writes_typed_keeps_serving_and_recovers_once_freed(
        state_disk: StateDisk, manager_factory, engines, bus: Bus) -> None:  # noqa: ANN001
    node = await node_with_two_engines(manager_factory, engines, bus)
    m, a, wrote, before = node.manager, node.a, node.wrote, node.before

    state_disk.fill()
    b: Engine = engines(m, "eng-b")
    refused = b.ask("write 65536 3")
    assert refused["code"] == "unavailable", refused
    assert "lease table cannot be written" in refused["message"] and "full" in refused["message"], refused
    release = a.ask(f'call release {{"lease_id": "{wrote["lease"]}", "epoch": {wrote["epoch"]}}}')
    assert release["code"] == "unavailable", release
    extra = {"epochs": {wrote["lease"]: wrote["epoch"]},
             "tensors": [{"name": "extra", "lease_id": wrote["lease"], "offset": 0, "shape": [16], "dtype": "uint8"}]}
    registered = a.ask(f"call register {json.dumps(extra)}")  # would leave the lease uncommitted, were it written
    assert registered["code"] == "unavailable", registered
    with pytest.raises(RemoteError) as frozen:
        await bus.request(NODE, Freeze(owner="eng-a"), FreezeReply)
    assert frozen.value.remote_code == "unavailable", frozen.value
    # everyone else is served, and nothing changed
    assert a.ask("call heartbeat {}") == {"code": "ok"}
    assert a.ask("hash")["data"] == wrote["expected"]
    assert b.ask("status")["connected"]  # answered on its connection, not cut off
    assert await leases(bus) == before
    # an engine dies: its leases cannot be orphaned in the table now; the manager goes on (the reconciler retries)
    node.dying.kill()
    outlives_its_reconciler(m)
    assert await leases(bus) == before

    state_disk.free()
    again = b.ask("write 65536 3")
    assert again["data"] == again["expected"], again
    assert a.ask("hash")["data"] == wrote["expected"]
    assert a.ask(f'call release {{"lease_id": "{wrote["lease"]}", "epoch": {wrote["epoch"]}}}') == {"code": "ok"}
    await orphaned(bus, node.doomed)
    now = await leases(bus)
    assert wrote["lease"] not in now
    rows, check = table(state_disk)
    assert check == "ok"
    assert rows == sorted((i, s.value, e) for i, (_, s, e, _) in now.items())


async def test_a_restart_over_a_full_disk_keeps_every_lease(
        state_disk: StateDisk, manager_factory, engines, bus: Bus) -> None:  # noqa: ANN001
    node = await node_with_two_engines(manager_factory, engines, bus)
    m, a, wrote = node.manager, node.a, node.wrote

    state_disk.fill()
    m.kill()  # a crash or an upgrade; the fd keeper (its own session) holds the memory on
    node.dying.kill()  # and an engine dies meanwhile: the restarted manager's reconciler cannot write its orphaning
    m.start()
    outlives_its_reconciler(m)
    assert await leases(bus) == node.before
    assert a.ask("reconnect") == {"ok": True}
    assert a.ask("hash")["data"] == wrote["expected"]
    assert engines(m, "eng-b").ask("write 8192 2")["code"] == "unavailable"

    state_disk.free()
    assert a.ask("hash")["data"] == wrote["expected"]
    assert engines(m, "eng-c").ask("write 8192 3")["epoch"] == 1
    await orphaned(bus, node.doomed)
    rows, check = table(state_disk)
    assert check == "ok" and {wrote["lease"], node.doomed} <= {i for i, _, _ in rows}


async def test_a_snapshot_on_a_full_disk_is_unavailable_and_leaves_no_partial_artifact(
        state_disk: StateDisk, manager_factory, engines, bus: Bus) -> None:  # noqa: ANN001
    m = manager_factory().start()
    wrote = engines(m, "eng-a").ask("write 262144 1")
    artifacts = state_disk.path / "artifacts"

    state_disk.fill()
    with pytest.raises(RemoteError) as full:
        await bus.request(NODE, SnapshotLease(lease_id=wrote["lease"], artifact="w"), SnapshotReply)
    assert full.value.remote_code == "unavailable" and "no room for artifact w" in full.value.message, full.value
    assert not artifacts.exists() or list(artifacts.iterdir()) == []  # the partial files went with the refusal

    state_disk.free()
    done = await bus.request(NODE, SnapshotLease(lease_id=wrote["lease"], artifact="w"), SnapshotReply)
    assert done.bytes == 262144 and [p.name for p in artifacts.iterdir()] == ["w"]
