"""A lease row as the manager keeps it: the public `LeaseInfo` plus what only the manager needs (who holds it,
the transfer token, the registered tensors); a gang's row (gang.py's `Gang` as stored). Pure data, plus
process-identity helpers from /proc.

Reading a row back (`LeaseRecord.from_row`, `gang_from_row`) checks it whole and raises `RowDefect`, with the
reason, for anything that is not a row this manager could have written: the caller sets that one row aside
(quarantine.py) and loads the rest."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from libs.client.protocol import TensorMeta
from libs.common.events import LeaseInfo
from libs.common.procs import stat_fields, threads
from services.gpu_manager.gang import Gang

T = TypeVar("T")


@dataclass
class LeaseRecord:
    info: LeaseInfo
    owner_uid: int
    owner_pid: int | None = None
    owner_pid_start: int | None = None  # guards against pid reuse
    transfer_token: str | None = None
    successor: str | None = None
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    # The tensor list changed since the row was last written. A transition leaves the list alone, so its
    # write skips that column (hundreds of tensors are milliseconds of JSON on every commit otherwise).
    tensors_dirty: bool = field(default=True, compare=False)

    @property
    def id(self) -> str:
        return self.info.id

    def update(self, **changes: Any) -> None:
        self.info = self.info.model_copy(update=changes)

    def set_tensor(self, meta: TensorMeta) -> None:
        self.tensors[meta.name] = meta
        self.tensors_dirty = True

    def to_row(self, *, with_tensors: bool = True) -> dict[str, Any]:
        row = {
            "id": self.info.id, "node": self.info.node, "state": self.info.state.value, "owner": self.info.owner,
            "epoch": self.info.epoch, "info": self.info.model_dump_json(), "owner_uid": self.owner_uid,
            "owner_pid": self.owner_pid, "owner_pid_start": self.owner_pid_start,
            "transfer_token": self.transfer_token, "successor": self.successor,
        }
        if with_tensors:
            row["tensors"] = json.dumps([t.model_dump(mode="json") for t in self.tensors.values()])
        return row

    @classmethod
    def from_row(cls, row: Any, node: str) -> LeaseRecord:
        """The row of a lease of `node`, or RowDefect (its reason) when it is not one this manager wrote."""
        info = _read("info", lambda: LeaseInfo.model_validate_json(row.info))
        metas = _read("tensors", lambda: [TensorMeta.model_validate(t) for t in _json_list(row.tensors or "[]")])
        _read("columns", lambda: _StoredLeaseColumns.model_validate(dict(row._mapping)))
        if (info.id, info.node, info.state.value) != (row.id, node, row.state):
            raise RowDefect(f"its info (id {info.id}, node {info.node}, state {info.state.value}) is not its row's "
                            f"(id {row.id}, node {node}, state {row.state})")
        if info.size <= 0 or info.chunk_size <= 0 or info.epoch < 1:
            raise RowDefect(f"size {info.size}, chunk size {info.chunk_size}, epoch {info.epoch}: each must be > 0")
        strays = sorted({t.lease_id for t in metas} - {info.id})
        if strays:
            raise RowDefect(f"its tensors name other leases {strays}")
        return cls(info=info, owner_uid=row.owner_uid, owner_pid=row.owner_pid, owner_pid_start=row.owner_pid_start,
                   transfer_token=row.transfer_token, successor=row.successor,
                   tensors={t.name: t for t in metas}, tensors_dirty=False)


class RowDefect(ValueError):
    """A stored row that is not one this manager could have written (bad JSON, wrong types, values that break an
    invariant, a reference to a lease it cannot hold); the message says why."""


class _StoredLeaseColumns(BaseModel):
    """The lease row's own columns, beside its info (SQLite keeps whatever type it was given)."""

    model_config = ConfigDict(extra="ignore")
    owner_uid: StrictInt
    owner_pid: StrictInt | None
    owner_pid_start: StrictInt | None
    transfer_token: StrictStr | None
    successor: StrictStr | None


class _StoredGang(BaseModel):
    """A gang row's body and generation as gang_to_row writes them: at least one rank, each an engine id once."""

    model_config = ConfigDict(extra="forbid")
    owners: list[StrictStr] = Field(min_length=1)
    epochs: dict[str, StrictInt]
    generation: StrictInt = Field(ge=1)


def gang_to_row(gang: Gang, node: str) -> dict[str, Any]:
    """A gang as its SQL row: the ranks' engine ids in rank order, each lease's committed epoch, the generation."""
    body = {"owners": [gang.owners[r] for r in range(gang.size)], "epochs": dict(gang.epochs)}
    return {"gang_id": gang.gang_id, "node": node, "generation": gang.generation, "body": json.dumps(body)}


def gang_from_row(row: Any) -> Gang:
    """The gang of a row, or RowDefect (its reason) when the row is not one gang_to_row wrote."""
    body = _read("body", lambda: json.loads(row.body))
    if not isinstance(body, dict):
        raise RowDefect(f"body: a JSON {type(body).__name__}, not an object")
    stored = _read("body", lambda: _StoredGang.model_validate({**body, "generation": row.generation}))
    if len(set(stored.owners)) != len(stored.owners):
        raise RowDefect(f"its ranks {stored.owners} name an engine twice")
    bad_epochs = sorted(k for k, v in stored.epochs.items() if v < 1)
    if bad_epochs:
        raise RowDefect(f"leases {bad_epochs} have an epoch below 1")
    return Gang(row.gang_id, len(stored.owners), dict(enumerate(stored.owners)), dict(stored.epochs),
                stored.generation)


def _json_list(text: str) -> list[Any]:
    got = json.loads(text)
    if not isinstance(got, list):
        raise TypeError(f"a JSON {type(got).__name__}, not a list")
    return got


def _read(column: str, parse: Callable[[], T]) -> T:
    """`parse()`, or RowDefect naming the column and what is wrong with it, on one line."""
    try:
        return parse()
    except ValidationError as e:
        raise RowDefect(f"{column}: " + "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'value'}: {err['msg']}"
                                                   for err in e.errors())) from None
    except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise RowDefect(f"{column}: {type(e).__name__}: {e}") from None


def layout_hash(metas: list[TensorMeta]) -> str:
    """A stable hash of a set of tensor layouts (order-independent)."""
    canon = json.dumps(sorted((t.model_dump(mode="json") for t in metas), key=lambda d: (d["lease_id"], d["name"])),
                       sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:32]


def _state_and_start(pid: int) -> tuple[bytes, int] | None:
    rest = stat_fields(pid)
    return (rest[0], int(rest[19])) if rest is not None and len(rest) > 19 else None


def pid_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live process; None once every thread of it is gone or a zombie.

    Why every thread: SIGKILLed, a process's main thread may be a zombie while another thread still runs the
    exit (the last one closes the files, and with the driver's fd the CUDA context's teardown: ~100 ms on an
    H200). Until then the process still maps its leases' memory, and a successor's memory operations in
    that window wait behind the teardown."""
    got = _state_and_start(pid)
    if got is None:
        return None
    state, start = got
    if state not in (b"Z", b"X") or any(t[0] not in (b"Z", b"X") for t in threads(pid)):
        return start
    return None


def process_alive(pid: int | None, start: int | None) -> bool:
    if pid is None:
        return False
    now = pid_start_time(pid)
    return now is not None and (start is None or now == start)


def open_pidfd(pid: int) -> int | None:
    with contextlib.suppress(OSError, AttributeError):
        return os.pidfd_open(pid)
    return None
