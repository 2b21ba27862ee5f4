"""bench/load_recovery.py `summarize`: what counts as lost and mismatched in each mode (pure)."""

from __future__ import annotations

from bench.load_recovery import Stream, released_after_ready, summarize


def _stream(prompt: str, tokens: list[int], *, want: int, done: bool = True, error: str | None = None) -> Stream:
    arrivals = [100.0 + i / 100 for i in range(len(tokens))]
    return Stream(prompt, tokens=tokens, arrivals=arrivals, parsed=list(arrivals), done=done, error=error,
                  sent_at=99.9, want=want)


def _round(streams: list[Stream], late: list[Stream]) -> dict:
    return {"streams": streams, "late": late, "t_kill": 100.0, "workers": []}


def test_a_token_missing_or_repeated_is_lost_in_either_mode() -> None:
    control = _round([_stream("a", [1, 2, 3], want=3), _stream("b", [4, 5, 6], want=3)], [_stream("c", [7], want=1)])
    kill = _round([_stream("a", [1, 2, 3], want=3), _stream("b", [4, 5, 5, 6], want=3)],  # one token twice
                  [_stream("c", [], want=1)])  # ended with nothing
    for det in (True, False):
        out = summarize([kill], control, deterministic=det)
        assert (out["lost"], out["wrong_length"]) == (2, 2)


def test_mismatched_is_compared_in_deterministic_mode_only() -> None:
    control = _round([_stream("a", [1, 2, 3], want=3)], [])
    other = _round([_stream("a", [1, 2, 9], want=3)], [])
    assert summarize([other], control, deterministic=True)["mismatched"] == 1
    fast = summarize([other], control, deterministic=False)
    assert fast["mismatched"] is None and fast["lost"] == 0


def test_an_error_or_no_end_is_lost_once() -> None:
    control = _round([_stream("a", [1, 2], want=2)], [])
    kill = _round([_stream("a", [1], want=2, done=False), _stream("b", [1, 2], want=2, error="reset")], [])
    out = summarize([kill], control)
    assert (out["lost"], out["wrong_length"], out["mismatched"]) == (2, 0, 0)


def test_the_held_requests_release_is_read_from_the_successors_record() -> None:
    assert released_after_ready({"ready_ms": 43.1, "woken_ms": 87.8}) == 44.7
    assert released_after_ready({"ready_ms": 43.1}) is None  # nothing was held: the loop was never woken for it
