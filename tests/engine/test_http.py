"""The engine's HTTP API in a real standalone process (plain tensors, no gpu_manager)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.engine.support import EngineProc, generate


def test_a_standalone_engine_streams_ndjson_that_matches_its_json_reply(tmp_path: Path, tiny_weights: Path) -> None:
    e = EngineProc(tmp_path, tiny_weights, "http-1", args=("--memory", "local")).start()
    try:
        info = e.wait_ready()
        assert info["memory"] == {**info["memory"], "kind": "local", "source": "file"}
        health = httpx.get(e.url + "/health", timeout=10).json()
        assert health["ok"] and health["state"] == "ready" and health["device"] == "cpu"
        body = {"prompt": "stream me", "max_tokens": 16, "ignore_eos": True}
        with httpx.stream("POST", e.url + "/generate", json={**body, "stream": True}, timeout=30) as r:
            assert r.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
        whole = generate(e.url, **body)
        assert [x["token"] for x in lines[:-1]] == whole["tokens"]
        assert "".join(x["text"] for x in lines[:-1]) == whole["text"]
        assert lines[-1]["done"] and lines[-1]["completion_tokens"] == 16 and lines[-1]["finish_reason"] == "length"
        bad = httpx.post(e.url + "/generate", json={"tokens": [999], "max_tokens": 2}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_request"
        assert httpx.post(e.url + "/generate", json={"max_tokens": 2}, timeout=10).status_code == 422
        # a resume that ends with EOS (a stream cut after its EOS line) has ended; one going past an EOS is refused
        done = generate(e.url, prompt="resumed", max_tokens=9, resume=[65, 257])
        assert (done["finish_reason"], done["completion_tokens"]) == ("eos", 0), done
        past = httpx.post(e.url + "/generate", json={"prompt": "x", "max_tokens": 3, "resume": [65, 257, 66]},
                          timeout=10)
        assert past.status_code == 400 and "EOS" in past.json()["error"]["message"], past.text
        assert generate(e.url, prompt="x", max_tokens=3, resume=[65, 257, 66], ignore_eos=True)["completion_tokens"] == 3
    finally:
        e.stop()


FIRST_STREAM = r"""
import sys, tempfile, pathlib, httpx, torch
from engines.reference.config import get_config
from engines.reference.engine import EngineCore
from engines.reference.model import Transformer
from engines.http_thread import HttpThread
from engines.reference.server import EngineState, build_app, warm_routes
from engines.reference.weights import load_weights, make_weights
cfg = get_config("tiny")
core = EngineCore(Transformer(cfg, load_weights(make_weights(cfg, pathlib.Path(tempfile.mkdtemp()) / "w"))),
                  torch.zeros(cfg.kv_shape(1, 128)))
state = EngineState("e", "reference", "tiny")
http = HttpThread(build_app(state), "127.0.0.1", 0, warm_routes)
http.start()
state.install(core)
state.state = "ready"
import json, tokenize
read = []
_open = tokenize.open
tokenize.open = lambda name: (read.append(name), _open(name))[1]
with httpx.Client() as c:
    before = set(sys.modules)
    with c.stream("POST", http.endpoint + "/generate", json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200, r.status_code
        for _ in r.iter_lines():
            pass
print(json.dumps({"imported": sorted(set(sys.modules) - before), "sources_read": read}))
http.stop()
"""


def test_the_first_streamed_request_imports_and_reads_no_source_on_its_way() -> None:
    """A takeover's first requests stream: a module imported then (anyio's backend: ~45 ms) or a source file read
    then (FastAPI's first request to a route reads its endpoint's source) delays them all."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FIRST_STREAM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"imported": [], "sources_read": []}
