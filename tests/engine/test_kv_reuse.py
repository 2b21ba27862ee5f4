"""A predecessor's KV cache reused by its successor (engines/reference/kv_reuse.py), in process: two engine
cores over the same weights, the first stopped mid-generation as a killed engine would be, the second resuming
its request from the first one's cache and marks (tiny size, CPU)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engines.reference.config import get_config
from engines.reference.engine import EngineCore, GenerationRequest, TokenOut
from engines.reference.kv_reuse import (
    UNMARKED,
    KvDonor,
    in_flight,
    marks_shape,
    reusable_prefix,
    sampled_mark,
)
from engines.reference.model import Transformer
from engines.reference.weights import load_weights, make_weights

CFG = get_config("tiny")
SLOTS, MAX_SEQ = 2, 256
PROMPT = [256, *b"Holdfast keeps the cache"]  # BOS + bytes
N_TOKENS = 12
NOTHING_CONTINUED = {"requests": 0, "positions": 0, "refused": 0, "continued": 0, "continued_taken": 0}


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    return load_weights(make_weights(CFG, tmp_path_factory.mktemp("w") / "tiny.safetensors"))


def new_core(weights: dict[str, torch.Tensor], *, graphs: bool, donor: KvDonor | None = None) -> EngineCore:
    kv = torch.zeros(CFG.kv_shape(SLOTS, MAX_SEQ))
    marks = torch.zeros(marks_shape(SLOTS, MAX_SEQ), dtype=torch.int64)
    return EngineCore(Transformer(CFG, weights), kv, prefill_chunk=8, graphs=graphs, marks=marks, donor=donor)


def marks_of(core: EngineCore) -> torch.Tensor:
    assert core.marks is not None
    return core.marks.marks


def request(context: list[int], prefix_len: int) -> GenerationRequest:
    return GenerationRequest(context=context, max_tokens=N_TOKENS - (len(context) - prefix_len),
                             prefix_len=prefix_len, ignore_eos=True)


def tokens_of(core: EngineCore, req: GenerationRequest) -> list[int]:
    return [e.token for e in core.generate(req) if isinstance(e, TokenOut)]


KILLED: list[Iterator[object]] = []  # generations stopped where they stood: not closed, as in a SIGKILLed engine


@pytest.fixture(autouse=True)
def _close_killed() -> Iterator[None]:
    """Each test's 'killed' generations end with it (a generator alive at the interpreter's exit aborts it)."""
    yield
    while KILLED:
        KILLED.pop().close()  # type: ignore[attr-defined]


def killed_after(core: EngineCore, k: int) -> list[int]:
    """The first `k` tokens of the prompt's generation; then the generation stops where it stands, its last
    token sent and not fed (its slot held, its cache and marks left as in a SIGKILLed engine's lease)."""
    it = core.generate(request(PROMPT, len(PROMPT)))
    got = [next(it).token for _ in range(k)]  # type: ignore[union-attr]
    KILLED.append(it)
    return got


def killed_mid_generation(weights: dict[str, torch.Tensor], k: int, *, graphs: bool = False
                          ) -> tuple[list[int], EngineCore, list[int]]:
    """The whole uninterrupted generation, and a predecessor killed after sending its first `k` tokens."""
    whole = tokens_of(new_core(weights, graphs=graphs), request(PROMPT, len(PROMPT)))
    predecessor = new_core(weights, graphs=graphs)
    return whole, predecessor, killed_after(predecessor, k)


def reused_by_the_next_generation(core: EngineCore, req: GenerationRequest) -> tuple[list[int], float]:
    phases: dict[str, float] = {}
    core.trace_next(phases, 0.0)
    return tokens_of(core, req), phases["kv_reused"]


def test_a_reusable_prefix_covers_the_whole_prompt_matches_every_token_and_leaves_the_last_one() -> None:
    row = torch.tensor([3, 10, 11, 12, 13, 14, UNMARKED, UNMARKED])
    assert reusable_prefix(row, 3, [10, 11, 12, 13, 14]) == 4  # the last position is computed again
    assert reusable_prefix(row, 3, [10, 11, 12, 13, 14, 15, 16]) == 5
    assert reusable_prefix(row, 3, [10, 11, 12, 99, 14, 15]) == 3  # up to the first mismatch
    assert reusable_prefix(row, 3, [10, 11, 99, 13, 14]) == 0  # not the whole prompt
    assert reusable_prefix(row, 2, [10, 11, 12, 13, 14]) == 0  # another prompt length: other forwards
    assert reusable_prefix(row, 3, [10, 11, 12]) == 0  # nothing resumed: the prompt's logits are needed
    assert reusable_prefix(torch.tensor([0, UNMARKED, UNMARKED]), 0, [1, 2]) == 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
def test_a_resumed_request_copies_its_prefix_from_the_predecessors_cache_and_continues_exactly(
        weights: dict[str, torch.Tensor], graphs: bool) -> None:
    whole, predecessor, first = killed_mid_generation(weights, 5, graphs=graphs)
    assert first == whole[:5]
    # The 5th token was sampled and sent, never fed: its keys and values are not there, nor vouched for.
    assert int((marks_of(predecessor)[:, 1:] >= 0).sum()) == len(PROMPT) + 4
    assert [row for row in map(in_flight, marks_of(predecessor)) if row] == [(PROMPT + first, len(PROMPT))]

    successor = new_core(weights, graphs=graphs, donor=KvDonor(predecessor.kv, marks_of(predecessor)))
    got, reused = reused_by_the_next_generation(successor, request(PROMPT + first, len(PROMPT)))
    assert got == whole[5:]
    assert reused == len(PROMPT) + 4  # all but the last resumed token: one forward instead of 1 + 5
    assert successor.kv_reuse() == {**NOTHING_CONTINUED, "requests": 1, "positions": len(PROMPT) + 4}


def test_the_successor_marks_what_it_copied_so_its_own_successor_can_reuse_it_again(
        weights: dict[str, torch.Tensor]) -> None:
    whole = tokens_of(new_core(weights, graphs=False), request(PROMPT, len(PROMPT)))
    first = new_core(weights, graphs=False)
    killed_after(first, 3)
    second = new_core(weights, graphs=False, donor=KvDonor(first.kv, marks_of(first)))
    it = second.generate(request(PROMPT + whole[:3], len(PROMPT)))
    more = [next(it).token for _ in range(4)]  # type: ignore[union-attr]
    it.close()
    assert more == whole[3:7]
    third = new_core(weights, graphs=False, donor=KvDonor(second.kv, marks_of(second)))
    got, reused = reused_by_the_next_generation(third, request(PROMPT + whole[:7], len(PROMPT)))
    assert got == whole[7:] and reused == len(PROMPT) + 6


def test_a_prefix_marked_for_other_tokens_or_another_prompt_length_is_not_reused(
        weights: dict[str, torch.Tensor]) -> None:
    whole, predecessor, first = killed_mid_generation(weights, 5)
    donor = KvDonor(predecessor.kv, marks_of(predecessor))

    other_prompt = [256, *b"Another prompt entirely, longer"]
    core = new_core(weights, graphs=False, donor=donor)
    assert reused_by_the_next_generation(core, request(other_prompt + first, len(other_prompt)))[1] == 0
    # The same tokens counted as a longer prompt are prefilled in other chunks: other bits, not reused.
    assert reused_by_the_next_generation(core, request(PROMPT + first, len(PROMPT) + 2))[1] == 0
    # A resumed token that differs from the predecessor's: the prefix up to it only; the rest computed.
    changed = first[:2] + [(first[2] + 1) % 256] + first[3:]
    assert reused_by_the_next_generation(core, request(PROMPT + changed, len(PROMPT)))[1] == len(PROMPT) + 2
    got, reused = reused_by_the_next_generation(core, request(PROMPT + first, len(PROMPT)))
    assert got == whole[5:] and reused == len(PROMPT) + 4


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
def test_a_generation_in_flight_is_continued_before_its_request_returns_which_then_takes_it(
        weights: dict[str, torch.Tensor], graphs: bool) -> None:
    whole, predecessor, first = killed_mid_generation(weights, 5, graphs=graphs)
    successor = new_core(weights, graphs=graphs, donor=KvDonor(predecessor.kv, marks_of(predecessor)))
    assert successor.continue_in_flight() == 1 and successor.free_slots() == SLOTS - 1

    phases: dict[str, float] = {}
    successor.trace_next(phases, 0.0)
    assert tokens_of(successor, request(PROMPT + first, len(PROMPT))) == whole[5:]
    assert "continued" in phases and "prefill_launched" not in phases and phases["kv_reused"] == len(PROMPT) + 4
    assert successor.kv_reuse() == {"requests": 1, "positions": len(PROMPT) + 4, "refused": 0, "continued": 1,
                                    "continued_taken": 1}
    assert successor.free_slots() == SLOTS


def test_a_continuation_no_request_takes_yields_its_slot_to_a_request_short_of_one_and_is_dropped_at_retirement(
        weights: dict[str, torch.Tensor]) -> None:
    whole, predecessor, first = killed_mid_generation(weights, 3)
    successor = new_core(weights, graphs=False, donor=KvDonor(predecessor.kv, marks_of(predecessor)))
    assert successor.continue_in_flight() == 1 and successor.free_slots() == SLOTS - 1
    busy = successor.generate(request(PROMPT, len(PROMPT)))  # another context: not the continuation's
    next(busy)
    assert successor.free_slots() == 0
    assert len(tokens_of(successor, GenerationRequest(context=[256, 1, 2], max_tokens=2))) == 2  # its slot taken
    assert successor.kv_reuse()["continued_taken"] == 0  # type: ignore[index]
    busy.close()
    # The request coming back after all runs its forward itself, and continues the same.
    got, reused = reused_by_the_next_generation(successor, request(PROMPT + first, len(PROMPT)))
    assert got == whole[3:] and reused == len(PROMPT) + 2

    again = new_core(weights, graphs=False, donor=KvDonor(predecessor.kv, marks_of(predecessor)))
    assert again.continue_in_flight() == 1 and again.free_slots() == SLOTS - 1
    again.retire_donor()
    assert again.free_slots() == SLOTS
    assert again.kv_reuse() == {**NOTHING_CONTINUED, "requests": 1, "positions": len(PROMPT) + 2, "continued": 1}


class RewrittenMeanwhile(KvDonor):
    """A predecessor still alive that starts another request in the slot while it is being copied."""

    def _read_again(self, slot: int, m: int) -> torch.Tensor:
        self.marks[slot, 1:].fill_(UNMARKED)
        return super()._read_again(slot, m)


def test_a_copy_whose_marks_changed_under_it_is_not_used_and_the_request_is_computed_whole(
        weights: dict[str, torch.Tensor]) -> None:
    whole, predecessor, first = killed_mid_generation(weights, 5)
    core = new_core(weights, graphs=False, donor=RewrittenMeanwhile(predecessor.kv, marks_of(predecessor)))
    got, reused = reused_by_the_next_generation(core, request(PROMPT + first, len(PROMPT)))
    assert got == whole[5:] and reused == 0
    assert core.kv_reuse() == {**NOTHING_CONTINUED, "refused": 1}


def test_a_slot_taken_by_a_new_request_vouches_for_nothing_of_the_old_one(weights: dict[str, torch.Tensor]) -> None:
    core = new_core(weights, graphs=False)
    tokens_of(core, request(PROMPT, len(PROMPT)))
    slot = next(s for s in range(SLOTS) if int(marks_of(core)[s, 0]) == len(PROMPT))
    assert core.free_slots() == SLOTS  # the slot just given back is the next one taken
    it = core.generate(GenerationRequest(context=[256, 7], max_tokens=1))
    tok = next(it).token  # type: ignore[union-attr]
    row = marks_of(core)[slot]
    assert int(row[0]) == 2 and row[1:3].tolist() == [256, 7] and bool((row[4:] == UNMARKED).all())
    assert int(row[3]) == sampled_mark(tok)  # sent, not fed: in flight
    assert list(it)[-1].completion_tokens == 1  # type: ignore[union-attr]
    assert int(row[3]) == UNMARKED and in_flight(row) is None  # ended: nothing in flight any more


def test_a_retired_donor_is_read_no_more_and_its_memory_is_given_back(weights: dict[str, torch.Tensor]) -> None:
    predecessor = new_core(weights, graphs=False)
    first = killed_after(predecessor, 2)
    given_back: list[bool] = []
    core = new_core(weights, graphs=False, donor=KvDonor(predecessor.kv, marks_of(predecessor),
                                                         on_retire=lambda: given_back.append(True)))
    core.retire_donor()
    assert given_back == [True] and core.donor is None
    assert reused_by_the_next_generation(core, request(PROMPT + first, len(PROMPT)))[1] == 0
    assert core.kv_reuse() == NOTHING_CONTINUED


def test_a_donor_of_another_layout_is_not_used(weights: dict[str, torch.Tensor], tmp_path: Path) -> None:
    other = get_config("tiny@2")
    donor = KvDonor(torch.zeros(other.kv_shape(SLOTS, MAX_SEQ)), torch.zeros(marks_shape(SLOTS, MAX_SEQ),
                                                                              dtype=torch.int64))
    assert new_core(weights, graphs=False, donor=donor).donor is None


def handed_on(predecessor: EngineCore, weights: dict[str, torch.Tensor], *, graphs: bool) -> EngineCore:
    """A successor over the predecessor's very cache and marks: the KV lease handed on (a reattach, a
    cold-spawned takeover), not shared."""
    return EngineCore(Transformer(CFG, weights), predecessor.kv, prefill_chunk=8, graphs=graphs,
                      marks=marks_of(predecessor), inherit=True)


def held_slot(core: EngineCore) -> int:
    assert core.inherited is not None
    (slot,) = core.inherited.held
    return slot


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
def test_a_successor_handed_the_cache_itself_serves_the_resumed_request_in_the_slot_that_holds_it_exactly(
        weights: dict[str, torch.Tensor], graphs: bool) -> None:
    whole, predecessor, first = killed_mid_generation(weights, 5, graphs=graphs)
    other = [s for s in range(SLOTS) if int(marks_of(predecessor)[s, 0]) != len(PROMPT)]
    marks_of(predecessor)[other[0], 0] = 3  # a stale prompt length with no finished prompt: not held
    successor = handed_on(predecessor, weights, graphs=graphs)
    slot = held_slot(successor)
    assert successor.free_slots() == SLOTS - 1  # the held slot is no new request's
    assert int(marks_of(successor)[slot, 0]) == len(PROMPT)  # its marks still vouch for what it holds
    assert bool((marks_of(successor)[other[0]] == UNMARKED).all())  # the others vouch for nothing

    busy = successor.generate(GenerationRequest(context=[256, 9, 9, 9], max_tokens=3))  # not in its way
    next(busy)
    got, reused = reused_by_the_next_generation(successor, request(PROMPT + first, len(PROMPT)))
    busy.close()
    assert got == whole[5:]
    assert reused == len(PROMPT) + 4  # one forward instead of 1 + 5, and no copy
    assert successor.kv_reuse() == {**NOTHING_CONTINUED, "requests": 1, "positions": len(PROMPT) + 4, "held": 0}
    assert successor.free_slots() == SLOTS


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
def test_a_generation_in_flight_in_a_handed_on_cache_is_continued_in_its_own_slot_and_taken_by_its_request(
        weights: dict[str, torch.Tensor], graphs: bool) -> None:
    whole, predecessor, first = killed_mid_generation(weights, 5, graphs=graphs)
    successor = handed_on(predecessor, weights, graphs=graphs)
    slot = held_slot(successor)
    assert successor.continue_in_flight() == 1 and successor.free_slots() == SLOTS - 1

    phases: dict[str, float] = {}
    successor.trace_next(phases, 0.0)
    it = successor.generate(request(PROMPT + first, len(PROMPT)))
    got = [next(it).token]  # type: ignore[union-attr]
    assert int(marks_of(successor)[slot, 0]) == len(PROMPT)  # served in the slot that held it
    got += [e.token for e in it if isinstance(e, TokenOut)]
    assert got == whole[5:] and "continued" in phases and "prefill_launched" not in phases
    assert successor.kv_reuse() == {"requests": 1, "positions": len(PROMPT) + 4, "refused": 0, "held": 0,
                                    "continued": 1, "continued_taken": 1}


def test_a_held_slot_yields_to_a_request_short_of_one_and_its_request_is_then_computed_whole(
        weights: dict[str, torch.Tensor]) -> None:
    whole, predecessor, first = killed_mid_generation(weights, 3)
    successor = handed_on(predecessor, weights, graphs=False)
    held_slot(successor)
    busy = successor.generate(GenerationRequest(context=[256, 9, 9, 9], max_tokens=3))
    next(busy)
    assert successor.free_slots() == 0
    assert len(tokens_of(successor, GenerationRequest(context=[256, 1, 2], max_tokens=2))) == 2  # the held slot
    busy.close()
    assert successor.inherited is not None and successor.inherited.held == []
    got, reused = reused_by_the_next_generation(successor, request(PROMPT + first, len(PROMPT)))
    assert got == whole[3:] and reused == 0


def test_slots_still_held_when_the_window_ends_are_free_again(weights: dict[str, torch.Tensor]) -> None:
    _, predecessor, first = killed_mid_generation(weights, 2)
    successor = handed_on(predecessor, weights, graphs=False)
    held_slot(successor)
    successor.retire_donor()
    assert successor.free_slots() == SLOTS
    assert reused_by_the_next_generation(successor, request(PROMPT + first, len(PROMPT)))[1] == 0
    assert successor.kv_reuse() == {**NOTHING_CONTINUED, "held": 0}


def test_a_cache_handed_on_with_inheritance_off_vouches_for_nothing(weights: dict[str, torch.Tensor]) -> None:
    _, predecessor, first = killed_mid_generation(weights, 2)
    successor = EngineCore(Transformer(CFG, weights), predecessor.kv, prefill_chunk=8, graphs=False,
                           marks=marks_of(predecessor))
    assert successor.inherited is None and successor.free_slots() == SLOTS
    assert bool((marks_of(successor) == UNMARKED).all()) and successor.kv_reuse() is None


def killed_on_cuda(tmp_path: Path) -> tuple[Callable[..., EngineCore], list[int], EngineCore, list[int]]:
    """On CUDA with graphs: a core factory, the uninterrupted generation, and a predecessor killed after sending 5
    tokens, whose graphs were captured while that request was live (the capture's warm-up writes and restores
    its positions)."""
    dev = torch.device("cuda")
    w = load_weights(make_weights(CFG, tmp_path / "tiny.safetensors"), dev)

    def core_on_cuda(donor: KvDonor | None = None, handed: EngineCore | None = None) -> EngineCore:
        kv = torch.zeros(CFG.kv_shape(SLOTS, MAX_SEQ), device=dev) if handed is None else handed.kv
        marks = (torch.zeros(marks_shape(SLOTS, MAX_SEQ), dtype=torch.int64, device=dev) if handed is None
                 else marks_of(handed))
        return EngineCore(Transformer(CFG, w), kv, prefill_chunk=8, graphs=True, marks=marks, donor=donor,
                          inherit=handed is not None)

    reference = core_on_cuda()
    reference.warm()
    whole = tokens_of(reference, request(PROMPT, len(PROMPT)))
    predecessor = core_on_cuda()  # serves before its graphs exist, captures them while a request is live
    it = predecessor.generate(request(PROMPT, len(PROMPT)))
    first = [next(it).token for _ in range(3)]  # type: ignore[union-attr]
    predecessor.capture_graphs_in_background().join()  # type: ignore[union-attr]
    first += [next(it).token for _ in range(2)]  # type: ignore[union-attr]
    KILLED.append(it)
    torch.cuda.synchronize()
    assert first == whole[:5]
    assert int((marks_of(predecessor)[:, 1:] >= 0).sum()) == len(PROMPT) + 4
    return core_on_cuda, whole, predecessor, first


@pytest.mark.gpu
def test_on_cuda_with_graphs_a_resumed_request_reuses_the_predecessors_cache_and_continues_exactly(
        tmp_path: Path) -> None:
    """The CUDA path: graphs captured on both sides, the copy on a stream of its own."""
    core_on_cuda, whole, predecessor, first = killed_on_cuda(tmp_path)
    successor = core_on_cuda(KvDonor(predecessor.kv, marks_of(predecessor)))
    successor.warm()
    assert successor.continue_in_flight() == 1
    got, reused = reused_by_the_next_generation(successor, request(PROMPT + first, len(PROMPT)))
    assert got == whole[5:] and reused == len(PROMPT) + 4
    successor.retire_donor()
    assert successor.kv_reuse() == {"requests": 1, "positions": len(PROMPT) + 4, "refused": 0, "continued": 1,
                                    "continued_taken": 1}


@pytest.mark.gpu
def test_on_cuda_with_graphs_a_cache_handed_on_serves_the_resumed_request_in_place_exactly(tmp_path: Path) -> None:
    """The handed-on path on CUDA: the held slot is not zeroed, its graphs are captured while it is held, and the
    generation in flight continues in it."""
    core_on_cuda, whole, predecessor, first = killed_on_cuda(tmp_path)
    successor = core_on_cuda(handed=predecessor)
    assert successor.continue_in_flight() == 1
    successor.capture_graphs_in_background().join()  # type: ignore[union-attr]
    got, reused = reused_by_the_next_generation(successor, request(PROMPT + first, len(PROMPT)))
    assert got == whole[5:] and reused == len(PROMPT) + 4
    assert successor.kv_reuse() == {"requests": 1, "positions": len(PROMPT) + 4, "refused": 0, "held": 0,
                                    "continued": 1, "continued_taken": 1}


class FakeLease:
    """What split_tensors reads of a mapped lease: its id, creation time and named tensors."""

    def __init__(self, lease_id: str, created_at: float, tensors: dict[str, torch.Tensor]) -> None:
        self.id = lease_id
        self.info = type("Info", (), {"created_at": created_at})()
        self.tensor_metas = [type("Meta", (), {"name": name})() for name in tensors]
        self._tensors = tensors

    def view(self, meta: object, framework: str) -> torch.Tensor:
        return self._tensors[meta.name]  # type: ignore[attr-defined]


def test_of_two_kv_leases_the_newest_is_the_cache_and_the_older_one_comes_after_it_for_release(
        weights: dict[str, torch.Tensor]) -> None:
    """An engine that took a predecessor's place holds, for a while, that predecessor's KV lease beside its own
    (its donor); whoever takes its leases next uses its own cache and gives the other back."""
    from engines.reference.memory import split_tensors

    def cache(fill: int) -> dict[str, torch.Tensor]:
        return {"kv_cache": torch.full(CFG.kv_shape(1, 8), float(fill)),
                "kv_marks": torch.full(marks_shape(1, 8), fill, dtype=torch.int64)}

    leases = [FakeLease("W", 1.0, dict(weights)), FakeLease("KV-old", 2.0, cache(1)), FakeLease("KV-own", 3.0, cache(2))]
    for order in (leases, leases[::-1]):
        got_weights, kv, marks, caches = split_tensors(CFG, order)  # type: ignore[arg-type]
        assert set(got_weights) == set(weights) and kv is not None and marks is not None
        assert float(kv.flatten()[0]) == 2.0 and int(marks.flatten()[0]) == 2 and caches == ["KV-own", "KV-old"]
