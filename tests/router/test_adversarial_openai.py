"""The OpenAI-compatible API against clients that send what OpenAI's own API refuses: values of the wrong JSON type,
routes and methods the router lacks, bodies framed to slip past the body limit, prompts past any model's context,
bytes that are not HTTP; and HEAD, which it takes. Each refusal is a 400/404/405/413 in OpenAI's error shape, naming
the field as a client names it; the bodies as pure logic, the routes and framing against a real router (and
engine)."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from libs.common.web.guard import framed_by_length
from services.router import context_bound
from services.router.openai_protocol import OpenAIError, chat_job, completion_job
from tests.router.conftest import OpenAIStack, RouterProc
from tests.router.test_openai_api import client
from tests.router.test_router import MODEL

CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),  # each of these was coerced and served (200)
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 3.0}, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "seed": "7"}, "seed"),
    ({"prompt": "x", "n": "1"}, "n"),
    ({"prompt": "x", "ignore_eos": "true"}, "ignore_eos"),
    ({"prompt": [65, True]}, "prompt.1"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
])
def test_a_value_of_the_wrong_json_type_is_refused_not_coerced(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as e:
        completion_job({"model": "m", **body})
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_a_chat_value_of_the_wrong_json_type_is_refused_naming_its_field() -> None:
    for body, param in (({"max_completion_tokens": "9"}, "max_completion_tokens"),
                        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
                        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                         "messages.0.content")):
        with pytest.raises(OpenAIError) as e:
            chat_job({"model": "m", "messages": CHAT, **body})
        assert e.value.status == 400 and e.value.param == param, e.value.message


def test_the_field_named_is_the_clients_not_the_union_member_tried_and_a_body_wide_rule_names_none() -> None:
    with pytest.raises(OpenAIError) as e:
        completion_job({"model": "m", "prompt": "x", "stop": 5})
    assert e.value.param == "stop" and "'stop'" in e.value.message  # it said 'stop.str'
    with pytest.raises(OpenAIError) as e:
        completion_job({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}})
    assert e.value.param is None and "None" not in e.value.message, e.value.message  # it said 'None'


def test_what_the_api_accepts_is_unchanged_by_strict_types() -> None:
    job = completion_job({"model": "m", "prompt": [65, 66], "max_tokens": 4, "temperature": 0, "seed": -3,
                          "stream": True, "stream_options": {"include_usage": True}, "n": 1, "top_p": 1})
    assert (job.generate.max_tokens, job.generate.temperature, job.generate.seed) == (4, 0.0, -3)
    assert job.stream and job.include_usage
    chat = chat_job({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     "temperature": 1, "max_tokens": 2, "logprobs": False})
    assert chat.generate.prompt == "<|user|>\nhi\n<|assistant|>\n" and chat.generate.max_tokens == 2


async def test_a_route_or_method_the_router_lacks_answers_in_openais_error_shape(openai_stack: OpenAIStack) -> None:
    url = openai_stack.router.url
    async with httpx.AsyncClient(timeout=30) as h:
        for method, path, status, code in (("POST", "/v1/embeddings", 404, "not_found"),
                                           ("GET", "/v1/completions", 405, "method_not_allowed"),
                                           ("DELETE", "/v1/chat/completions", 405, "method_not_allowed")):
            r = await h.request(method, url + path, json={"model": MODEL, "input": "x"})
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert err == {"message": err["message"], "type": "invalid_request_error", "param": None, "code": code}
    c = client(url)
    with pytest.raises(openai.NotFoundError) as nf:
        await c.embeddings.create(model=MODEL, input="x")
    assert nf.value.code == "not_found" and nf.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:  # the official client passes extra_body through untyped
        await c.completions.create(model=MODEL, prompt="x", extra_body={"max_tokens": "5"})
    assert bad.value.param == "max_tokens"
    done = await c.completions.create(model=MODEL, prompt="still served", max_tokens=3, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop")


def test_a_token_id_prompt_is_validated_as_token_ids_and_a_bad_item_is_named() -> None:
    """The prompt's form is chosen by its first item, then only that form is checked (`Prompt`)."""
    assert completion_job({"model": "m", "prompt": [1] * 100_000}).generate.tokens == [1] * 100_000
    for prompt, param in (([65, "a"], "prompt.1"), (["a", 65], "prompt.1"), ([[65], 66], "prompt.1"), ([[65, "a"]], "prompt.0.1"), (None, "prompt")):
        with pytest.raises(OpenAIError) as e:
            completion_job({"model": "m", "prompt": prompt})
        assert e.value.status == 400 and e.value.param == param, (prompt, e.value.message)


async def test_a_body_json_cannot_hold_as_python_values_is_a_400_not_a_500(openai_stack: OpenAIStack) -> None:
    huge = b"9" * 5000  # past Python's 4300 digits for an int from a string: json.loads raises ValueError
    async with httpx.AsyncClient(timeout=30) as h:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = await h.post(openai_stack.router.url + path, headers={"content-type": "application/json"},
                             content=b'{"model": "%s", "prompt": "x", "max_tokens": %s}' % (MODEL.encode(), huge))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error", r.text
    assert openai_stack.router.stats()["in_flight"] == 0


def test_a_length_beside_chunked_framing_does_not_spare_the_body_its_count() -> None:
    assert not framed_by_length({b"host": b"x", b"content-length": b"10", b"transfer-encoding": b"chunked"})
    assert framed_by_length({b"host": b"x", b"content-length": b"10"})
    assert not framed_by_length({b"host": b"x", b"transfer-encoding": b"chunked"})


def _chunked_with_a_small_declared_length(port: int, body: bytes) -> bytes:
    """Send `body` chunked, declaring `Content-Length: 10` beside it (h11 frames it by its chunks); the status line."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        try:
            for i in range(0, len(body), 1 << 16):
                piece = body[i:i + (1 << 16)]
                s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the router closed its side: its answer is there to read
        return s.recv(4096).split(b"\r\n", 1)[0]


async def test_a_chunked_body_declaring_a_small_length_is_counted_and_refused_past_the_limit(
        start_router: Callable[..., RouterProc]) -> None:
    """It went past the limit uncounted (the guard trusted the declared 10 bytes) and was read whole."""
    router = await asyncio.to_thread(start_router, max_body_bytes=1 << 20)
    body = b'{"model": "%s", "max_tokens": 2, "prompt": "%s"}' % (MODEL.encode(), b"a" * (4 << 20))
    line = await asyncio.to_thread(_chunked_with_a_small_declared_length, int(router.url.rsplit(":", 1)[1]), body)
    assert line.split()[1] == b"413", line
    assert httpx.get(router.url + "/v1/models", timeout=10).status_code == 200  # serving on


# ---- a prompt too long for any model behind the router


def test_a_prompt_past_the_context_is_refused_and_a_text_past_it_in_characters_is_never_tokenized() -> None:
    assert completion_job({"model": "m", "prompt": [1] * 10}, max_context=10).prompt_tokens == 10
    assert completion_job({"model": "m", "prompt": "x" * 9}, max_context=10).prompt_tokens == 10  # BOS + 9
    for body in ({"prompt": [1] * 11}, {"prompt": "x" * 10}, {"prompt": "é" * 6}):  # é: 2 byte tokens
        with pytest.raises(OpenAIError) as e:
            completion_job({"model": "m", **body}, max_context=10)
        assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "prompt")
    with pytest.raises(OpenAIError) as e:
        chat_job({"model": "m", "messages": [{"role": "user", "content": "x" * 100}]}, max_context=64)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "messages")
    assert completion_job({"model": "m", "prompt": [1] * 10**6}).prompt_tokens == 10**6  # no bound given: none


@pytest.mark.parametrize("prompt", ["plain", "a, b, c, d", "\u00e9\u00e9", "\U0001f600", "x" * 30,
                                    [65, 66, 67], [257] * 30, ["one, two, three"], [[65, 66, 67]], [[7]]])
def test_the_bound_before_parsing_never_refuses_a_prompt_that_fits(prompt: object) -> None:
    """Its lower bound of the prompt's tokens, however the JSON spells it (escapes, whitespace, commas in text)."""
    job = completion_job({"model": "m", "prompt": prompt})
    for spelling in (json.dumps({"model": "m", "prompt": prompt}), json.dumps({"model": "m", "prompt": prompt},
                                                                              indent=8, ensure_ascii=True)):
        context_bound.refuse_early(spelling.encode(), job.prompt_tokens)  # exactly its count: passes
    with pytest.raises(OpenAIError) as e:
        context_bound.refuse_early(json.dumps({"model": "m", "prompt": [1] * 1000}).encode(), 999)
    assert e.value.code == "context_length_exceeded"


HUGE = """
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
huge = [65] * 4_000_000  # ~16 MB as JSON: under the router's 16 MiB body limit
print("ready", flush=True)
sys.stdin.readline()
try:
    # the client's own transform walks a `prompt` item by item (40 s for 4 M); extra_body goes as it is
    c.completions.create(model=sys.argv[2], prompt="", max_tokens=1, extra_body={"prompt": huge})
    print(json.dumps({"status": 200}))
except openai.APIStatusError as e:
    print(json.dumps({"status": e.status_code, "code": e.code, "param": getattr(e, "param", None)}))
"""


async def test_millions_of_token_ids_are_refused_before_they_are_parsed_and_a_stream_beside_goes_on(
        openai_stack: OpenAIStack, record_property: Callable[[str, object], None]) -> None:
    """A 16 MiB body of 4 M token ids held the router's loop ~2.3 s (parsed, validated, dumped and sent to the
    engine, which refused it): every other client of that worker waited. Now the router refuses it from a scan of
    the raw body (its default `max_context_tokens`, 131,072), and never sends it. The official client sends it from a
    process of its own (its JSON encoding would hold this one's loop); the stream beside ends with its exact text,
    and its largest gap while the body was refused is reported."""
    url = openai_stack.router.url
    c = client(url)
    expected = (await c.completions.create(model=MODEL, prompt="beside", max_tokens=400, temperature=0,
                                           extra_body={"ignore_eos": True})).choices[0].text
    sender = await asyncio.create_subprocess_exec(sys.executable, "-c", HUGE, url, MODEL, stdin=asyncio.subprocess.PIPE,
                                                  stdout=asyncio.subprocess.PIPE)
    assert sender.stdin is not None and sender.stdout is not None
    assert (await asyncio.wait_for(sender.stdout.readline(), 60)).strip() == b"ready"
    arrivals: list[float] = []
    parts: list[str] = []
    started = asyncio.Event()

    async def beside() -> None:
        stream = await c.completions.create(model=MODEL, prompt="beside", max_tokens=400, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            arrivals.append(time.perf_counter())
            parts.append(chunk.choices[0].text if chunk.choices else "")
            started.set()

    task = asyncio.create_task(beside())
    await started.wait()
    before = openai_stack.router.stats()["requests"]  # the stream beside is counted already
    t0 = time.perf_counter()
    sender.stdin.write(b"go\n")
    await sender.stdin.drain()
    answer = json.loads(await asyncio.wait_for(sender.stdout.readline(), 120))
    t1 = time.perf_counter()
    await sender.wait()
    assert answer == {"status": 400, "code": "context_length_exceeded", "param": "prompt"}, answer
    await task
    assert "".join(parts) == expected
    stats = openai_stack.router.stats()
    assert stats["requests"] == before and stats["in_flight"] == 0  # the huge one never reached the relay
    during = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if t0 <= b <= t1 + 0.05]
    gaps = {"largest_gap_ms_during": round(max(during, default=0.0) * 1000, 1),
            "largest_gap_ms_whole": round(max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False)) * 1000, 1),
            "sent_to_refused_ms": round((t1 - t0) * 1000, 1)}
    record_property("huge_prompt", gaps)
    print("\nthe stream beside a 16 MB prompt:", gaps)


async def test_head_on_the_routers_get_routes_answers_as_get_without_a_body(openai_stack: OpenAIStack) -> None:
    """Each was a 405 (FastAPI's routes take GET alone)."""
    async with httpx.AsyncClient(base_url=openai_stack.router.url, timeout=30) as h:
        for path in ("/healthz", "/v1/models", f"/v1/models/{MODEL}", "/stats"):
            r = await h.head(path)
            assert r.status_code == 200 and r.content == b"", (path, r.status_code)
        assert (await h.head("/v1/completions")).status_code == 405  # a POST route stays one


def test_bytes_that_are_not_http_get_openais_error_shape(openai_stack: OpenAIStack) -> None:
    """uvicorn answered them in plain text, which an OpenAI client cannot read."""
    port = int(openai_stack.router.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), got[:300]
    err = json.loads(body)["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "bad_request"), err


async def test_a_body_not_declared_json_or_not_utf8_is_refused_and_none_declared_is_read_as_json(
        openai_stack: OpenAIStack) -> None:
    """A text/plain or form body (what a web page sends without a CORS preflight) was served; UTF-16 and UTF-32
    were read too, past the early context bound (UTF-8 only)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    raw = json.dumps(body)
    async with httpx.AsyncClient(base_url=openai_stack.router.url, timeout=30) as h:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = await h.post("/v1/completions", content=raw, headers={"content-type": kind})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (kind, r.text)
        for encoding in ("utf-16", "utf-32"):
            r = await h.post("/v1/completions", content=raw.encode(encoding),
                             headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (encoding, r.text)
        r = await h.post("/v1/completions", content=raw.encode(), headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text
        r = await h.post("/v1/completions", content=raw.encode())  # httpx sends no content-type for raw bytes
        assert r.status_code == 200, r.text
    assert openai_stack.router.stats()["in_flight"] == 0


def test_generates_prompt_and_token_ids_are_bounded_together_before_parsing() -> None:
    fits = {"model": "m", "prompt": "ab", "tokens": [1, 2, 3]}  # BOS + 2 bytes + 3 ids
    context_bound.refuse_early(json.dumps(fits).encode(), 6)
    context_bound.refuse_early(json.dumps({"model": "m", "prompt": "ab", "tokens": []}).encode(), 3)
    with pytest.raises(OpenAIError) as e:  # at least BOS + 1 byte (a string's bound) + 3 ids
        context_bound.refuse_early(json.dumps(fits).encode(), 4)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "tokens")


async def test_a_generate_body_of_token_ids_past_the_context_is_refused_before_it_reaches_an_engine(
        openai_stack: OpenAIStack) -> None:
    """/v1/generate parsed, validated and sent such a body whole (7 M ids: its worker's streams waited 1.3-4.6 s,
    probe of 2026-12-07); the OpenAI routes measured theirs from the raw bytes already. An engine's own refusal on
    this route reads as its message, not as its JSON in a string."""
    url = openai_stack.router.url
    before = openai_stack.router.stats()["requests"]
    async with httpx.AsyncClient(timeout=60) as h:
        r = await h.post(url + "/v1/generate", json={"model": MODEL, "tokens": [65] * 200_000, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", "tokens"), err
        assert openai_stack.router.stats()["requests"] == before  # never reached the relay
        r = await h.post(url + "/v1/generate", json={"model": MODEL, "prompt": "x" * 5000, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "engine_refused", r.text
        assert "does not fit max_seq" in r.json()["error"]["message"] and "{" not in r.json()["error"]["message"]
        r = await h.post(url + "/v1/generate", json={"model": MODEL, "prompt": "still", "max_tokens": 2})
        assert r.status_code == 200, r.text
