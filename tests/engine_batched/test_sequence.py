"""The sequence status table and the request types (engines/batched/sequence.py)."""

from __future__ import annotations

import itertools
import math

import pytest

from engines.batched.sequence import (
    TRANSITIONS,
    InvalidRequest,
    InvalidTransition,
    SamplingParams,
    SeqStatus,
    Sequence,
    transition,
)

ALLOWED = {
    (SeqStatus.WAITING, SeqStatus.RUNNING),
    (SeqStatus.WAITING, SeqStatus.FINISHED),
    (SeqStatus.RUNNING, SeqStatus.PREEMPTED),
    (SeqStatus.RUNNING, SeqStatus.FINISHED),
    (SeqStatus.PREEMPTED, SeqStatus.WAITING),
}


def seq_in(status: SeqStatus) -> Sequence:
    s = Sequence.from_prompt(1, "r", [1, 2, 3])
    s.status = status
    return s


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(SeqStatus, SeqStatus)))
def test_a_move_succeeds_exactly_when_the_table_allows_it(src: SeqStatus, dst: SeqStatus) -> None:
    s = seq_in(src)
    if (src, dst) in ALLOWED:
        transition(s, dst)
        assert s.status is dst
    else:
        with pytest.raises(InvalidTransition, match=f"{src.value} -> {dst.value}"):
            transition(s, dst)
        assert s.status is src


def test_the_table_is_frozen_and_finished_is_final() -> None:
    assert TRANSITIONS[SeqStatus.FINISHED] == frozenset()
    with pytest.raises(TypeError):
        TRANSITIONS[SeqStatus.FINISHED] = frozenset({SeqStatus.WAITING})  # type: ignore[index]


def test_a_preempted_sequence_can_only_go_back_to_waiting() -> None:
    s = seq_in(SeqStatus.RUNNING)
    transition(s, SeqStatus.PREEMPTED)
    with pytest.raises(InvalidTransition):
        transition(s, SeqStatus.RUNNING)
    transition(s, SeqStatus.WAITING)
    transition(s, SeqStatus.RUNNING)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": 2.5}, {"max_tokens": True},
    {"temperature": -0.1}, {"temperature": math.nan}, {"temperature": "hot"},
    {"stop_token_ids": [3, -1]}, {"stop_token_ids": ["a"]},
])
def test_bad_sampling_parameters_are_refused_with_a_typed_error(kwargs: dict) -> None:
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


def test_sampling_parameters_are_frozen_and_keep_stop_ids_as_a_set() -> None:
    p = SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop_token_ids=[7, 7, 9], ignore_eos=True)
    assert p.stop_token_ids == frozenset({7, 9})
    with pytest.raises(AttributeError):
        p.max_tokens = 6  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop_token_ids={9, 7},
                                          ignore_eos=True))


def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="empty prompt"):
        Sequence.from_prompt(1, "r", [])
    with pytest.raises(InvalidRequest):
        Sequence(1, "r", [1, 2], prompt_len=3)


def test_a_sequence_knows_its_output_and_whether_it_decodes() -> None:
    s = Sequence(4, "r4", [5, 6, 7, 8], prompt_len=3)
    assert (s.num_tokens, s.num_output, s.output) == (4, 1, [8])
    assert not s.in_decode
    s.num_computed = 3
    assert s.in_decode
    assert s.status is SeqStatus.WAITING and s.block_table == [] and s.arrival == -1
