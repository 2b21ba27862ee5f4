"""The lease table on SQLite, written on the event loop's thread (db.py's note): real SQLite files, a real second
connection holding the write lock as an operator's shell would.

What must hold: a write runs on the loop's own thread and is durable when it returns (a fresh connection reads it);
the WAL does not grow without bound although no commit checkpoints it (LeaseDb.checkpoint every CHECKPOINT_EVERY
writes, on the worker thread); a write that meets another process's write lock is refused as `TableUnwritable`
within about BUSY_WAIT_S, changing nothing, instead of stalling the loop (and every engine's session) for longer; a
Postgres-like URL (anything but SQLite) keeps every call on the worker thread."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from libs.common.events import LeaseInfo, LeaseState, Tag
from services.gpu_manager import db as dbmod
from services.gpu_manager.db import LeaseDb, TableUnwritable
from services.gpu_manager.records import LeaseRecord

NODE = "node-t"


def _rec(i: int, epoch: int = 1) -> LeaseRecord:
    info = LeaseInfo(id=f"lease-{i}", node=NODE, gpu=0, size=1 << 20, chunk_size=1 << 20, tag=Tag.WEIGHTS,
                     owner="eng-a", epoch=epoch, state=LeaseState.ACTIVE, created_at=0, last_seen=0)
    return LeaseRecord(info=info, owner_uid=0, owner_pid=100 + i)


@pytest.fixture
def table(tmp_path: Path) -> LeaseDb:
    db = LeaseDb(f"sqlite:///{tmp_path / 'gpu_manager.db'}")
    db.create_schema()
    yield db
    db.close()


def _epoch_in_file(path: Path, lease_id: str) -> int:
    with sqlite3.connect(path) as conn:
        (epoch,) = conn.execute("SELECT epoch FROM leases WHERE id = ?", (lease_id,)).fetchone()
    return int(epoch)


async def test_a_write_runs_on_the_loops_thread_and_is_there_when_it_returns(table: LeaseDb, tmp_path: Path) -> None:
    ran_on: list[int] = []

    def save(records: list[LeaseRecord]) -> None:
        ran_on.append(threading.get_ident())
        table.save(records, NODE)

    await table.run(save, [_rec(0, epoch=7)])
    assert ran_on == [threading.get_ident()]
    assert _epoch_in_file(tmp_path / "gpu_manager.db", "lease-0") == 7


async def test_the_wal_is_checkpointed_off_the_loop_and_stays_bounded(table: LeaseDb, tmp_path: Path) -> None:
    wal = tmp_path / "gpu_manager.db-wal"
    recs = [_rec(i) for i in range(4)]
    checkpointed_on: list[int] = []
    real = table.checkpoint

    def checkpoint() -> None:
        checkpointed_on.append(threading.get_ident())
        real()

    table.checkpoint = checkpoint  # type: ignore[method-assign]
    sizes = []
    for n in range(1, 6 * dbmod.CHECKPOINT_EVERY + 1):
        for r in recs:
            r.info = r.info.model_copy(update={"epoch": n})
        await table.run(table.save, recs, NODE)
        if n % dbmod.CHECKPOINT_EVERY == 0:
            await asyncio.sleep(0.05)  # the checkpoint's worker runs meanwhile
            sizes.append(wal.stat().st_size)
    with table.engine.connect() as conn:  # no commit checkpoints (and fsyncs) on the loop's thread
        assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 0
    assert len(checkpointed_on) >= 5 and threading.get_ident() not in checkpointed_on
    # without checkpoints the WAL would hold every write's pages: ~6x the first interval's size by now
    assert max(sizes) <= 2 * sizes[0], sizes
    assert _epoch_in_file(tmp_path / "gpu_manager.db", "lease-3") == 6 * dbmod.CHECKPOINT_EVERY


async def test_a_write_behind_another_process_lock_is_refused_soon(table: LeaseDb, tmp_path: Path) -> None:
    await table.run(table.save, [_rec(0, epoch=1)], NODE)
    shell = sqlite3.connect(tmp_path / "gpu_manager.db", isolation_level=None)
    shell.execute("BEGIN IMMEDIATE")  # an operator's shell holding the write lock
    try:
        t0 = time.monotonic()
        with pytest.raises(TableUnwritable, match="locked"):
            await table.run(table.save, [_rec(0, epoch=2)], NODE)
        assert time.monotonic() - t0 < dbmod.BUSY_WAIT_S + 2.0
    finally:
        shell.execute("ROLLBACK")
        shell.close()
    assert _epoch_in_file(tmp_path / "gpu_manager.db", "lease-0") == 1  # nothing changed
    await table.run(table.save, [_rec(0, epoch=2)], NODE)  # and the same write works once the lock is gone
    assert _epoch_in_file(tmp_path / "gpu_manager.db", "lease-0") == 2


async def test_another_database_keeps_its_calls_on_the_worker_thread(tmp_path: Path) -> None:
    db = LeaseDb(f"sqlite:///{tmp_path / 'other.db'}")
    db.inline = False  # as for a Postgres URL (the one attribute the URL decides)
    try:
        assert await db.run(threading.get_ident) != threading.get_ident()
    finally:
        db.close()
