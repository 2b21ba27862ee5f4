"""The batched engine's HTTP API as a client meets it (a real engine process, tiny model, local memory): many
requests at once batched and answered exactly, bad input refused with a clear status, a client that goes away
frees its blocks at once, KV exhaustion preempts and never crashes, and a full queue answers 503."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from libs.common import procs
from tests.engine.support import make_tiny_weights

# The KV cache of an engine whose test does not size it (here and tests/router/test_resume_batch.py): 1,024 blocks
# of 16 tokens, several times what any of their tests holds at once. The CPU default (max_num_seqs sequences of the
# model's 2,048 tokens: 1 GiB at 256) was zeroed at each start and freed at each exit, on the 2-core test machines.
KV_BLOCKS = ("--num-blocks", "1024")


class Engine:
    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        weights = make_tiny_weights(tmp / "tiny.safetensors")
        self.ready = tmp / "ready.json"
        kv = () if "--num-blocks" in args else KV_BLOCKS
        argv = [sys.executable, "-m", "engines.batched", "--weights", str(weights), "--size", "tiny", "--memory",
                "local", "--agent", "off", "--ready-file", str(self.ready), *kv, *args]
        self.child = procs.Child("batched", argv, env={"PYTHONUNBUFFERED": "1", **(env or {})},
                                 log_path=tmp / "engine.log").start()
        deadline = time.monotonic() + 90
        while not self.ready.exists():
            assert self.child.alive() and time.monotonic() < deadline, (tmp / "engine.log").read_text()[-3000:]
            time.sleep(0.05)
        self.url = json.loads(self.ready.read_text())["endpoint"]

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()


@pytest.fixture
def engine(tmp_path: Path, request: pytest.FixtureRequest):
    e = Engine(tmp_path, *getattr(request, "param", ()))
    yield e
    e.child.stop()


def gen(url: str, **body: object) -> httpx.Response:
    return httpx.post(url + "/generate", json={"max_tokens": 16, **body}, timeout=120)


async def _many(url: str, n: int, **body: object) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(limits=limits, timeout=300) as c:
        return await asyncio.gather(*(c.post(url + "/generate", json={"prompt": f"user {i}", "max_tokens": 24,
                                                                        "ignore_eos": True, **body})
                                      for i in range(n)))


@pytest.mark.slow
@pytest.mark.parametrize("engine", [("--deterministic", "--max-num-seqs", "64", "--prefill-chunk", "32")], indirect=True)
def test_sixty_four_requests_at_once_get_the_tokens_each_gets_alone(engine: Engine) -> None:
    alone = {i: gen(engine.url, prompt=f"user {i}", max_tokens=24, ignore_eos=True).json()["tokens"] for i in range(64)}
    together = asyncio.run(_many(engine.url, 64))
    assert [r.json()["tokens"] for r in together] == [alone[i] for i in range(64)]
    assert engine.health()["engine"]["scheduler"]["running"] == 0


def test_bad_input_gets_a_clear_status_and_the_engine_keeps_serving(engine: Engine) -> None:
    too_long = gen(engine.url, prompt="x" * 5000)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_too_long"
    assert gen(engine.url, tokens=[999]).status_code == 400
    assert gen(engine.url).status_code == 422  # no prompt, no tokens
    assert gen(engine.url, prompt="hi", max_tokens=-1).status_code == 422
    assert gen(engine.url, prompt="still serving").status_code == 200



@pytest.mark.parametrize("engine", [("--deterministic",)], indirect=True)
def test_requests_that_once_ended_the_engine_are_served_or_refused_and_it_serves_on(engine: Engine) -> None:
    """Each of these ended the engine's step loop (exit 70) before, and the router replayed it on the standby,
    which it ended too: a temperature so small that logits / t overflow (multinomial on NaN), a seed or
    max_tokens past the journal's 64 bits, text with a lone surrogate (prompt, request id: encoded in the step
    loop). A NaN temperature's refusal was a 500 (the error echoed the NaN, which JSON cannot hold)."""
    greedy = gen(engine.url, prompt="tiny t", max_tokens=8).json()["tokens"]
    tiny = httpx.post(engine.url + "/generate", content=b'{"prompt": "tiny t", "max_tokens": 8, "temperature": 1e-320}',
                      headers={"content-type": "application/json"}, timeout=60)
    assert tiny.status_code == 200 and tiny.json()["tokens"] == greedy  # below SAMPLING_EPS: greedy
    for raw, field in ((b'{"prompt": "x", "seed": 9223372036854775808}', "seed"),
                       (b'{"prompt": "x", "seed": -9223372036854775809}', "seed"),
                       (b'{"prompt": "x", "max_tokens": 9223372036854775808}', "max_tokens"),
                       (b'{"prompt": "x", "temperature": NaN}', "temperature"),
                       (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
                       (b'{"prompt": "\\ud800"}', "prompt"),
                       (b'{"prompt": "x", "request_id": "r-\\udc00"}', "request_id")):
        r = httpx.post(engine.url + "/generate", content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_body", (raw, r.text)
        assert field in r.json()["error"]["message"], (raw, r.text)
    assert engine.child.alive()
    assert gen(engine.url, prompt="tiny t", max_tokens=8, seed=2**63 - 1, temperature=0.5).status_code == 200
    assert gen(engine.url, prompt="tiny t", max_tokens=8).json()["tokens"] == greedy

def test_a_client_that_goes_away_frees_its_blocks_at_once(engine: Engine) -> None:
    total = engine.health()["engine"]["scheduler"]["num_blocks"]
    with httpx.stream("POST", engine.url + "/generate", json={"prompt": "a long one " * 40, "max_tokens": 1500,
                                                              "ignore_eos": True, "stream": True}, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n == 3:
                break
    deadline = time.monotonic() + 10
    while True:
        sched = engine.health()["engine"]["scheduler"]
        if sched["running"] == 0 and sched["aborted"] == 1:
            break
        assert time.monotonic() < deadline, sched
        time.sleep(0.05)
    assert sched["free_blocks"] == total  # every block back (a cached one counts as free)


@pytest.mark.parametrize("engine", [("--num-blocks", "130", "--block-size", "16", "--max-num-seqs", "32",
                                     "--prefill-chunk", "64")], indirect=True)
def test_when_kv_blocks_run_out_sequences_are_preempted_and_all_finish(engine: Engine) -> None:
    # 32 sequences of ~90 tokens need ~190 blocks at once: more than the 130 there are
    rs = asyncio.run(_many(engine.url, 32, prompt="p" * 40, max_tokens=60))
    assert all(r.status_code == 200 and len(r.json()["tokens"]) == 60 for r in rs)
    sched = engine.health()["engine"]["scheduler"]
    assert sched["preemptions"] > 0 and sched["running"] == 0


@pytest.mark.parametrize("engine", [("--max-waiting", "4", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                                     "--prefill-chunk", "32")], indirect=True)
def test_past_the_queue_new_requests_get_503_and_none_is_lost_silently(engine: Engine) -> None:
    rs = asyncio.run(_many(engine.url, 40, max_tokens=64))
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 503} and codes.count(503) > 0 and codes.count(200) >= 4
    for r in rs:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "queue_full"
        else:
            assert len(r.json()["tokens"]) == 64


@pytest.mark.parametrize("engine", [("--deterministic", "--prefill-chunk", "32")], indirect=True)
def test_a_replayed_request_the_engine_does_not_hold_continues_exactly_and_resends_nothing(engine: Engine) -> None:
    """A router's replay to an engine without the sequence (its KV lost): the tokens already generated are fed as
    output, one per step as decode first made them, so the continuation equals the uninterrupted run's. Every cut
    point of a prompt is replayed at once, as a router replays a dead engine's streams together (deterministic
    mode: a batch computes what each request computes alone; the 64-request test above checks that)."""
    from devstack.scenario import PROMPTS

    async def resumed_at_every_cut(body: dict, full: list[int]) -> list[list[int]]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=300) as c:
            rs = await asyncio.gather(*(c.post(engine.url + "/generate", json={**body, "resume": full[:k],
                                                                               "max_tokens": 48 - k})
                                        for k in range(1, 48)))
        return [r.json()["tokens"] for r in rs]

    differ = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 48, "ignore_eos": True}
        full = gen(engine.url, **body).json()["tokens"]
        for k, tokens in enumerate(asyncio.run(resumed_at_every_cut(body, full)), start=1):
            if tokens != full[k:]:
                differ.append((prompt, k))
    assert not differ


def _many_lines(url: str, bodies: list[dict], *, abort_after: tuple[str, int] | None = None) -> dict[int, list[dict]]:
    """`/generate_many`'s lines by request index; `abort_after=(request_id, n)`: `/abort` it after n lines."""
    out: dict[int, list[dict]] = {}
    with httpx.stream("POST", url + "/generate_many", json={"requests": bodies}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for n, line in enumerate(r.iter_lines()):
            if not line.strip():
                continue
            obj = json.loads(line)
            out.setdefault(obj.pop("i"), []).append(obj)
            if abort_after is not None and n == abort_after[1]:
                assert httpx.post(url + "/abort", json={"request_id": abort_after[0]}, timeout=10).json()["aborted"]
    return out


@pytest.mark.parametrize("engine", [("--deterministic", "--prefill-chunk", "32")], indirect=True)
def test_many_requests_in_one_generate_many_each_get_their_own_stream_as_alone(engine: Engine) -> None:
    bodies = [{"request_id": f"m{i}", "prompt": f"user {i}", "max_tokens": 12, "ignore_eos": True, "stream": True}
              for i in range(8)]
    alone = [gen(engine.url, **{k: v for k, v in b.items() if k != "stream"}).json()["tokens"] for b in bodies]
    lines = _many_lines(engine.url, [*bodies, {"prompt": "bad", "tokens": [999], "stream": True}])
    for i in range(8):
        assert [x["token"] for x in lines[i][:-1]] == alone[i]
        assert lines[i][-1]["done"] and lines[i][-1]["completion_tokens"] == 12
    assert lines[8] == [{"done": True, "status": 400, "error": {"code": "bad_request",
                                                                 "message": "token ids must be in [0, 257]"}}]


def test_an_abort_ends_one_request_of_a_generate_many_and_the_others_finish(engine: Engine) -> None:
    bodies = [{"request_id": "long", "prompt": "a long one", "max_tokens": 1500, "ignore_eos": True, "stream": True},
              {"request_id": "short", "prompt": "short", "max_tokens": 40, "ignore_eos": True, "stream": True}]
    lines = _many_lines(engine.url, bodies, abort_after=("long", 4))
    assert lines[1][-1]["done"] and lines[1][-1]["completion_tokens"] == 40
    assert not any(x.get("done") for x in lines[0]) and len(lines[0]) < 1500
    deadline = time.monotonic() + 10
    while engine.health()["engine"]["live"]:
        assert time.monotonic() < deadline, engine.health()
        time.sleep(0.05)
