"""What an engine may say over its link to the agent (libs/client/agent_link.py speaks it), as typed messages.

Every frame an engine sends is validated here before it touches its record: `parse_register` for the first frame
of a connection, `parse_message` for the others. Anything else (an unknown op, a field of the wrong type, an
unknown fault kind, a string longer than its record can store) raises `MalformedMessage`, which the link answers
with a typed error (link_server.py). So a record holds only what its `EngineInfo` can be built from: a ready's
endpoint given as a map once made every later save of the record raise, and with it the agent's standby promotion
when the engine died (probe of 2026-12, section 5).

Keys a message does not know are ignored, not refused: a newer engine's link says more than an older agent reads
(`followers`, `spare` were added so), and the frame limits below bound what it can send.

Limits: a frame before registration is at most `MAX_REGISTER_BYTES` with at most `MAX_REGISTER_FDS` fds (the
death mark, libs/common/death_mark.py); after it, at most `MAX_FRAME_BYTES` and no fd (engines send none). The
transport's defaults (16 MiB, 16384 fds) let two stalled connections hold every fd of the agent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from libs.common.errors import HoldfastError, MalformedMessage
from libs.common.events import EngineRole, FaultKind, RankProcess

# A register: five ids of at most 256 characters, an endpoint, up to 63 followers (~40 bytes each): well under 8 KiB.
MAX_REGISTER_BYTES = 16 * 1024
MAX_REGISTER_FDS = 1
# A ready with its weights report (a TP group's ranks: 64 sources), a fatal's 2000-character detail: under 16 KiB.
MAX_FRAME_BYTES = 64 * 1024
MAX_FRAME_FDS = 0

MAX_DETAIL = 2000  # a fatal's detail kept (libs/client/agent_link.py sends at most this): the fault's detail grows
MAX_KV = 500  # where a successor's KV came from, as recorded
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"  # ids and endpoints go into log lines and terminals: no control characters

Id = Annotated[str, Field(min_length=1, max_length=256, pattern=PRINTABLE)]
Endpoint = Annotated[str, Field(max_length=2048, pattern=PRINTABLE)]
Seq = Annotated[int, Field(ge=0, lt=1 << 63)]


def _clip(limit: int):  # noqa: ANN202 - a validator
    return AfterValidator(lambda s: s[:limit])


class TooManyLinks(HoldfastError):
    """The socket holds as many connections as allowed, overall or of the connecting process: this one is
    answered so, then closed (link_server.py rule 4)."""

    code = "too_many_connections"


class LinkMsg(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, str_max_length=4096, allow_inf_nan=False)


class Assigned(LinkMsg):
    """The assignment a standby was sent (its registration repeats it): after an agent's restart, the takeover its
    previous life began on it, resumed rather than begun again (takeover.py `resume`)."""

    incident_id: Id
    predecessor: Id


class Register(LinkMsg):
    """The first frame of a connection: who the engine is and what it last said (a re-registration repeats it)."""

    op: Literal["register"]
    protocol: int = Field(1, ge=0, lt=1 << 31)
    engine_id: Id
    pid: int = Field(0, ge=0, lt=1 << 31)  # checked against SO_PEERCRED's
    role: EngineRole | None = None  # None: active
    model: Id = "unknown"
    engine_class: Id = "default"
    version: Id = "1"
    gpu: int = Field(0, ge=0, lt=1 << 16)
    state: Literal["starting", "ready", "standby", "assigned"] | None = None
    endpoint: Endpoint | None = None
    heartbeats: bool = False
    can_shadow: bool = False
    shadows: Id | None = None  # a standby's: the engine whose weights it still maps
    fences: bool = False
    followers: list[RankProcess] = Field(default_factory=list, max_length=63)  # a TP group's rank 0 (tp <= 64)
    spare: bool = False
    death_mark: bool = False  # the frame's fd is the engine's death mark
    assigned: Assigned | None = None  # a standby assigned a predecessor: its assignment's incident and predecessor


class Acked(LinkMsg):
    seq: Seq | None = None  # answered with an ack of this seq (libs/client/agent_link.py `_request`)


class Heartbeat(LinkMsg):
    op: Literal["heartbeat"]


class Ready(Acked):
    op: Literal["ready"]
    endpoint: Endpoint | None = None
    state: Literal["ready", "standby"] | None = None
    heartbeats: bool = False
    # How a cold start loaded its weights (safetensors_io.WeightsLoad.report), read by engines.weights_loaded: for the
    # engine's timeline only, so one it cannot read is dropped with a warning and the engine still serves.
    weights: dict[str, Any] | None = None
    kv: Annotated[str, _clip(MAX_KV)] | None = None


class Fatal(Acked):
    op: Literal["fatal"]
    kind: FaultKind = FaultKind.CUDA_ERROR
    detail: Annotated[str, Field(max_length=8 * MAX_DETAIL), _clip(MAX_DETAIL)] = ""


class Shadowing(Acked):
    op: Literal["shadowing"]
    owner: Annotated[str, Field(max_length=256, pattern=PRINTABLE)] | None = None  # "" or None: nobody
    read_only: bool = False


class Asleep(Acked):
    op: Literal["asleep"]
    sleeping: bool = False


class Bye(Acked):
    op: Literal["bye"]


LinkMessage = Annotated[Union[Heartbeat, Ready, Fatal, Shadowing, Asleep, Bye],  # noqa: UP007
                        Field(discriminator="op")]
_message_adapter: TypeAdapter[Any] = TypeAdapter(LinkMessage)
_OPS = frozenset({"heartbeat", "ready", "fatal", "shadowing", "asleep", "bye"})


def _malformed(op: str, e: ValidationError, *, tagged: bool) -> MalformedMessage:
    """The first of its errors, said briefly (a union's errors start with the tag: left out)."""
    first = e.errors(include_url=False, include_context=False, include_input=False)[0]
    loc = ".".join(str(p) for p in first["loc"][1 if tagged else 0:])
    return MalformedMessage(f"invalid {op}: {loc}: {first['msg']}")


def parse_register(obj: dict[str, Any]) -> Register:
    """The first frame of a connection, or `MalformedMessage` (pure)."""
    if obj.get("op") != "register":
        raise MalformedMessage(f"the first frame must be register, not {str(obj.get('op'))[:64]!r}")
    try:
        return Register.model_validate(obj)
    except ValidationError as e:
        raise _malformed("register", e, tagged=False) from None


def parse_message(obj: dict[str, Any]) -> Heartbeat | Ready | Fatal | Shadowing | Asleep | Bye:
    """A registered engine's frame, or `MalformedMessage` (pure)."""
    op = obj.get("op")
    if not isinstance(op, str) or op not in _OPS:
        raise MalformedMessage(f"unknown op {str(op)[:64]!r}")
    try:
        return _message_adapter.validate_python(obj)  # type: ignore[no-any-return]
    except ValidationError as e:
        raise _malformed(op, e, tagged=True) from None
