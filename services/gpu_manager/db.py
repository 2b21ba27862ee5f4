"""The durable lease and gang tables (SQLAlchemy Core: SQLite on local disk by default; a Postgres URL works too).

Every method blocks: the manager calls them through `LeaseDb.run` on one worker thread, which also keeps
writes in the order they were made. A row is written before the change it records is acted on (a new epoch
is durable before read-write access is granted). A gang's row is written in the same transaction as the lease
rows its change goes with (a takeover's new owners, epochs and generation; a reclaim's end of the gang), so a
manager killed at any point restarts with a gang that matches its leases.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    select,
)

from services.gpu_manager.gang import Gang
from services.gpu_manager.records import LeaseRecord, gang_from_row, gang_to_row

T = TypeVar("T")

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


class LeaseDb:
    def __init__(self, url: str) -> None:
        self.engine = create_engine(url, future=True)
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-db")

    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def create_schema(self) -> None:
        metadata.create_all(self.engine)

    def load_live(self, node: str) -> list[LeaseRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(leases).where(leases.c.node == node, leases.c.state != "RECLAIMED"))
            return [LeaseRecord.from_row(r) for r in rows]

    def load_gangs(self, node: str) -> list[Gang]:
        with self.engine.connect() as conn:
            return [gang_from_row(r) for r in conn.execute(select(gangs).where(gangs.c.node == node))]

    def save(self, records: list[LeaseRecord], node: str = "", put_gangs: tuple[Gang, ...] = (),
             drop_gangs: tuple[str, ...] = ()) -> None:
        """Upsert lease rows, upsert and delete gang rows, all in one transaction (portable: update, then insert
        what did not exist). The tensor list is written only where it changed (`tensors_dirty`); the caller
        clears the flag once committed."""
        with self.engine.begin() as conn:
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
        self._pool.shutdown(wait=True)
        self.engine.dispose()


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    # NORMAL: in WAL mode a commit survives the manager's crash (the OS holds it), not a power cut; nothing
    # this table fences survives a power cut either (the GPU memory, every owner, every client), and an fsync
    # on the freeze's and the takeover's paths cost 2-20 ms on the H200's disk (docs/gpu_manager.md).
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()
