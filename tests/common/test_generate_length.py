"""`GenerateRequest.past_context`: a `strict_length` body whose max_tokens the context cannot hold is refused, and
a resume (max_tokens less the tokens resumed, the router's) gets the first attempt's answer. Pure logic."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from libs.common.generate import GenerateRequest


@given(st.integers(1, 60), st.integers(0, 80), st.integers(0, 80), st.integers(2, 128), st.booleans())
def test_a_resume_is_refused_exactly_when_its_first_attempt_was(prompt: int, max_tokens: int, done: int,
                                                                limit: int, strict: bool) -> None:
    first = GenerateRequest(tokens=[1] * prompt, max_tokens=max_tokens, strict_length=strict)
    refused = first.past_context(prompt, limit) is not None
    assert refused == (strict and prompt + max_tokens > limit)
    done = min(done, max_tokens)
    resumed = GenerateRequest(tokens=[1] * prompt, resume=[2] * done, max_tokens=max_tokens - done,
                              strict_length=strict)
    why = resumed.past_context(prompt + done, limit)
    assert (why is not None) == refused
    if why is not None:
        assert why == first.past_context(prompt, limit)  # the client's own figures, not the attempt's
