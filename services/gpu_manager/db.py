"""The durable lease, gang and GPU health tables (SQLAlchemy Core: SQLite on local disk by default; a Postgres URL works too).

Every method blocks; the manager calls them through `LeaseDb.run`. On SQLite that runs them on the event loop's own
thread: a commit there is in the WAL with no fsync (`synchronous=NORMAL`), ~0.5 ms for a takeover's rows, while the
hop to a worker thread and back cost 2-10 ms more on a busy manager (the worker waits for the GIL, the loop for the
worker's result: three such commits, the owner's exit, the freeze and the takeover, are on a recovery's path). The
WAL's checkpoints, which fsync, are not left to a commit (`wal_autocheckpoint` off): `checkpoint` runs one on the
worker thread every CHECKPOINT_EVERY writes. Another database (a Postgres URL: each call a network round trip) keeps
every call on the one worker thread. Either way writes go in the order they were made. A row is written before the
change it records is acted on (a new epoch is durable before read-write access is granted). A gang's row is written
in the same transaction as the lease rows its change goes with (a takeover's new owners, epochs and generation; a
reclaim's end of the gang), so a manager killed at any point restarts with a gang that matches its leases. A row
that cannot be read back is set aside into `quarantine` (quarantine.py), each row on its own: the others load. A
failed GPU's row in `gpu_health` is written before its leases are reclaimed and deleted only when it is marked
healthy (gpu_board.py invariant 4). A write the database refuses (its disk full, an I/O error, the database locked
or away) rolls back whole and raises `TableUnwritable`, a typed `unavailable` reply: nothing changed, and the same
write works once the condition ends. On SQLite the database and its -wal, -shm and -journal files are 0600 whatever
the process umask (`_private_sqlite`): they hold every owner's engine id and the frozen leases' transfer tokens, which
no other uid may read (session.py rule 9), even where the state directory is traversable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    make_url,
    select,
)
from sqlalchemy.exc import OperationalError

from libs.common.errors import Unavailable
from services.gpu_manager.gang import Gang
from services.gpu_manager.quarantine import BadRow, LeaseRow, gang_defects
from services.gpu_manager.records import LeaseRecord, RowDefect, gang_from_row, gang_to_row

T = TypeVar("T")
log = logging.getLogger("holdfast.gpu_manager.db")

PRIVATE = 0o600  # the SQLite files: the manager's uid's alone
SIDECARS = ("-wal", "-shm", "-journal")
CHECKPOINT_EVERY = 200  # SQLite writes between two WAL checkpoints (each a few pages: the WAL stays ~1-4 MB)
BUSY_WAIT_S = 1.0

metadata = MetaData()
leases = Table(
    "leases", metadata,
    Column("id", String(64), primary_key=True),
    Column("node", String(256), nullable=False, index=True),
    Column("state", String(16), nullable=False, index=True),
    Column("owner", String(256), nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("info", Text, nullable=False),  # LeaseInfo as JSON
    Column("owner_uid", Integer, nullable=False),
    Column("owner_pid", Integer),
    Column("owner_pid_start", BigInteger),
    Column("transfer_token", String(128)),
    Column("successor", String(256)),
    Column("tensors", Text, nullable=False, default="[]"),
)

# A tensor-parallel engine's gang (gang.py): its ranks' engine ids, each lease's committed epoch, as JSON in `body`.
gangs = Table(
    "gangs", metadata,
    Column("node", String(256), primary_key=True),  # a shared database (Postgres) holds every node's gangs
    Column("gang_id", String(256), primary_key=True),
    Column("generation", BigInteger, nullable=False),
    Column("body", Text, nullable=False),
)

# The node's failed GPUs: a row per GPU marked unhealthy, by UUID (an index may name another GPU after a reboot);
# no row: healthy. Read back before the engine socket serves, so a restarted manager never leases one out.
gpu_health = Table(
    "gpu_health", metadata,
    Column("node", String(256), primary_key=True),
    Column("uuid", String(128), primary_key=True),
    Column("gpu", Integer, nullable=False),  # its index when marked (for a reader of the table)
    Column("detail", Text, nullable=False),
    Column("at", Float, nullable=False),
)

# Rows set aside at start-up (quarantine.py): what they were, from which table, and why. Never read back as leases.
quarantine = Table(
    "quarantine", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("node", String(256), nullable=False, index=True),
    Column("kind", String(16), nullable=False),  # lease | gang
    Column("key", String(256), nullable=False),  # the lease id, or the gang id
    Column("reason", Text, nullable=False),
    Column("row", Text, nullable=False),  # the row as it was, JSON
    Column("at", Float, nullable=False),
)


class TableUnwritable(Unavailable):
    """The database refused a write (SQLite: its disk full, an I/O error, locked); the transaction rolled back, so
    the table is as it was. Code `unavailable`: the caller may ask again once the condition ends."""


@contextlib.contextmanager
def _writing(what: str) -> Iterator[None]:
    try:
        yield
    except OperationalError as e:
        raise TableUnwritable(f"the lease table cannot be written ({what}): {e.orig}; nothing changed, "
                              "ask again once the database can be written (its disk has room)") from e


class LeaseDb:
    def __init__(self, url: str) -> None:
        self.inline = url.startswith("sqlite")
        # on the loop's thread a write waits for a lock another process holds (an operator's shell, say) at most
        # BUSY_WAIT_S, then it is refused (TableUnwritable, tried again) rather than stalling every engine's session
        self.engine = create_engine(url, future=True, connect_args={"timeout": BUSY_WAIT_S} if self.inline else {})
        if self.inline:
            _private_sqlite(url)
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-db")
        self._writes = 0
        self._checkpointing: asyncio.Future[Any] | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`: here on SQLite (then a WAL checkpoint on the worker thread every CHECKPOINT_EVERY calls,
        one at a time), else on the worker thread (the module's note)."""
        loop = asyncio.get_running_loop()
        if not self.inline:
            return await loop.run_in_executor(self._pool, fn, *args)
        out = fn(*args)
        self._writes += 1
        if self._writes % CHECKPOINT_EVERY == 0 and (self._checkpointing is None or self._checkpointing.done()):
            self._checkpointing = loop.run_in_executor(self._pool, self.checkpoint)
        return out

    def checkpoint(self) -> None:
        """Copy the WAL's committed pages into the database (PASSIVE: commits go on meanwhile). A failure is
        logged: the WAL only grows until the next one."""
        try:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
        except OperationalError as e:
            log.warning("the lease table's WAL checkpoint failed (tried again after %d writes): %s",
                        CHECKPOINT_EVERY, e.orig)

    def create_schema(self) -> None:
        metadata.create_all(self.engine)

    def load_live(self, node: str) -> tuple[list[LeaseRecord], list[BadRow]]:
        """The node's live lease rows, and those that cannot be read back (each with its reason)."""
        good, bad = [], []
        with self.engine.connect() as conn:
            for row in conn.execute(select(leases).where(leases.c.node == node, leases.c.state != "RECLAIMED")):
                try:
                    good.append(LeaseRecord.from_row(row, node))
                except RowDefect as e:
                    bad.append(BadRow.of("lease", row.id, str(e), row._mapping))
        return good, bad

    def load_gangs(self, node: str) -> tuple[list[Gang], list[BadRow]]:
        """The node's gangs, and those that cannot be read back or name leases they cannot hold (quarantine.py)."""
        good: dict[str, tuple[Gang, Any]] = {}
        bad = []
        with self.engine.connect() as conn:
            for row in conn.execute(select(gangs).where(gangs.c.node == node)):
                try:
                    good[row.gang_id] = (gang_from_row(row), row)
                except RowDefect as e:
                    bad.append(BadRow.of("gang", row.gang_id, str(e), row._mapping))
            named = sorted({i for gang, _ in good.values() for i in gang.epochs})
            rows = {r.id: LeaseRow(r.node, r.owner) for r in conn.execute(
                select(leases.c.id, leases.c.node, leases.c.owner).where(leases.c.id.in_(named)))}
            aside = conn.execute(select(quarantine.c.key).where(
                quarantine.c.node == node, quarantine.c.kind == "lease", quarantine.c.key.in_(named)))
            rows.update({key: LeaseRow(node, None) for (key,) in aside if key not in rows})
        why = gang_defects([g for g, _ in good.values()], rows, node)
        bad += [BadRow.of("gang", gang_id, why[gang_id], good.pop(gang_id)[1]._mapping) for gang_id in sorted(why)]
        return [g for g, _ in good.values()], bad

    def load_gpu_health(self, node: str) -> dict[str, str]:
        """The node's failed GPUs: UUID -> why."""
        with self.engine.connect() as conn:
            return {row.uuid: row.detail for row in conn.execute(select(gpu_health).where(gpu_health.c.node == node))}

    def save_gpu_health(self, node: str, uuid: str, index: int, failed: str | None, at: float) -> None:
        """GPU `uuid` failed (`failed`: why) or healthy (None: its row goes). Idempotent."""
        key = (gpu_health.c.node == node) & (gpu_health.c.uuid == uuid)
        with _writing(f"GPU {uuid}'s health"), self.engine.begin() as conn:
            conn.execute(gpu_health.delete().where(key))
            if failed is not None:
                conn.execute(gpu_health.insert().values(node=node, uuid=uuid, gpu=index, detail=failed, at=at))

    def set_aside(self, node: str, bad: list[BadRow], at: float) -> None:
        """Move rows to `quarantine`, in one transaction: each leaves its table as its copy lands there."""
        with _writing("quarantine"), self.engine.begin() as conn:
            for item in bad:
                conn.execute(quarantine.insert().values(node=node, kind=item.kind, key=item.key, reason=item.reason,
                                                        row=item.row, at=at))
                if item.kind == "lease":
                    conn.execute(leases.delete().where(leases.c.id == item.key, leases.c.node == node))
                else:
                    conn.execute(gangs.delete().where(gangs.c.node == node, gangs.c.gang_id == item.key))

    def save(self, records: list[LeaseRecord], node: str = "", put_gangs: tuple[Gang, ...] = (),
             drop_gangs: tuple[str, ...] = ()) -> None:
        """Upsert lease rows, upsert and delete gang rows, all in one transaction (portable: update, then insert
        what did not exist). The tensor list is written only where it changed (`tensors_dirty`); the caller
        clears the flag once committed."""
        with _writing("lease and gang rows"), self.engine.begin() as conn:
            for rec in records:
                row = rec.to_row(with_tensors=rec.tensors_dirty)
                res = conn.execute(leases.update().where(leases.c.id == rec.id).values(**row))
                if res.rowcount == 0:
                    conn.execute(leases.insert().values(**rec.to_row()))
            for gang in put_gangs:
                grow = gang_to_row(gang, node)
                res = conn.execute(gangs.update().where(gangs.c.node == node, gangs.c.gang_id == gang.gang_id)
                                   .values(**grow))
                if res.rowcount == 0:
                    conn.execute(gangs.insert().values(**grow))
            if drop_gangs:
                conn.execute(gangs.delete().where(gangs.c.node == node, gangs.c.gang_id.in_(drop_gangs)))

    def close(self) -> None:
        if self.inline:
            self.checkpoint()
        self._pool.shutdown(wait=True)
        self.engine.dispose()


def _private_sqlite(url: str) -> None:
    """The database file made 0600 before SQLite first opens it (created so, under any umask), and any sidecar an
    older manager left made so: SQLite creates each sidecar with the database file's mode."""
    path = make_url(url).database
    if not path or path == ":memory:" or path.startswith("file:"):  # in memory, or a URI SQLite resolves itself
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE)
    try:
        os.fchmod(fd, PRIVATE)  # the umask narrows a new file's mode only; an existing one keeps its own
    finally:
        os.close(fd)
    for suffix in SIDECARS:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(path + suffix, PRIVATE)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    # NORMAL: in WAL mode a commit survives the manager's crash (the OS holds it), not a power cut; nothing
    # this table fences survives a power cut either (the GPU memory, every owner, every client), and an fsync
    # on the freeze's and the takeover's paths cost 2-20 ms on the H200's disk (docs/gpu_manager.md).
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA wal_autocheckpoint=0")  # LeaseDb.checkpoint, on the worker thread: a commit never fsyncs
    cur.close()
