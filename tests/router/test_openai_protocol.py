"""The OpenAI layer's pure logic: bodies to jobs, the chat template, stop strings over split text, shapes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.common import tokenizer
from services.router import openai_format as fmt
from services.router.openai_protocol import UNBOUNDED, OpenAIError, chat_job, completion_job, refusal
from services.router.stop_scan import StopScanner


def test_a_chat_is_rendered_with_the_documented_template_and_counted_with_the_engines_tokenizer() -> None:
    job = chat_job({"model": "m", "messages": [{"role": "developer", "content": "Be brief."},
                                               {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert job.generate.prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert job.prompt_tokens == len(tokenizer.encode(job.generate.prompt))
    assert job.generate.max_tokens == UNBOUNDED and job.generate.temperature == 1.0
    assert job.request_id.startswith("chatcmpl-") and job.kind == "chat"


def test_max_completion_tokens_bounds_a_chat_and_both_limits_at_once_are_refused() -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert chat_job({"model": "m", "messages": msgs, "max_completion_tokens": 7}).generate.max_tokens == 7
    with pytest.raises(OpenAIError) as e:
        chat_job({"model": "m", "messages": msgs, "max_completion_tokens": 7, "max_tokens": 7})
    assert e.value.status == 400 and e.value.param == "max_tokens"


def test_a_completion_takes_a_string_one_string_in_a_list_or_token_ids() -> None:
    assert completion_job({"model": "m", "prompt": ["ab"]}).generate.prompt == "ab"
    job = completion_job({"model": "m", "prompt": [65, 66], "stop": "x", "temperature": 0, "seed": 3})
    assert job.generate.tokens == [65, 66] and job.generate.prompt is None and job.prompt_tokens == 2
    assert job.stops == ("x",) and job.generate.max_tokens == 16 and job.generate.seed == 3
    assert job.request_id.startswith("cmpl-")


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "top_p": 0.5}, "top_p"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, None),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({}, "prompt"),
])
def test_a_completion_body_we_cannot_honour_is_refused_with_a_400_naming_the_field(body: dict, param: str | None) -> None:
    with pytest.raises(OpenAIError) as e:
        completion_job({"model": "m", **body})
    assert e.value.status == 400 and e.value.param == param, e.value.message
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


def test_an_assistant_message_sent_back_as_received_and_a_list_of_one_token_list_are_accepted() -> None:
    """Multi-turn: the official client's `message.model_dump()` carries `refusal`, `tool_calls`, `function_call`,
    `audio` and `annotations`, null (each was a 400 `Unrecognized request argument`); one set is refused."""
    sent_back = {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None, "function_call": None,
                 "audio": None, "annotations": []}
    job = chat_job({"model": "m", "messages": [{"role": "user", "content": "hi"}, sent_back,
                                               {"role": "user", "content": "and?"}]})
    assert job.generate.prompt == "<|user|>\nhi\n<|assistant|>\nhello\n<|user|>\nand?\n<|assistant|>\n"
    for field, value in (("refusal", "no"), ("tool_calls", [{"id": "1"}]), ("audio", {"id": "a"})):
        with pytest.raises(OpenAIError) as e:
            chat_job({"model": "m", "messages": [{**sent_back, field: value}]})
        assert e.value.param is not None and e.value.param.startswith(f"messages.0.{field}"), e.value.message
    job = completion_job({"model": "m", "prompt": [[65, 66]]})  # OpenAI's batch form, of one prompt
    assert job.generate.tokens == [65, 66] and job.prompt_tokens == 2
    for prompt in ([[65], [66]], [[]]):
        with pytest.raises(OpenAIError) as e:
            completion_job({"model": "m", "prompt": prompt})
        assert e.value.param == "prompt", e.value.message
    options = {"include_usage": True, "include_obfuscation": False}  # current SDKs' option: nothing to leave out
    assert completion_job({"model": "m", "prompt": "x", "stream": True, "stream_options": options}).include_usage


def test_a_non_object_body_and_an_unknown_role_are_400s() -> None:
    with pytest.raises(OpenAIError):
        completion_job(["not", "an", "object"])
    with pytest.raises(OpenAIError) as e:
        chat_job({"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
    assert e.value.param == "messages.0.role"


def _scan(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, bool]:
    s = StopScanner(stops)
    out = "".join(s.push(p) for p in pieces)
    return out + s.flush(), s.stopped


@given(st.text(alphabet="abc", max_size=40), st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
       st.data())
def test_the_text_let_out_stops_before_the_stop_string_complete_first_however_the_text_is_split(
        text: str, stops: list[str], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    ends = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    out, stopped = _scan(pieces, tuple(stops))
    assert out == (text[:min(ends)[1]] if ends else text)
    assert stopped == bool(ends)


def test_a_stop_string_complete_first_wins_over_one_that_began_earlier() -> None:
    assert _scan(["bba", "a"], ("a", "baa")) == ("bb", True)
    assert _scan(["bbaa"], ("a", "baa")) == ("bb", True)  # the same, whatever the split
    assert _scan(["xab"], ("ab", "b")) == ("x", True)  # both end at one place: the longer


def test_only_a_possible_start_of_a_stop_string_is_held_back() -> None:
    s = StopScanner(("END",))
    assert s.push("abcE") == "abc"  # "E" may start "END"
    assert s.push("x") == "Ex"  # it did not
    assert s.push("EN") == ""
    assert s.push("D and more") == "" and s.stopped


def test_a_chat_stream_begins_with_the_role_and_usage_comes_last_with_no_choices() -> None:
    job = chat_job({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                    "stream_options": {"include_usage": True}})
    first = fmt.chunk(job, 1, None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    last = fmt.usage_chunk(job, 1, 5)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == job.prompt_tokens + 5
    assert fmt.sse({"a": 1}) == b'data: {"a":1}\n\n'


def test_what_sdks_send_at_neutral_values_is_accepted_and_what_asks_for_more_is_refused() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    neutral = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "parallel_tool_calls": True}
    assert chat_job({"model": "m", "messages": msgs, **neutral}).generate.prompt
    assert completion_job({"model": "m", "prompt": "x", "store": None, "service_tier": "default"}).generate.prompt
    for body, param in (({"store": True}, "store"), ({"service_tier": "flex"}, "service_tier"),
                        ({"metadata": {"k": 1}}, "metadata.k")):
        with pytest.raises(OpenAIError) as e:
            chat_job({"model": "m", "messages": msgs, **body})
        assert e.value.status == 400 and e.value.param == param, (body, e.value.param)


def test_an_engines_refusal_of_a_context_too_long_is_openais_context_length_exceeded() -> None:
    """The router's own bound is the longest context of all its models; an engine's shorter one is refused there,
    and a client that shortens and retries on `context_length_exceeded` must see that code."""
    body = '{"error": {"code": "context_too_long", "message": "the context (3000 tokens) leaves no room"}}'
    e = refusal(400, "engine_refused", body, "chat")
    assert (e.status, e.code, e.param, e.message) == (400, "context_length_exceeded", "messages",
                                                      "the context (3000 tokens) leaves no room")
    assert refusal(400, "engine_refused", body, "completion").param == "prompt"
    other = refusal(400, "engine_refused", '{"error": {"code": "bad_token", "message": "token 999"}}', "completion")
    assert (other.code, other.param, other.message) == ("engine_refused", None, "token 999")
    assert refusal(400, "engine_refused", "not json", "chat").message == "not json"
    assert refusal(503, "queue_full", "held", "chat").code == "queue_full"
    past = '{"error": {"code": "max_tokens_past_context", "message": "maximum context length is 64 tokens"}}'
    e = refusal(400, "engine_refused", past, "chat")
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "max_tokens")


def test_a_given_max_tokens_is_strict_and_none_given_runs_to_the_contexts_end() -> None:
    """The engines cut a max_tokens past the context unless asked not to (`strict_length`): the OpenAI routes ask
    whenever the client gave one (OpenAI refuses it), never when it gave none (until the context ends)."""
    assert completion_job({"model": "m", "prompt": "x"}).generate.strict_length  # OpenAI's default 16: given
    assert not completion_job({"model": "m", "prompt": "x", "max_tokens": None}).generate.strict_length
    assert not chat_job({"model": "m", "messages": [{"role": "user", "content": "x"}]}).generate.strict_length
    for limit in ("max_tokens", "max_completion_tokens"):
        job = chat_job({"model": "m", "messages": [{"role": "user", "content": "x"}], limit: 5})
        assert job.generate.strict_length and job.generate.max_tokens == 5
