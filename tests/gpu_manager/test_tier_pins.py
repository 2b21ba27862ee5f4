"""The host tier's registrations (tier_pins.py, pure): the table is never held while a copy is registered or
unregistered (on an H200 registering 96 GiB took 17 s, and the health reply, which reads `bytes` on the event loop,
waited behind it: `nats: timeout`), and the users/retire rules hold. The registration here is a stand-in that
blocks until the test lets it go (pure logic: no CUDA)."""

from __future__ import annotations

import threading
import time

import pytest

from libs.common.errors import HoldfastError
from services.gpu_manager.artifact import FORMAT_VERSION, HASH, FileEntry, Manifest
from services.gpu_manager.tier_pins import TierPins

MIB = 1024 * 1024
PROMPT_S = 0.5  # far above a dict walk under a lock, far below a registration the test holds open


def manifest(name: str, root: str = "r1", size: int = 4 * MIB) -> Manifest:
    return Manifest(version=FORMAT_VERSION, name=name, size=size, tag="weights", lease_name="w", engine_class="c",
                    source_lease="lease-1", layout_hash="h", tensors=[], block_bytes=MIB, file_bytes=size,
                    files=[FileEntry(name="data-000.bin", bytes=size)], hash=HASH, blocks=[], root=root, node="n",
                    created_at=1.0, write_s=0.1)


class Held:
    """A registration that takes as long as the test says: `entered` once begun, finished by `go`; its `close`
    too waits for `go_close` (unregistering 96 GiB takes seconds)."""

    made: list[Held] = []

    def __init__(self, gate: threading.Event, entered: threading.Event, fail: bool = False) -> None:
        entered.set()
        gate.wait(30)
        if fail:
            raise HoldfastError("refused")
        self.sizes, self.register_s, self.closed = [4 * MIB], 0.25, False
        self.go_close = threading.Event()
        self.go_close.set()
        Held.made.append(self)

    def close(self) -> None:
        self.go_close.wait(30)
        self.closed = True


def prompt(fn):  # noqa: ANN001, ANN201
    """fn() from another thread: its value, or a failure if it did not return within PROMPT_S."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(PROMPT_S)
    assert out, f"waited more than {PROMPT_S} s (still waiting after {time.perf_counter() - t0:.2f} s)"
    return out[0]


def pins_with(gate: threading.Event, entered: threading.Event, fail: bool = False) -> TierPins:
    return TierPins(lambda fds, sizes, ordinal: Held(gate, entered, fail))


def test_the_registered_bytes_and_other_copies_are_read_while_a_copy_is_being_registered():
    gate, entered = threading.Event(), threading.Event()
    pins = pins_with(gate, entered)
    gate.set()
    assert pins.pin(manifest("a"), [], 0) == 0.25  # `a` registered
    gate.clear()
    entered.clear()
    writer = threading.Thread(target=lambda: pins.pin(manifest("b"), [], 0), daemon=True)
    writer.start()
    assert entered.wait(5)  # `b` is being registered now
    try:
        assert prompt(pins.bytes) == 4 * MIB  # a's only: b is not registered yet
        assert prompt(pins.held) == ["a"]
        copy, took = prompt(lambda: pins.acquire(manifest("a"), [], 0))  # another copy's restore goes on
        assert took == 0.0
        pins.release(copy)
    finally:
        gate.set()
        writer.join(10)
    assert pins.bytes() == 8 * MIB and pins.held() == ["a", "b"]


def test_a_copy_is_registered_once_by_two_callers_at_once():
    gate, entered = threading.Event(), threading.Event()
    pins = pins_with(gate, entered)
    Held.made.clear()
    got: list = []
    callers = [threading.Thread(target=lambda: got.append(pins.acquire(manifest("a"), [], 0)), daemon=True)
               for _ in range(2)]
    for t in callers:
        t.start()
    assert entered.wait(5)
    gate.set()
    for t in callers:
        t.join(10)
    assert len(Held.made) == 1 and got[0][0] is got[1][0]
    assert sorted(took for _, took in got) == [0.0, 0.25]  # the one that registered says what it cost
    pins.prune({})
    assert not Held.made[0].closed  # two users still read it (invariant 1)
    pins.release(got[0][0])
    pins.release(got[1][0])
    assert Held.made[0].closed and pins.bytes() == 0


def test_the_table_is_read_while_a_replaced_copy_is_unregistered():
    gate, entered = threading.Event(), threading.Event()
    gate.set()
    pins = pins_with(gate, entered)
    Held.made.clear()
    assert pins.pin(manifest("a"), [], 0) == 0.25
    old = Held.made[0]
    old.go_close.clear()  # its unregistering takes long
    pruner = threading.Thread(target=lambda: pins.prune({"a": manifest("a", root="r2")}), daemon=True)
    pruner.start()
    try:
        assert prompt(pins.held) == []  # retired at once (invariant 2), closed off the table's lock
        assert prompt(pins.bytes) == 0
    finally:
        old.go_close.set()
        pruner.join(10)
    assert old.closed


def test_a_refused_registration_leaves_nothing_and_is_tried_again():
    gate, entered = threading.Event(), threading.Event()
    gate.set()
    refusing = pins_with(gate, entered, fail=True)
    assert refusing.pin(manifest("a"), [], 0) is None
    assert refusing.held() == [] and refusing.bytes() == 0
    with pytest.raises(HoldfastError):
        refusing.acquire(manifest("a"), [], 0)
