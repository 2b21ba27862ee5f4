"""The OpenAI-compatible API through the official `openai` client, against a real router and a real engine process
(the pattern engine: deterministic tokens, no torch): completions and chat, streamed and whole, stop strings, max_tokens, seeds, usage,
the models list, OpenAI's error shapes, and the engine request closed when a stop string ends it or the client
goes away."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from libs.common import tokenizer
from libs.common.bus import Bus
from libs.common.store import Store
from tests.engine.support import generate
from tests.router.conftest import OpenAIStack
from tests.router.test_router import MODEL, announce, retire, wait_for_table

LONG = {"ignore_eos": True}  # an engine may sample its EOS early (the reference's tiny model does); exact lengths


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def health(stack: OpenAIStack) -> dict[str, Any]:
    return httpx.get(stack.engine.url + "/health", timeout=5).json()


def wait_engine_idle(stack: OpenAIStack, within_s: float) -> float:
    """Seconds until every KV slot of the engine is free again (the request was closed there)."""
    t0 = time.monotonic()
    while (h := health(stack))["free_slots"] != h["slots"]:
        assert time.monotonic() - t0 < within_s, h
        time.sleep(0.01)
    return time.monotonic() - t0


async def test_a_completion_whole_or_streamed_is_the_engines_greedy_output_with_its_usage(
        openai_stack: OpenAIStack) -> None:
    direct = generate(openai_stack.engine.url, prompt="Once upon a time", max_tokens=24, **LONG)
    c = client(openai_stack.router.url)
    r = await c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                   extra_body=LONG)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert r.choices[0].text == direct["text"] and r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (direct["prompt_tokens"], 24)
    assert r.usage.total_tokens == direct["prompt_tokens"] + 24

    stream = await c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                        stream=True, stream_options={"include_usage": True}, extra_body=LONG)
    chunks = [ch async for ch in stream]
    assert len(chunks) > 3 and all(ch.id == chunks[0].id for ch in chunks) and chunks[0].id != r.id
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == direct["text"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()
    assert all(ch.usage is None for ch in chunks[:-1])


async def test_a_chat_is_the_engines_greedy_continuation_of_the_documented_template_whole_or_streamed(
        openai_stack: OpenAIStack) -> None:
    template = "<|system|>\nYou are terse.\n<|user|>\nName a colour.\n<|assistant|>\n"
    direct = generate(openai_stack.engine.url, prompt=template, max_tokens=20, **LONG)
    c = client(openai_stack.router.url)
    messages: Any = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    r = await c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0,
                                        extra_body=LONG)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == direct["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.prompt_tokens == len(tokenizer.encode(template)) == direct["prompt_tokens"]
    stream = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
                                             extra_body=LONG)
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream])
    assert text == direct["text"]

    # on the wire: server-sent events as OpenAI sends them
    async with httpx.AsyncClient(timeout=60) as h, h.stream(
            "POST", openai_stack.router.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 20, "stream": True, "temperature": 0,
                  **LONG}) as wire:
        assert wire.status_code == 200 and wire.headers["content-type"].startswith("text/event-stream")
        raw = (await wire.aread()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads) == direct["text"]
    assert payloads[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}

    # the next turn as the official client's users write it: the answer's message sent back as it came
    turn = [*messages, r.choices[0].message, {"role": "user", "content": "Another."}]
    template2 = f"{template}{direct['text']}\n<|user|>\nAnother.\n<|assistant|>\n"
    again = await c.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, temperature=0, extra_body=LONG)
    assert again.choices[0].message.content == generate(openai_stack.engine.url, prompt=template2, max_tokens=8,
                                                        **LONG)["text"]


async def test_the_text_stops_before_a_stop_string_and_the_engine_request_ends_there(
        openai_stack: OpenAIStack) -> None:
    c = client(openai_stack.router.url)
    for stream in (False, True):
        prompt = f"stop test {stream}"
        full = generate(openai_stack.engine.url, prompt=prompt, max_tokens=60, **LONG)["text"]
        stop = full[20:23]  # spans several byte tokens; its first occurrence may be earlier still
        expected = full[:full.find(stop)]
        before = health(openai_stack)["tokens_generated"]
        kwargs: Any = {"model": MODEL, "prompt": prompt, "max_tokens": 1500, "temperature": 0,
                       "stop": ["\x00never\x00", stop], "extra_body": LONG}
        if stream:
            chunks = [ch async for ch in await c.completions.create(stream=True, **kwargs)]
            text = "".join(ch.choices[0].text for ch in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = await c.completions.create(**kwargs)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (text, reason) == (expected, "stop"), stream
        await asyncio.to_thread(wait_engine_idle, openai_stack, 10)
        # the engine stopped right after the match, far short of the 1,500 tokens asked for
        assert health(openai_stack)["tokens_generated"] - before < 40
    stats = openai_stack.router.stats()
    assert stats["in_flight"] == 0 and stats["cancelled"] == 0 and stats["completed"] == 2


async def test_one_seed_reproduces_a_sampled_completion_and_another_seed_differs(openai_stack: OpenAIStack) -> None:
    c = client(openai_stack.router.url)

    async def sample(seed: int) -> str:
        r = await c.completions.create(model=MODEL, prompt="Roll the dice:", max_tokens=32, temperature=1.0,
                                       seed=seed, extra_body=LONG)
        return r.choices[0].text

    first, again, other = await sample(7), await sample(7), await sample(8)
    assert first == again and first != other


BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "extra_body": {"unknown_knob": 1}}, "unknown_knob"),
    ({"max_tokens": 4}, "prompt"),
]


async def test_errors_have_openais_shape_and_status_unknown_model_404_bad_body_400(openai_stack: OpenAIStack) -> None:
    c = client(openai_stack.router.url)
    models = await c.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].object == "model"
    assert (await c.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as gone:
        await c.models.retrieve("no-such-model")
    assert gone.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as nf:
        await c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert nf.value.code == "model_not_found" and nf.value.param == "model" and nf.value.type == "invalid_request_error"

    for body, param in BAD_BODIES:
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=MODEL, **{"prompt": openai.NOT_GIVEN, **body})
        assert (e.value.status_code, e.value.param, e.value.type) == (400, param, "invalid_request_error"), body

    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(openai_stack.router.url + "/v1/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as long:  # the engine's refusal, its message passed on
        await c.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=4)
    assert "does not fit max_seq" in long.value.message and long.value.code == "engine_refused"
    assert openai_stack.router.stats()["in_flight"] == 0



async def test_a_max_tokens_the_context_cannot_hold_is_refused_as_openai_and_none_given_runs_to_its_end(
        openai_stack: OpenAIStack) -> None:
    """It was cut to the context's end silently (finish reason `length`, fewer tokens than asked): OpenAI refuses it
    with `context_length_exceeded`. The engine's context here is 2,048 tokens; the prompt is 2,001 (BOS + 2,000)."""
    c = client(openai_stack.router.url)
    prompt, room = "x" * 2000, 2048 - 2001
    for create in (lambda: c.completions.create(model=MODEL, prompt=prompt, max_tokens=room + 1),
                   lambda: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                     max_completion_tokens=2048)):
        with pytest.raises(openai.BadRequestError) as e:
            await create()
        assert (e.value.code, e.value.param) == ("context_length_exceeded", "max_tokens"), e.value.message
        assert "maximum context length is 2048 tokens" in e.value.message, e.value.message
    fits = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=room, temperature=0)
    assert (fits.usage.completion_tokens, fits.choices[0].finish_reason) == (room, "length")
    unbounded = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=None, temperature=0)
    assert unbounded.usage.completion_tokens == room  # null: until the context ends, as before
    stats = openai_stack.router.stats()
    assert (stats["replayed"], stats["failed"], stats["in_flight"]) == (0, 0, 0)
    assert not any(e["suspect"] for eps in stats["endpoints"].values() for e in eps), stats

# Bodies the router once sent on to engines, where each ended the batched engine or failed in the router's own
# encoding (a lone surrogate: retried on every engine as if each had failed, and each marked suspect).
POISON = [
    ("/v1/completions", b'{"model": "demo", "prompt": "\\ud800", "max_tokens": 2}', 400, "prompt"),
    ("/v1/completions", b'{"model": "demo", "prompt": "x", "max_tokens": 2, "seed": 1208925819614629174706176}', 400,
     "seed"),
    ("/v1/completions", b'{"model": "demo", "prompt": "x", "stop": ["\\udfff"]}', 400, "stop"),
    ("/v1/chat/completions", b'{"model": "demo", "messages": [{"role": "user", "content": "a\\udc00"}]}', 400,
     "messages.0.content"),
    ("/v1/completions", b'{"model": "demo", "prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("/v1/generate", b'{"model": "demo", "prompt": "\\ud800", "max_tokens": 2}', 422, "invalid_body"),
    ("/v1/generate", b'{"model": "demo", "prompt": "x", "max_tokens": 2, "temperature": NaN}', 422, "invalid_body"),
    ("/v1/generate", b'{"model": "demo", "prompt": "x", "max_tokens": 2, "seed": 9223372036854775808}', 422,
     "invalid_body"),
    ("/v1/generate", b'{"model": "", "prompt": "x", "max_tokens": 2}', 422, "invalid_body"),  # not a 10 s hold
    # JSON's types, strictly: each was coerced (served as 1 token, as 3, as a stream)
    ("/v1/generate", b'{"model": "demo", "prompt": "x", "max_tokens": true}', 422, "invalid_body"),
    ("/v1/generate", b'{"model": "demo", "prompt": "x", "max_tokens": "3"}', 422, "invalid_body"),
    ("/v1/generate", b'{"model": "demo", "prompt": "x", "stream": "yes"}', 422, "invalid_body"),
    ("/v1/generate", b'{"model": "demo", "prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "bad_json"),
]


async def test_bodies_that_reached_engines_before_are_refused_at_the_router(openai_stack: OpenAIStack) -> None:
    served_before = health(openai_stack)["tokens_generated"]
    async with httpx.AsyncClient(timeout=30) as h:
        for path, raw, status, param in POISON:
            raw = raw.replace(b'"demo"', json.dumps(MODEL).encode())
            r = await h.post(openai_stack.router.url + path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == status, (path, raw[:80], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, r.text  # one shape on every route
            if path == "/v1/generate":
                assert err["code"] == param, r.text
            else:
                assert err["type"] == "invalid_request_error" and err["param"] == param, r.text
    stats = openai_stack.router.stats()
    assert (stats["replayed"], stats["failed"], stats["in_flight"]) == (0, 0, 0)
    assert not any(e["suspect"] for eps in stats["endpoints"].values() for e in eps), stats  # no engine blamed
    assert health(openai_stack)["tokens_generated"] == served_before  # none reached the engine
    c = client(openai_stack.router.url)
    done = await c.completions.create(model=MODEL, prompt="still served", max_tokens=3, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop")

async def test_a_client_that_goes_away_frees_the_engine_slot_at_once_streamed_or_not(
        openai_stack: OpenAIStack) -> None:
    c = client(openai_stack.router.url)
    before = health(openai_stack)["tokens_generated"]
    stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go on"}],
                                             max_tokens=1500, temperature=0, stream=True, extra_body=LONG)
    n = 0
    async for _ in stream:
        n += 1
        if n == 10:
            break
    await stream.close()
    freed_s = await asyncio.to_thread(wait_engine_idle, openai_stack, 10)
    generated = health(openai_stack)["tokens_generated"] - before
    assert generated < 200, generated  # a forward or a few after the close, not the 1,500 asked for
    print(f"stream closed: slot freed {freed_s * 1000:.0f} ms later; {generated} tokens generated in all")

    before = health(openai_stack)["tokens_generated"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=1.0)) as h:
        with pytest.raises(httpx.ReadTimeout):  # gives up after 1 s and closes its connection
            await h.post(openai_stack.router.url + "/v1/completions",
                         json={"model": MODEL, "prompt": "long", "max_tokens": 1900, "temperature": 0, **LONG})
    freed_s = await asyncio.to_thread(wait_engine_idle, openai_stack, 10)
    generated = health(openai_stack)["tokens_generated"] - before
    await asyncio.sleep(1.0)  # had the generation gone on, the count would still grow
    assert health(openai_stack)["tokens_generated"] - before == generated < 1900
    print(f"whole request dropped: slot freed {freed_s * 1000:.0f} ms later; {generated} tokens generated in all")

    before = health(openai_stack)["tokens_generated"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=1.0)) as h:
        with pytest.raises(httpx.ReadTimeout):  # the router's own API, whole: the same
            await h.post(openai_stack.router.url + "/v1/generate",
                         json={"model": MODEL, "prompt": "long", "max_tokens": 1900, **LONG})
        async with h.stream("POST", openai_stack.router.url + "/v1/generate",
                            json={"model": MODEL, "prompt": "long", "max_tokens": 1900, "stream": True, **LONG}) as r:
            async for _ in r.aiter_lines():
                break  # streamed: one line read, then the connection closed
    await asyncio.to_thread(wait_engine_idle, openai_stack, 10)
    generated = health(openai_stack)["tokens_generated"] - before
    await asyncio.sleep(1.0)
    assert health(openai_stack)["tokens_generated"] - before == generated < 1900

    deadline = time.monotonic() + 10
    while openai_stack.router.stats()["in_flight"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert openai_stack.router.stats()["cancelled"] == 4


async def test_a_client_that_goes_before_its_first_token_is_closed_while_its_request_waits_in_the_engine(
        openai_stack: OpenAIStack) -> None:
    """The engine's every slot busy, a request waits there for one; its client gives up before the first token:
    the router closes it at once (it was watched only while held in the router's own queue), on both APIs."""
    url = openai_stack.router.url
    slots = health(openai_stack)["slots"]
    c = client(url)
    busy = [await c.completions.create(model=MODEL, prompt=f"busy {i}", max_tokens=1200, temperature=0, stream=True,
                                       extra_body=LONG) for i in range(slots)]
    for s in busy:
        await anext(aiter(s))  # each holds a slot now
    assert health(openai_stack)["free_slots"] == 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=0.5)) as h:
        for path, body in (("/v1/completions", {"prompt": "late", "stream": True}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "late"}]}),
                           ("/v1/generate", {"prompt": "late", "stream": True})):
            with pytest.raises(httpx.ReadTimeout):
                r = await h.post(url + path, json={"model": MODEL, "max_tokens": 4, **body})
                raise AssertionError(f"{path} answered {r.status_code} with every slot busy")
    deadline = time.monotonic() + 5
    while (stats := openai_stack.router.stats())["in_flight"] > slots:
        assert time.monotonic() < deadline, stats  # closed long before the busy streams end (~6 s at 200/s)
        await asyncio.sleep(0.02)
    assert stats["cancelled"] == 3 and stats["completed"] == 0, stats
    for s in busy:
        await s.close()


async def test_a_known_model_without_an_engine_gets_a_503_and_failing_engines_a_502(
        start_router, bus: Bus, store: Store) -> None:
    router = start_router(hold_timeout_s=0.5, max_replays=0)
    await announce(bus, store, "gone-a", "http://127.0.0.1:9")  # a port nothing listens on
    await asyncio.to_thread(wait_for_table, router, {"gone-a"})
    c = client(router.url)
    with pytest.raises(openai.APIStatusError) as e:
        await c.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert e.value.status_code == 502 and e.value.code == "replays_exhausted" and e.value.type == "server_error"
    await retire(bus, store, "gone-a", "test")
    await asyncio.to_thread(wait_for_table, router, set())
    assert [m.id for m in (await c.models.list()).data] == [MODEL]  # known for model_forget_s, served by none
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 503 and e.value.code == "no_endpoint"
    body = e.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
