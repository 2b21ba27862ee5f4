"""Admin API tokens: stored as hashes only, matched in constant time, scoped read < operate < admin. The scope
tests run a real controller configured with hashed tokens only (no plain token anywhere in its settings)."""

from __future__ import annotations

import hmac
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from devstack.simcluster import SimulatedCluster
from libs.common import procs
from libs.common.bus import Bus
from libs.common.store import Store
from libs.common.web import tokens
from libs.common.web.tokens import TokenConfigError, TokenTable, new_token
from services.controller.api.app import create_app
from services.controller.api.context import ApiContext
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView
from tests.controller.helpers import control_plane, service_env, wait_for


def test_a_table_holds_digests_and_finds_the_highest_scope() -> None:
    (rt, re_), (ot, oe), (at, ae) = (new_token(s) for s in ("read", "operate", "admin"))
    table = TokenTable.parse(f"{re_}, {oe},{ae}")
    assert [table.scope_of(t) for t in (rt, ot, at, "", "nope", rt + "x")] == ["read", "operate", "admin",
                                                                               None, None, None]
    assert not any(t in e for t in (rt, ot, at) for e in (re_, oe, ae))  # an entry never holds its token
    assert not any(t.encode() in d for t in (rt, ot, at) for d, _ in table.entries)
    assert len(at) >= 43  # 32 random bytes, url-safe base64
    both = TokenTable.parse(f"{tokens.entry_for('read', at)},{ae}")
    assert both.scope_of(at) == "admin"  # listed twice: the higher scope counts, whatever the order


def test_a_bad_entry_is_refused_at_start_without_echoing_it() -> None:
    for bad in ("admin:my-plain-secret-token", "root:sha256:" + "0" * 64, "admin:sha256:abc",
                "admin:md5:" + "0" * 32):
        with pytest.raises(TokenConfigError) as err:
            TokenTable.parse(bad)
        assert bad.split(":", 1)[1] not in str(err.value)
        with pytest.raises(ValueError, match="api_tokens"):
            ControllerSettings(api_tokens=bad)


def test_lookups_compare_with_hmac_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tokens.hmac, "compare_digest", spy)
    token, entry = new_token("operate")
    table = TokenTable.parse(f"{tokens.entry_for('read', 'other')},{entry}")
    assert table.scope_of(token) == "operate"
    assert len(seen) == 2  # every entry compared, the match included: no early exit
    assert all(a == tokens.digest(token) for a, _ in seen)


ISSUED = {s: new_token(s) for s in ("read", "operate", "admin")}


@pytest.fixture
async def api(bus: Bus, store: Store, settings_env: dict[str, str],
              tmp_path: Path) -> AsyncIterator[tuple[str, SimulatedCluster, Path]]:
    sim = SimulatedCluster(bus, store, nodes=3, gpus_per_node=2)
    await sim.populate()
    await sim.serve()
    port = procs.free_port()
    env = service_env(settings_env, HF_API_ENABLED="true", HF_API_PORT=str(port),
                      HF_API_TOKENS=",".join(e for _, e in ISSUED.values()))
    env.pop("HF_ADMIN_TOKEN", None)
    env.pop("HF_READ_TOKEN", None)
    async with control_plane(bus, store, env, tmp_path, dc_manager=False):
        url = f"http://127.0.0.1:{port}"
        async with _client(url, "read") as c:
            await wait_for(lambda: _synced(c), what="the API sees every engine")
        yield url, sim, tmp_path


async def _synced(c: httpx.AsyncClient) -> bool:
    r = await c.get("/v1/engines")
    return r.status_code == 200 and r.json()["total"] == 6


def _client(url: str, scope: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ISSUED[scope][0]}"})


async def test_each_scope_gets_its_routes_and_403_above_it_recorded_in_the_audit(
        api: tuple[str, SimulatedCluster, Path]) -> None:
    url, sim, log_dir = api
    lease = f"L-{sim.engine_id('n0000', 1)}"
    reads = ["/v1/nodes", "/v1/gpus", "/v1/engines", "/v1/leases", "/v1/incidents",
             "/v1/engine-classes/nope/upgrade"]
    operate: list[tuple[str, dict | None]] = [("/v1/nodes/n0002/drain", None), (f"/v1/engines/{sim.engine_id('n0001', 0)}/failover", None),
               (f"/v1/leases/{lease}/snapshot", {})]
    admin: list[tuple[str, dict | None]] = [(f"/v1/leases/{lease}/reclaim", None), ("/v1/engine-classes/nope/upgrade", {"version": "v9"})]
    async with _client(url, "read") as ro, _client(url, "operate") as op, _client(url, "admin") as ad:
        for path in reads:
            for c in (ro, op, ad):
                assert (await c.get(path)).status_code in (200, 404), path  # 404: no roll-out of class nope
        plain = await ro.get("/v1/nodes", headers={"Origin": "http://elsewhere.example"})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers  # CORS off
        for path, body in operate + admin:
            assert (await ro.post(path, json=body)).status_code == 403, path
        for path, body in admin:
            assert (await op.post(path, json=body)).status_code == 403, path
        for path, body in operate[:1]:
            assert (await op.post(path, json=body)).status_code == 202, path
        for path, body in operate[1:]:
            assert (await op.post(path, json=body)).status_code not in (401, 403), path
        assert (await ad.post(admin[0][0])).status_code == 200  # reclaim
        assert (await ad.post(*admin[1][:1], json=admin[1][1])).status_code not in (401, 403)
        assert (await ro.get("/v1/audit")).status_code == 403
        assert (await op.get("/v1/audit")).status_code == 403
        r = await ad.get("/v1/audit", params={"limit": 1000})
        assert r.status_code == 200
    got = [(e["who"].split(" ")[0], e["what"].split(" ")[1], e["outcome"]) for e in r.json()["items"][::-1]]
    refused = [(s, p, "403") for s, ps in (("read", operate + admin), ("operate", admin)) for p, _ in ps]
    assert got[:len(refused)] == refused
    assert [(s, p) for s, p, _ in got[len(refused):]] == [("operate", p) for p, _ in operate] + \
        [("admin", p) for p, _ in admin]
    assert got[len(refused)][2] == "ok" and got[-2][2] == "ok"  # drain, reclaim

    # Never in clear: not in the audit record, not in the controller's log, not in any file it wrote.
    text = r.text + "".join(p.read_text(errors="replace") for p in log_dir.rglob("*") if p.is_file())
    assert all(token not in text for token, _ in ISSUED.values())
    assert all(e["who"].split(" ")[2] in {tokens.digest(t).hex()[:12] for t, _ in ISSUED.values()}
               for e in r.json()["items"])


async def test_cors_answers_only_the_configured_origins() -> None:
    token, entry = new_token("read")
    preflight = {"Origin": "", "Access-Control-Request-Method": "GET",
                 "Access-Control-Request-Headers": "authorization"}
    for configured, origin, allowed in (("", "http://ui.example", False),
                                        ("http://ui.example", "http://ui.example", True),
                                        ("http://ui.example", "http://elsewhere.example", False)):
        c = ApiContext(settings=ControllerSettings(api_cors_origins=configured, api_tokens=entry), view=ClusterView(),
                       store=None, bus=None, metrics=None, is_leader=lambda: False)  # type: ignore[arg-type]
        app = create_app(c)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as cl:
            r = await cl.options("/v1/nodes", headers={**preflight, "Origin": origin})
        assert (r.headers.get("access-control-allow-origin") == origin) is allowed, (configured, origin)
        assert (r.status_code == 200) is allowed  # refused: the guard's 401 (no token), or CORS's 400


def test_the_cli_prints_a_token_and_the_entry_that_admits_it_with_its_scope() -> None:
    out = subprocess.run([sys.executable, "-m", "holdfast.main", "api-token", "operate"], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    lines = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert lines["token"] not in lines["entry"]
    assert TokenTable.parse(lines["entry"]).scope_of(lines["token"]) == "operate"
    bad = subprocess.run([sys.executable, "-m", "holdfast.main", "api-token", "root"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown scope" in bad.stdout
