"""The lease database is its uid's alone (db.py's note, session.py rule 9): the SQLite file and its -wal and -shm are
0600 whatever umask the manager runs under, and one an older manager left readable is made so when it opens. Before:
they were created with the process umask (0644 under the usual 022), and where the state directory could be
traversed (a hostPath made 0755) any uid read every owner's engine id and the frozen gangs' transfer tokens."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from tests.gpu_manager.harness import ManagerProc


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def db_modes(manager: ManagerProc) -> dict[str, int]:
    """Every SQLite file of the lease table: name -> its permission bits."""
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in Path(manager.state_dir).glob("gpu_manager.db*")}


def test_the_lease_database_and_its_sidecars_are_owner_only_whatever_the_umask(manager_factory, engines) -> None:  # noqa: ANN001
    manager = manager_factory()
    with umask(0):  # the widest: what the process asks for is all a new file gets
        manager.start()
    assert "lease" in engines(manager, "eng-a").ask("write 4096 1 weights")  # rows in the WAL
    modes = db_modes(manager)
    assert {"gpu_manager.db", "gpu_manager.db-wal", "gpu_manager.db-shm"} <= set(modes), modes
    assert set(modes.values()) == {0o600}, modes
    opened = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in Path(manager.state_dir).rglob("*")
              if stat.S_IMODE(p.stat().st_mode) & 0o077}
    assert opened == {}, opened  # nothing the manager or its keeper wrote (pid, lock and log files too)

    manager.stop()
    for name in db_modes(manager):  # as an older manager left them
        os.chmod(manager.state_dir / name, 0o644)
    with umask(0o022):
        manager.start()
    assert "lease" in engines(manager, "eng-b").ask("write 4096 2 weights")
    modes = db_modes(manager)
    assert "gpu_manager.db-wal" in modes and set(modes.values()) == {0o600}, modes
