"""The lease book in process (real SQLite, real memfd memory, a real fd keeper): the moves of one request are
checked first and committed together, in one transaction, before the caller can hand out fds."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import event

from libs.common.errors import InvalidTransition
from libs.common.events import LeaseState, Tag
from services.gpu_manager.backends import HostBackend
from services.gpu_manager.db import LeaseDb
from services.gpu_manager.fsm import LeaseEvent
from services.gpu_manager.keeper_client import KeeperClient, keeper_pid
from services.gpu_manager.manager import LeaseBook, Move
from services.gpu_manager.mirror import Mirror
from services.gpu_manager.records import LeaseRecord
from services.gpu_manager.settings import GpuManagerSettings


class Counted:
    """Commits and UPDATE statements the lease table's engine really ran."""

    def __init__(self, db: LeaseDb) -> None:
        self.commits = 0
        self.updates: list[str] = []
        event.listen(db.engine, "commit", self._commit)
        event.listen(db.engine, "before_cursor_execute", self._execute)

    def _commit(self, _conn: object) -> None:
        self.commits += 1

    def _execute(self, _conn: object, _cursor: object, statement: str, *_: object) -> None:
        if statement.lstrip().upper().startswith("UPDATE"):
            self.updates.append(statement)

    def reset(self) -> None:
        self.commits = 0
        self.updates.clear()


@pytest.fixture
async def book(tmp_path: Path) -> AsyncIterator[LeaseBook]:
    settings = GpuManagerSettings(node="node-t", state_dir=tmp_path, backend="host", chunk_mib=1)
    db = LeaseDb(settings.database_url())
    keeper = KeeperClient(settings.keeper_path())
    b = LeaseBook(settings, HostBackend(), db, keeper, Mirror(None, None, settings.node))
    await b.load()
    yield b
    await b.close()
    keeper.close()
    db.close()
    pid = keeper_pid(settings.keeper_path())
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


async def _leases(book: LeaseBook, n: int, owner: str = "eng-a") -> list[LeaseRecord]:
    out = []
    for i in range(n):
        out.append(await book.create(owner=owner, engine_class="default", uid=os.getuid(), pid=os.getpid(),
                                     pid_start=None, gpu=0, size=1 << 20, tag=Tag.WEIGHTS, name=f"w{i}",
                                     chunk_size=None))
    return out


def _rows(book: LeaseBook) -> dict[str, LeaseRecord]:
    """The table as a restarted manager would read it (a second engine on the same file)."""
    fresh = LeaseDb(book.settings.database_url())
    try:
        good, bad = fresh.load_live(book.settings.node)
        assert not bad
        return {r.id: r for r in good}
    finally:
        fresh.close()


async def test_a_takeover_of_several_leases_is_one_durable_commit_with_every_new_epoch(book: LeaseBook) -> None:
    recs = await _leases(book, 3)
    await book.apply_all([Move(r, LeaseEvent.FREEZE, "frozen", {"transfer_token": "tok"}) for r in recs])
    counted = Counted(book.db)

    await book.apply_all([Move(r, LeaseEvent.TAKEOVER, "taken over", {"owner": "eng-b", "transfer_token": None})
                          for r in recs])

    assert counted.commits == 1
    rows = _rows(book)
    for rec in recs:
        assert rec.info.state == LeaseState.ACTIVE and rec.info.epoch == 2 and rec.info.owner == "eng-b"
        assert rows[rec.id].info.epoch == 2 and rows[rec.id].info.owner == "eng-b"
        assert rows[rec.id].transfer_token is None


async def test_a_dead_owners_active_lease_is_orphaned_and_reattached_in_one_commit_with_both_events(
        book: LeaseBook) -> None:
    recs = await _leases(book, 2)
    # no mirror task runs here: its queue holds what it would publish
    while not book.mirror.queue.empty():
        book.mirror.queue.get_nowait()
    counted = Counted(book.db)

    moves = []
    for rec in recs:
        moves += [Move(rec, LeaseEvent.OWNER_LOST, "owner_exited"),
                  Move(rec, LeaseEvent.REATTACH, "reattached", {"owner_pid": 1})]
    await book.apply_all(moves)

    assert counted.commits == 1
    changes = [book.mirror.queue.get_nowait() for _ in range(book.mirror.queue.qsize())]
    assert [(c.lease.id, c.from_state, c.lease.state) for c in changes] == [
        (recs[0].id, LeaseState.ACTIVE, LeaseState.ORPHANED), (recs[0].id, LeaseState.ORPHANED, LeaseState.ACTIVE),
        (recs[1].id, LeaseState.ACTIVE, LeaseState.ORPHANED), (recs[1].id, LeaseState.ORPHANED, LeaseState.ACTIVE)]
    assert all(r.info.epoch == 2 and r.owner_pid == 1 and r.info.deadline is None for r in recs)
    assert {r.id: (r.info.epoch, r.owner_pid) for r in _rows(book).values()} == {r.id: (2, 1) for r in recs}


async def test_one_refused_move_leaves_every_lease_and_every_row_as_it_was(book: LeaseBook) -> None:
    recs = await _leases(book, 3)
    await book.apply_all([Move(r, LeaseEvent.FREEZE, "frozen", {"transfer_token": "tok"}) for r in recs[:2]])
    before = {r.id: (r.info, r.transfer_token) for r in recs}
    counted = Counted(book.db)

    with pytest.raises(InvalidTransition):  # the third lease is ACTIVE: it cannot be taken over
        await book.apply_all([Move(r, LeaseEvent.TAKEOVER, "taken over", {"owner": "eng-b", "transfer_token": None})
                              for r in recs])

    assert counted.commits == 0
    assert {r.id: (r.info, r.transfer_token) for r in recs} == before
    rows = _rows(book)
    assert [rows[r.id].info.state for r in recs] == [LeaseState.FROZEN, LeaseState.FROZEN, LeaseState.ACTIVE]


async def test_a_transition_leaves_the_tensor_column_alone_and_a_registration_rewrites_it(book: LeaseBook) -> None:
    from libs.client.protocol import TensorMeta

    (rec,) = await _leases(book, 1)
    rec.set_tensor(TensorMeta(name="w", lease_id=rec.id, offset=0, shape=[16], dtype="float16"))
    counted = Counted(book.db)
    await book.persist([rec])
    assert "tensors" in counted.updates[-1]

    counted.reset()
    await book.apply(rec, LeaseEvent.FREEZE, "frozen", transfer_token="tok")
    assert counted.commits == 1 and "tensors" not in counted.updates[-1]
    assert list(_rows(book)[rec.id].tensors) == ["w"]  # still there, unchanged
