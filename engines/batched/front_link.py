"""The link between the batched engine and its HTTP front (front.py, a process of its own): the frames, the
engine's end (`FrontLink`, `RemoteSink`, `EngineSide`) and the front's end (`EngineLink`). No torch here: the
front imports this module.

Why a process: with the HTTP server on a thread of the engine, every token of every stream (a coroutine's wake-up,
its line, a send through uvicorn) took the interpreter from the step thread: ~30-40 us a token, at 256 streams
more than half of it, and the step thread's host work waited for the interpreter (H200, 8b: "schedule" 7.5-9 ms
of a ~13 ms step). Behind the link the engine's share of a pass's output is one frame.

Frames on a socketpair: 4 bytes of length (big-endian), then msgpack (msgspec). Front -> engine: `Submit`,
`Abort`, `Call` (/health, /checksum), `Mark` (a recovery's marks seen by the front), `Hello` (it serves);
engine -> front: `Out` (one pass's output, every request's items in the order the step thread made them),
`Status` (the engine's state), `Reply`. An `Out` item is `[key, token]`, `[key, token, t_submit, t_intake,
t_scheduled, t_first_token]` (a request's first token, with where its time went) or `[key, reason,
prompt_tokens, completion_tokens]` (its end).

Invariants:
1. A request's items reach the front in the order the step thread made them; its end is its last item, and each
   submitted request ends exactly once, unless the front aborted it first.
2. One failure domain: the front exits the moment its end of the link closes (the engine died: every client's
   connection closes as it did when the engine served HTTP itself), and the engine stops (exit 70) the moment
   the front's end closes. The front also dies with the engine's main thread (PR_SET_PDEATHSIG).
3. The step thread never blocks on the front for longer than a send into an 8 MiB socket buffer takes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from engines.batched.live import Request

if TYPE_CHECKING:
    from engines.batched.engine import LLMEngine

log = logging.getLogger("holdfast.engine.batched.front")

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20  # a submit of a 32k-token context is ~100 KB; anything near this is a broken link
SEND_BUFFER = 8 << 20
HELLO_S = 60.0  # the front's start-up (its imports, uvicorn, its routes warmed)
CALL_S = 30.0


class Submit(msgspec.Struct, tag="submit", array_like=True):
    key: int
    request_id: str
    context: list[int]
    max_tokens: int
    temperature: float
    seed: int
    ignore_eos: bool
    resumed: int
    t_arrival: float
    t_received: float


class Abort(msgspec.Struct, tag="abort", array_like=True):
    key: int
    request_id: str


class Call(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    op: str  # "health" | "checksum"


class Mark(msgspec.Struct, tag="mark", array_like=True):
    name: str  # first_arrival, first_held, woken, first_request (perf_counter), loop_late (LoopWatch.recent())
    value: Any


class Hello(msgspec.Struct, tag="hello", array_like=True):
    pid: int


class Out(msgspec.Struct, tag="out", array_like=True):
    items: list[list[Any]]


class Status(msgspec.Struct, tag="status", array_like=True):
    state: str
    role: str


class Reply(msgspec.Struct, tag="reply", array_like=True):
    call_id: int
    value: Any = None
    error: str | None = None


FrontFrame = Submit | Abort | Call | Mark | Hello
EngineFrame = Out | Status | Reply
_encoder = msgspec.msgpack.Encoder(enc_hook=repr)  # an odd value in /health's info says what it is, never fails


def encode(frame: FrontFrame | EngineFrame) -> bytes:
    payload = _encoder.encode(frame)
    return HEADER.pack(len(payload)) + payload


class LinkError(Exception):
    """A frame that is not one: the link is broken (both ends are ours; nothing else writes it)."""


# ---- the engine's end


class RemoteSink:
    """A request's output (live.py `Sink`), called on the step thread: its items wait in the link's pass buffer."""

    __slots__ = ("link", "key", "req")

    def __init__(self, link: FrontLink, key: int) -> None:
        self.link, self.key = link, key
        self.req: Request | None = None

    def token(self, token: int) -> None:
        req = self.req
        if req is not None:  # its first: where its time went goes with it
            self.req = None
            self.link.put([self.key, token, req.t_submit, req.t_intake, req.t_scheduled, req.t_first_token])
        else:
            self.link.put([self.key, token])

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.link.put([self.key, reason, prompt_tokens, completion_tokens])
        self.link.ended(self.key)


class FrontLink:
    """Starts the front process on a socket bound here (so the endpoint is known before it runs and no connection
    is refused while it starts), takes its frames on a thread of its own, hands each pass's output over in one frame
    (`flush`, on the step thread). `engine` is set once the engine serves."""

    def __init__(self, host: str, port: int, front_args: list[str], on_gone: Callable[[], None]) -> None:
        self.engine: LLMEngine | None = None
        self.on_call: Callable[[str], Any] = lambda op: None
        self.on_mark: Callable[[str, Any], None] = lambda name, value: None
        self._on_gone = on_gone
        self._out: list[list[Any]] = []
        self._out_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._open: set[int] = set()  # keys submitted and not ended
        self._hello = threading.Event()
        self._closing = False
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(2048)  # connections queue from here on; the front accepts them
        self.port = listener.getsockname()[1]
        self.endpoint = f"http://{host}:{self.port}"
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        argv = [sys.executable, "-m", "engines.batched.front", "--listen-fd", str(listener.fileno()),
                "--link-fd", str(theirs.fileno()), "--parent-pid", str(os.getpid()), "--host", host, *front_args]
        # a session of its own: a signal to the engine's process group (a terminal's, a supervisor's SIGTERM) is
        # the engine's to handle; the front ends with the link (invariant 2)
        self.proc = subprocess.Popen(argv, pass_fds=(listener.fileno(), theirs.fileno()), start_new_session=True)
        listener.close()
        theirs.close()
        self._reader = threading.Thread(target=self._read, name="front-link", daemon=True)
        self._reader.start()

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def wait_hello(self, timeout: float = HELLO_S) -> None:
        if not self._hello.wait(timeout):
            raise RuntimeError(f"the HTTP front (pid {self.proc.pid}) did not start in {timeout} s "
                               f"(exit code {self.proc.poll()})")

    # step thread
    def put(self, item: list[Any]) -> None:
        with self._out_lock:
            self._out.append(item)

    def ended(self, key: int) -> None:
        self._open.discard(key)

    def flush(self) -> None:
        """The pass's output to the front, one frame (the engine's `flush`, after each pass)."""
        if not self._out:
            return
        with self._out_lock:
            items, self._out = self._out, []
        self.send(Out(items))

    def send(self, frame: EngineFrame) -> None:
        data = encode(frame)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:  # the front is gone: the reader says so (invariant 2)
                pass

    def status(self, state: str, role: str) -> None:
        self.send(Status(state, role))

    def _read(self) -> None:
        decoder = msgspec.msgpack.Decoder(FrontFrame)
        frames = self.sock.makefile("rb")  # a buffered read returns all n bytes, or fewer only at the link's end
        try:
            while True:
                head = frames.read(HEADER.size)
                if len(head) < HEADER.size:
                    break
                (n,) = HEADER.unpack(head)
                if n > MAX_FRAME:
                    raise LinkError(f"a frame of {n} bytes")
                data = frames.read(n)
                if len(data) < n:
                    break
                self._take(decoder.decode(data))
        except (OSError, msgspec.DecodeError, LinkError) as e:
            if not self._closing:
                log.error("the link to the HTTP front broke: %r", e)
        finally:
            frames.close()
        if not self._closing:
            log.error("the HTTP front (pid %d) is gone (exit code %s): the engine stops", self.proc.pid, self.proc.poll())
            self._on_gone()

    def _take(self, frame: FrontFrame) -> None:
        if isinstance(frame, Submit):
            self._submit(frame)
        elif isinstance(frame, Abort):
            if frame.key in self._open and self.engine is not None:  # else it ended already
                self._open.discard(frame.key)
                self.engine.abort(frame.request_id)
        elif isinstance(frame, Call):
            if frame.op == "checksum":  # hashing the weights takes seconds: on a thread of its own
                threading.Thread(target=self._answer, args=(frame,), name="front-checksum", daemon=True).start()
            else:  # /health's body: a copy of counters, answered here (a test polls it every 20 ms)
                self._answer(frame)
        elif isinstance(frame, Mark):
            self.on_mark(frame.name, frame.value)
        else:
            self._hello.set()

    def _submit(self, s: Submit) -> None:
        engine = self.engine
        if engine is None:  # stopping, or a front ahead of its state: the request is refused, not lost
            self.send(Out([[s.key, "refused:not_ready", len(s.context), 0]]))
            return
        sink = RemoteSink(self, s.key)
        req = Request(request_id=s.request_id, context=s.context, max_tokens=s.max_tokens, temperature=s.temperature,
                      seed=s.seed, ignore_eos=s.ignore_eos, sink=sink, resumed=s.resumed, t_arrival=s.t_arrival,
                      t_received=s.t_received)
        sink.req = req
        self._open.add(s.key)
        engine.submit(req)

    def _answer(self, call: Call) -> None:
        try:
            self.send(Reply(call.call_id, self.on_call(call.op)))
        except Exception as e:  # noqa: BLE001 - the call's answer, whatever went wrong
            self.send(Reply(call.call_id, None, f"{type(e).__name__}: {e}"))

    def close(self, timeout: float = 5.0) -> None:
        """The front ends with the link (invariant 2); waited for, then killed."""
        self._closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class EngineSide:
    """The engine's state as its start-up, sleep.py and the front see it: a change of `state` goes to the front at
    once (it holds or refuses requests by it); /health's body is made here (`health`), the recovery's record takes
    the front's marks (`mark`)."""

    def __init__(self, link: FrontLink, engine_id: str, model: str, size: str) -> None:
        self.link = link
        self.engine_id, self.model, self.size = engine_id, model, size
        self.role = "active"
        self.info: dict[str, Any] = {}
        self.engine: LLMEngine | None = None
        self.t_start: float | None = None  # perf_counter of a recovery's start (its assignment, or the process's)
        self._state = "starting"
        link.on_call, link.on_mark = self._call, self.mark

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, new: str) -> None:
        self._state = new
        self.link.status(new, self.role)

    def become(self, new: str) -> None:
        self.state = new

    @property
    def in_flight(self) -> int:
        return self.link.in_flight

    def serve(self, engine: LLMEngine) -> None:
        self.engine = self.link.engine = engine
        engine.flush = self.link.flush

    def health(self) -> dict[str, Any]:
        eng = self.engine
        return {"state": self._state, "role": self.role, "engine": eng.stats() if eng else None, **self.info}

    def mark(self, name: str, value: Any) -> None:
        """A mark the front saw, on the recovery's record (ms after its start; loop_late: the front's loop watch,
        ms after the recovery's wall-clock start)."""
        rec, t0 = self.info.get("recovery"), self.t_start
        if not isinstance(rec, dict) or t0 is None:
            return
        if name == "loop_late":
            wall0 = rec.get("t0_wall")
            if isinstance(wall0, (int, float)):
                rec["loop_late"] = [(round((at - wall0) * 1000, 1), ms, cpu) for at, ms, cpu in value]
        elif f"{name}_ms" not in rec and isinstance(value, (int, float)):
            rec[f"{name}_ms"] = round((value - t0) * 1000, 3)  # before its assignment: negative

    def _call(self, op: str) -> Any:
        if op == "health":
            return self.health()
        if op == "checksum":
            eng = self.engine
            if eng is None:
                return {"error": {"code": "not_ready", "message": f"engine {self.engine_id} is {self._state}"}}
            from engines.reference.weights import checksum_body

            return checksum_body(self.engine_id, eng.runner.w)
        raise ValueError(f"no call {op!r}")


# ---- the front's end


class Delivery(Protocol):
    """Where the front's end hands a request's items (http_state.py `Sink`)."""

    def deliver(self, item: tuple[str, Any]) -> None: ...


class EngineLink:
    """The front's end, on its event loop: submits and aborts requests, asks for /health's and /checksum's bodies,
    hands each `Out` item to its request's sink and each `Status` to `on_status` (the front's state). Its link's end ends the
    front (invariant 2)."""

    def __init__(self, sock: socket.socket, max_num_seqs: int, on_status: Callable[[str, str], None]) -> None:
        self.sock, self.max_num_seqs, self._on_status = sock, max_num_seqs, on_status
        self.sinks: dict[int, Delivery] = {}
        self._keys = iter(range(1, 1 << 62))
        self._calls: dict[int, asyncio.Future[Reply]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # The engine's state is the front's only once its routes are warm (`hello`): their first-use requests
        # get 503 whatever the engine does meanwhile, and nothing is served before.
        self._warm = False
        self._status: Status | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        reader, self._writer = await asyncio.open_unix_connection(sock=self.sock, limit=MAX_FRAME)
        self.loop.create_task(self._read(reader))

    def _send(self, frame: FrontFrame) -> None:
        assert self._writer is not None, "the link is not started"
        self._writer.write(encode(frame))

    def next_key(self) -> int:
        return next(self._keys)

    def submit(self, s: Submit, sink: Delivery) -> None:
        self.sinks[s.key] = sink
        self._send(s)

    def abort(self, key: int, request_id: str) -> None:
        if self.sinks.pop(key, None) is not None:
            self._send(Abort(key, request_id))

    def mark(self, name: str, value: Any) -> None:
        self._send(Mark(name, value))

    def hello(self) -> None:
        """The front serves: the engine is told, and its last state becomes the front's."""
        self._warm = True
        self._send(Hello(os.getpid()))
        if self._status is not None:
            self._apply(self._status)

    def _apply(self, status: Status) -> None:
        self._on_status(status.state, status.role)

    async def call(self, op: str, timeout: float = CALL_S) -> Any:
        call_id = next(self._keys)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(Call(call_id, op))
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if reply.error is not None:
            raise RuntimeError(reply.error)
        return reply.value

    async def _read(self, reader: asyncio.StreamReader) -> None:
        decoder = msgspec.msgpack.Decoder(EngineFrame)
        try:
            while True:
                (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                if n > MAX_FRAME:
                    raise LinkError(f"a frame of {n} bytes")
                frame = decoder.decode(await reader.readexactly(n))
                if isinstance(frame, Out):
                    self._deliver(frame.items)
                elif isinstance(frame, Status):
                    self._status = frame
                    if self._warm:
                        self._apply(frame)
                else:
                    fut = self._calls.get(frame.call_id)
                    if fut is not None and not fut.done():
                        fut.set_result(frame)
        except asyncio.IncompleteReadError:
            pass
        except Exception as e:  # noqa: BLE001 - any broken link ends the front alike
            log.error("the link to the engine broke: %r", e)
        # the engine is gone: every client's connection closes now, as the engine's own death closed them
        logging.shutdown()
        os._exit(0)

    def _deliver(self, items: list[list[Any]]) -> None:
        sinks = self.sinks
        for item in items:
            sink = sinks.get(item[0])
            if sink is None:  # aborted by the front meanwhile
                continue
            second = item[1]
            if isinstance(second, str):
                sinks.pop(item[0], None)
                sink.deliver(("done", (second, item[2], item[3])))
            elif len(item) > 2:  # its first token, with where its time went in the engine
                sink.deliver(("first", (second, *item[2:])))
            else:
                sink.deliver(("token", second))
