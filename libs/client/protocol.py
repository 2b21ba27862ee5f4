"""The engine <-> gpu_manager protocol over the node-local unix socket (frames: libs.common.wire).

Requests are maps with an `op`; replies are `{"ok": true, ...}` or `{"ok": false, "error": {code, message}}`.
Fds of leases ride on the reply that hands them out, in lease order, each lease's chunks in order.
Both sides import this module; it needs only pydantic (no torch, no numpy, no CUDA).

Order: the first request on a connection is `hello`; any other op first, or a second hello, is `out_of_order`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from libs.common.errors import Conflict, HoldfastError, MalformedMessage
from libs.common.events import LeaseInfo, Tag

PROTOCOL_VERSION = 1
# Bounds on what a request may ask for, so that every row it makes fits where the row goes: a lease's sizes stay
# 64-bit once rounded to any granularity (msgpack, SQL BIGINT), its name within etcd's and NATS's message limits.
MAX_LEASE_BYTES = 1 << 50
MAX_LEASE_NAME = 512
MAX_ID = 256
# Ids and names go into log lines, tables and terminals: no control characters (a newline forged a log line, an
# escape sequence rewrote an operator's terminal).
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
# Sizes a request's collections may have. Pydantic reports every bad entry, one error object each: a frame of a million
# unknown keys (or a map of a million bad epochs) took seconds of the manager's event loop and a gigabyte to list
# them. Over these a request is refused by its counts alone (`parse_request`), before it is validated.
MAX_FIELDS = 16  # keys of a request, or of a tensor in one: more than any has
MAX_ITEMS = 65536  # entries of a request's map or list (epochs, tensors): an engine's leases, a model's tensors
MAX_DIMS = 64  # a tensor's dimensions
MAX_ERROR_MESSAGE = 2000  # an engine's reason (AnswerReq): it goes on to the control plane in one NATS message


class OutOfOrder(MalformedMessage):
    code = "out_of_order"


class PredecessorAlive(Conflict):
    """Kill-before-transfer: the predecessor still runs, so it may still write; the successor must wait."""

    code = "predecessor_alive"


class NotFrozenYet(Conflict):
    """The predecessor's leases live but are not frozen yet: the control plane may promote a shadowing successor
    while it freezes; the successor waits (unlike `not_found`: nothing left to take over)."""

    code = "not_frozen_yet"


class OutOfMemory(HoldfastError):
    code = "out_of_memory"


class GpuUnhealthy(HoldfastError):
    """A new lease, or a wake, on a GPU marked unhealthy (its memory may be lost at any moment): nothing was taken;
    the engine asks for another GPU. Raised by the gpu_manager (services/gpu_manager/gpu_board.py)."""

    code = "gpu_unhealthy"


class LimitExceeded(HoldfastError):
    """A request over one of the manager's limits (settings.py); the connection stays usable unless said."""

    code = "limit_exceeded"


class TooManyChunks(LimitExceeded):
    """An allocate whose size / chunk size is more chunks (one fd each, here and in the manager) than allowed."""

    code = "too_many_chunks"


class TooManyFds(LimitExceeded):
    """An allocate that would take the chunk fds of one client process, or of the manager, past their limit."""

    code = "too_many_fds"


class ReplyTooLarge(LimitExceeded):
    """The answer would pass the frame limit (`max_frame_bytes`; a grant of thousands of registered tensors): this
    is sent instead of it, the connection stays usable. What the request changed stays changed."""

    code = "reply_too_large"


class TooManyConnections(LimitExceeded):
    """This uid holds as many connections as allowed; the manager answers this, then closes the new one."""

    code = "too_many_connections"


class ArtifactInvalid(HoldfastError):
    """A weight artifact that cannot be restored: no manifest (never finished), a file shorter than its
    manifest says, a block whose hash differs, or another format version. The caller falls back to the
    original weights file; nothing was mapped."""

    code = "artifact_invalid"


class PartialGang(HoldfastError):
    """A tensor-parallel gang asked to move without every rank's leases (or a successor group without every rank):
    nothing moved (services/gpu_manager/gang.py)."""

    code = "partial_gang"


class StaleGang(HoldfastError):
    """A gang move at another generation, or over leases at other epochs, than the gang committed: nothing moved."""

    code = "stale_gang"


class Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorMeta(Msg):
    """A named tensor inside a lease: byte offset, shape, dtype name (numpy/torch spelling), stride in elements."""

    name: str = Field(min_length=1, max_length=512)
    lease_id: str
    offset: int = Field(ge=0)
    shape: list[int] = Field(max_length=MAX_DIMS)
    dtype: str
    stride: list[int] | None = Field(None, max_length=MAX_DIMS)  # None: contiguous (C order)


class Hello(Msg):
    op: Literal["hello"] = "hello"
    engine_id: str = Field(min_length=1, max_length=MAX_ID, pattern=PRINTABLE)
    engine_class: str = Field("default", max_length=MAX_ID, pattern=PRINTABLE)
    version: int = PROTOCOL_VERSION


class Allocate(Msg):
    op: Literal["allocate"] = "allocate"
    gpu: int = Field(0, ge=0)
    size: int = Field(gt=0, le=MAX_LEASE_BYTES)
    tag: Tag = Tag.WEIGHTS
    name: str = Field("", max_length=MAX_LEASE_NAME, pattern=PRINTABLE)
    chunk_size: int | None = Field(None, gt=0, le=MAX_LEASE_BYTES)  # None: the manager's configured chunk size
    host: bool = False  # host memory (a memfd) on any backend (LeaseInfo.host)


class Register(Msg):
    op: Literal["register"] = "register"
    epochs: dict[str, int]  # lease id -> the epoch the sender holds (fencing)
    tensors: list[TensorMeta] = Field(max_length=MAX_ITEMS)


class Commit(Msg):
    op: Literal["commit"] = "commit"


class Pending(Msg):
    op: Literal["pending"] = "pending"


class Attach(Msg):
    op: Literal["attach"] = "attach"


class TakeoverReq(Msg):
    """`fenced`: the successor writes nothing through the leases until every predecessor named in the reply's
    `fence` has exited (its pidfd), so the manager may grant them as soon as the predecessor is stopped (can run
    no code of its own) instead of gone: the ~75-95 ms of a CUDA context's teardown overlap the mapping."""

    op: Literal["takeover"] = "takeover"
    predecessor: str
    transfer_token: str
    fenced: bool = False
    # the successor loads the weights itself: a frozen set of KV backups alone (Freeze `backups_only`) is handed
    # over too; without it such a set is refused (`IncompleteLeaseSet`), as one it could not run from
    cold_weights: bool = False
    # leases the successor maps already (a standby's shadow), by the layout hash it mapped them with: each one
    # whose committed layout is still that one is granted without its fds or tensors (`LeaseGrant.held`)
    held: dict[str, str] = Field(default_factory=dict)


class FencePid(Msg):
    """A process a fenced successor must see exit (`procs.wait_gone`) before its first write."""

    pid: int
    pid_start: int | None = None


class ShareReq(Msg):
    """A warm standby maps an active engine's weight leases read-only (token from the `share` command)."""

    op: Literal["share"] = "share"
    owner: str
    share_token: str


class Heartbeat(Msg):
    op: Literal["heartbeat"] = "heartbeat"


class Release(Msg):
    op: Literal["release"] = "release"
    lease_id: str
    epoch: int


class Resume(Msg):
    """A live engine back on a new connection (the manager restarted, or the socket broke) says which leases it
    still has mapped, at which epoch. No fds come back: its mappings are kept as they are."""

    op: Literal["resume"] = "resume"
    epochs: dict[str, int]  # lease id -> the epoch the sender holds


CopySource = Literal["peer", "host", "artifact"]  # the fastest first (docs/restore.md)


class RestoreReq(Msg):
    """A new weights lease for the caller, filled from a node copy of a model's weights: a live lease of another
    engine holding the same content (`peer`, issue 22), else the host tier's copy if the node keeps one, else the
    artifact on disk (hash verified). The reply is a grant with the tensors the
    artifact was written with (registered, not yet committed: the engine commits its set as after a load)."""

    op: Literal["restore"] = "restore"
    artifact: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    gpu: int = Field(0, ge=0)
    sources: list[CopySource] = Field(default_factory=lambda: list[CopySource](["peer", "host", "artifact"]),
                                      min_length=1)


class SleepReq(Msg):
    """Release these leases' physical memory; the caller keeps its address reservation (issue 21). A weights lease
    is first copied to the node's host tier (or its artifact) unless a copy of it is there already. The engine
    unmaps its pages after the reply; the memory is gone once it has (the manager's side is freed here)."""

    op: Literal["sleep"] = "sleep"
    epochs: dict[str, int] = Field(min_length=1)  # lease id -> the epoch the sender holds
    ask: str | None = None  # the control plane's ask this answers (from a heartbeat reply), if any


class WakeReq(Msg):
    """New physical memory for sleeping leases (fds to map at the same addresses); a weights lease comes back
    filled from its copy. The reply is a grant (`source`: which copy filled the weights)."""

    op: Literal["wake"] = "wake"
    epochs: dict[str, int] = Field(min_length=1)
    ask: str | None = None


class AnswerReq(Msg):
    """The engine's last word on an ask: done (error None) or refused/failed, with why."""

    op: Literal["answer"] = "answer"
    ask: str = Field(min_length=1, max_length=64)
    error: dict[Annotated[str, Field(max_length=16)], Annotated[str, Field(max_length=MAX_ERROR_MESSAGE)]] | None = \
        Field(None, max_length=2)  # {code, message}


class GangRegister(Msg):
    """Rank 0 of a tensor-parallel engine, once every rank committed its leases: those leases form one gang, rank r
    being the engine `owners[r]` (gang.py). Registering again (the same ranks) takes the epochs anew."""

    op: Literal["gang_register"] = "gang_register"
    gang_id: str = Field(min_length=1, max_length=256)
    owners: list[str] = Field(min_length=1, max_length=64)


class GangTakeover(Msg):
    """One rank of a successor group takes its rank's leases of a frozen gang. Every rank of the group sends it,
    each on its own connection, naming the same group (`successors[r]`: rank r's engine id), generation and token;
    the leases move, all ranks' in one commit, once the last rank has asked, or none move: a group that does not
    name every rank, asks at another generation or does not all ask within `wait_s` is refused."""

    op: Literal["gang_takeover"] = "gang_takeover"
    gang_id: str = Field(min_length=1, max_length=256)
    rank: int = Field(ge=0)
    successors: list[str] = Field(min_length=1, max_length=64)
    generation: int = Field(ge=1)
    transfer_token: str
    wait_s: float = Field(30.0, gt=0, le=300)
    # a group of M <= N ranks taking a broken gang's KV backups (gpu_manager gang.py invariant 10): rank 0 gets them
    degraded: bool = False


Request = Annotated[
    Union[Hello, Allocate, Register, Commit, Pending, Attach, TakeoverReq, ShareReq, Heartbeat, Release, Resume,  # noqa: UP007
          RestoreReq, SleepReq, WakeReq, AnswerReq, GangRegister, GangTakeover],
    Field(discriminator="op"),
]
_request_adapter: TypeAdapter[Any] = TypeAdapter(Request)


def _check_counts(obj: dict[str, Any]) -> None:
    """Refuse a request whose counts no valid one has (MAX_FIELDS, MAX_ITEMS), in time linear in its top level and
    its tensors' keys only: every bad entry past these would cost pydantic an error object."""
    if len(obj) > MAX_FIELDS:
        raise MalformedMessage(f"invalid request: {len(obj)} fields, more than any request has")
    for key, value in obj.items():
        if isinstance(value, dict | list) and len(value) > MAX_ITEMS:
            raise MalformedMessage(f"invalid request: {key}: {len(value)} entries, more than {MAX_ITEMS}")
        if isinstance(value, list) and any(isinstance(item, dict) and len(item) > MAX_FIELDS for item in value):
            raise MalformedMessage(f"invalid request: {key}: an entry has more fields than any has")


def parse_request(obj: dict[str, Any]) -> Any:
    _check_counts(obj)
    try:
        return _request_adapter.validate_python(obj)
    except ValidationError as e:
        first = e.errors(include_url=False, include_context=False, include_input=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise MalformedMessage(f"invalid request: {loc}: {first['msg']}") from None


class LeaseGrant(Msg):
    """One lease handed out: its row, where its chunks' fds sit in the reply, and the GPU's UUID (cuda)."""

    lease: LeaseInfo
    nfds: int
    gpu_uuid: str | None = None
    tensors: list[TensorMeta] = Field(default_factory=list)
    read_only: bool = False  # a shadow's view (share): map it read-only, it is not this engine's lease
    # the requester maps this lease already, with this very layout (TakeoverReq `held`): no fds, no tensors sent;
    # it keeps its mapping and the tensors it was shared with
    held: bool = False


class HelloReply(Msg):
    node: str
    backend: str
    chunk_size: int
    granularity: int
    manager_pid: int


class GangView(Msg):
    """A gang as the manager holds it: rank r is `owners[r]`; each lease's committed epoch; the generation."""

    gang_id: str
    owners: list[str]
    epochs: dict[str, int]
    generation: int


class PeerServed(Msg):
    """The live lease a restore was copied from (services/gpu_manager/peer.py)."""

    lease: str
    gpu: int
    owner: str


class GrantReply(Msg):
    leases: list[LeaseGrant]
    gang: GangView | None = None  # gang_takeover: the gang the successor group holds now
    source: str | None = None  # restore: which copy served ("peer", "host" or "artifact")
    restore: dict[str, float] | None = None  # restore: bytes, seconds, GiB/s, as measured by the manager
    peer: PeerServed | None = None  # restore from a peer: the lease it was copied from
    passed: list[str] = []  # restore: why a faster source was not used (a peer refused or lost mid-copy)
    fence: list[FencePid] = []  # a fenced takeover: the stopped predecessors not yet gone at the grant
    # a takeover: the manager's own part of the request's time (its wait for the lease table, its checks and commit)
    manager_ms: dict[str, float] = {}


class Ask(Msg):
    """Something the control plane asks of this engine, handed out once in a heartbeat's reply."""

    id: str
    op: Literal["sleep", "wake"]
    level: int = 1  # sleep: 1 the KV cache, 2 the weights too


class HeartbeatReply(Msg):
    ask: Ask | None = None


class SleepReply(Msg):
    lease_ids: list[str]
    bytes: int  # released by the manager (freed once the engine unmapped them too)


class PendingReply(Msg):
    leases: list[LeaseInfo]


class CommitReply(Msg):
    layout_hash: str


class ResumeReply(Msg):
    """`held`: still this process's, ACTIVE (rows as they are now). `lost`: lease id -> why it is not any more
    (reclaimed, another owner, a newer epoch, frozen for a successor): the engine must stop writing to it."""

    held: list[LeaseInfo]
    lost: dict[str, str] = Field(default_factory=dict)


def ok(model: BaseModel | None = None) -> dict[str, Any]:
    return {"ok": True, **(model.model_dump(mode="json") if model is not None else {})}


def error(exc: HoldfastError) -> dict[str, Any]:
    return {"ok": False, "error": exc.to_dict()}


def chunk_sizes(size: int, chunk_size: int) -> list[int]:
    """A lease's chunks: all `chunk_size` but the last, which holds the rest. Both sides compute the same."""
    full, rest = divmod(size, chunk_size)
    return [chunk_size] * full + ([rest] if rest else [])


DTYPE_SIZES = {
    "bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}


def contiguous_stride(shape: list[int]) -> list[int]:
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= max(dim, 1)
    return list(reversed(stride))


def tensor_extent(meta: TensorMeta) -> int:
    """Bytes from the tensor's offset to one past its last element; raises MalformedMessage if ill-formed."""
    if meta.dtype not in DTYPE_SIZES:
        raise MalformedMessage(f"tensor {meta.name}: unknown dtype {meta.dtype!r}")
    stride = meta.stride if meta.stride is not None else contiguous_stride(meta.shape)
    if len(stride) != len(meta.shape) or any(d < 0 for d in meta.shape) or any(s < 0 for s in stride):
        raise MalformedMessage(f"tensor {meta.name}: bad shape {meta.shape} or stride {stride}")
    if any(d == 0 for d in meta.shape):
        return 0
    last = sum((d - 1) * s for d, s in zip(meta.shape, stride, strict=True))
    return (last + 1) * DTYPE_SIZES[meta.dtype]
