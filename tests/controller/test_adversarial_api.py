"""A buggy or hostile client of the admin API, one defect each: every answer typed, every write call audited.

- A write call whose body FastAPI could not parse (invalid JSON: 422; bytes it cannot decode: 400) was refused
  before the route's scope check ran: never written to the audit record, and a read-scope token got the parse
  error instead of its 403.
- A path of kilobytes (an id far over its limit) was recorded whole: the audit record keeps 10,000 entries, so a
  read-scope token could make it hold over a hundred megabytes.
- A failure no handler typed (a node command on a bus gone) was answered in text/plain ("Internal Server Error"),
  not in the API's JSON error shape.
- An unknown field in a failover's or an upgrade's body was ignored: `{"sucessor": ...}` (a typo) started a
  failover to whichever standby the agent picks; a successor that does not exist (or the engine itself) was
  accepted, and the incident took the engine out of service before its agent refused the name.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from devstack.simcluster import SimulatedCluster
from libs.common.events import IncidentReason, LeaseInfo, LeaseState, Tag
from services.controller.api.app import create_app
from services.controller.api.audit import MAX_AUDIT_WHAT
from services.controller.api.context import ApiContext
from services.controller.incident import Trigger, apply, incident_id_for, opened_record
from services.controller.incident_log import incident_key
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView
from tests.controller.test_api_tokens import _client, api  # noqa: F401 - `api` is the fixture used here
from tests.controller.test_open_incidents import D

JSON = {"content-type": "application/json"}


async def test_a_write_call_whose_body_cannot_be_parsed_is_audited_once_and_a_read_token_gets_403(
        api: tuple[str, SimulatedCluster, Path]) -> None:  # noqa: F811
    url, sim, _ = api
    path = f"/v1/engines/{sim.engine_id('n0002', 0)}/failover"
    bodies = [(b"{not json", 422, "validation_error"), (b"\xff\xfe\x00", 400, "bad_request")]
    async with _client(url, "read") as ro, _client(url, "operate") as op, _client(url, "admin") as ad:
        for body, status, code in bodies:
            r = await op.post(path, content=body, headers=JSON)
            assert (r.status_code, r.json()["error"]) == (status, code), r.text
            r = await ro.post(path, content=body, headers=JSON)
            assert (r.status_code, r.json()["error"]) == (403, "forbidden"), r.text
        r = await op.post(path, json={"successor": 5})  # parsed, then invalid: audited by the route, as before
        assert r.status_code == 422
        items = (await ad.get("/v1/audit", params={"limit": 1000})).json()["items"][::-1]
    got = [(e["who"].split(" ")[0], e["outcome"]) for e in items if e["what"] == f"POST {path}"]
    assert got == [("operate", "422"), ("read", "403"), ("operate", "400"), ("read", "403"), ("operate", "422")]
    async with _client(url, "read") as ro:
        assert (await ro.get("/v1/incidents", params={"engine": sim.engine_id("n0002", 0)})).json()["total"] == 0


async def test_an_unknown_field_in_a_write_body_is_refused_and_starts_nothing(
        api: tuple[str, SimulatedCluster, Path]) -> None:  # noqa: F811
    url, sim, _ = api
    engine = sim.engine_id("n0001", 1)
    async with _client(url, "operate") as op, _client(url, "admin") as ad:
        r = await op.post(f"/v1/engines/{engine}/failover", json={"sucessor": "standby-1"})
        assert r.status_code == 422 and r.json()["error"] == "validation_error", r.text
        assert "sucessor" in r.json()["message"]
        r = await ad.post("/v1/engine-classes/reference/upgrade", json={"version": "v2", "forse": True})
        assert r.status_code == 422 and "forse" in r.json()["message"], r.text
        r = await op.post(f"/v1/engines/{engine}/failover", json={f"k{i}": i for i in range(5000)})
        assert r.status_code == 422 and len(r.json()["detail"]) == 20 and len(r.content) < 10_000, len(r.content)
        assert "4980 more errors" in r.json()["message"]  # each listed was 8.9 MB for 100,000 fields
        # a misspelt *value* too: no such successor (404), or the engine itself (409); no incident opens
        r = await op.post(f"/v1/engines/{engine}/failover", json={"successor": "standby-typo"})
        assert r.status_code == 404 and "standby-typo" in r.json()["message"], r.text
        r = await op.post(f"/v1/engines/{engine}/failover", json={"successor": engine})
        assert r.status_code == 409 and "itself" in r.json()["message"], r.text
        assert (await op.get("/v1/incidents", params={"engine": engine})).json()["total"] == 0
        assert (await ad.get("/v1/engine-classes/reference/upgrade")).status_code == 404
        r = await op.post(f"/v1/engines/{engine}/failover", json={})  # the same call, well formed, still works
        assert r.status_code == 202, r.text


async def test_an_audit_entry_keeps_a_bounded_path_however_long_the_one_asked(
        api: tuple[str, SimulatedCluster, Path]) -> None:  # noqa: F811
    url, _, _ = api
    long_id = "x" * 8000  # refused (ids are at most 200 characters), but recorded: a read token may fill the record
    async with _client(url, "read") as ro, _client(url, "operate") as op, _client(url, "admin") as ad:
        assert (await ro.post(f"/v1/engines/{long_id}/failover")).status_code == 403
        assert (await op.post(f"/v1/engines/{long_id}/failover")).status_code == 422
        items = (await ad.get("/v1/audit")).json()["items"]
    mine = [e for e in items if e["what"].startswith("POST /v1/engines/xxx")]
    assert [e["outcome"] for e in mine] == ["422", "403"]
    assert all(len(e["what"]) <= MAX_AUDIT_WHAT for e in mine), [len(e["what"]) for e in mine]
    assert all(e["what"].endswith("…") for e in mine)


async def test_a_failure_no_handler_types_is_still_a_json_error_and_audited() -> None:
    view = ClusterView()
    view.leases["L-1"] = LeaseInfo(id="L-1", node="n1", gpu=0, size=4096, chunk_size=4096, tag=Tag.WEIGHTS, owner="e1",
                                   epoch=1, state=LeaseState.ACTIVE, created_at=0.0, last_seen=0.0)
    c = ApiContext(settings=ControllerSettings(), view=view, store=None, bus=None, metrics=None,  # type: ignore[arg-type]
                   is_leader=lambda: False, admin_token="adm")  # no bus: the reclaim's node command fails inside
    transport = httpx.ASGITransport(app=create_app(c), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api",
                                 headers={"Authorization": "Bearer adm"}) as cl:
        r = await cl.post("/v1/leases/L-1/reclaim")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert r.json()["error"] == "internal" and "AttributeError" in r.json()["message"]
    assert [(e.what, e.outcome) for e in c.audit.newest(10)] == [("POST /v1/leases/L-1/reclaim", "internal: AttributeError")]


async def test_a_write_call_the_guard_refuses_as_too_large_is_audited(
        api: tuple[str, SimulatedCluster, Path]) -> None:  # noqa: F811
    """The guard answers 413 from the headers (or counting a chunked body) before the app: such a write attempt by an
    authenticated token was never written to the audit record. A read route's refusal is not a write: not recorded."""
    url, sim, _ = api
    path = f"/v1/engines/{sim.engine_id('n0002', 0)}/failover"
    big = b"x" * (2 << 20)  # over api_max_body_bytes (1 MiB by default)

    def chunks():  # no Content-Length: counted as it arrives
        yield big[:1 << 20]
        yield big[1 << 20:]

    async with _client(url, "operate") as op, _client(url, "admin") as ad:
        r = await op.post(path, content=big, headers=JSON)
        assert r.status_code == 413, r.text
        r = await op.post(path, content=_aiter(chunks()), headers=JSON)
        assert r.status_code == 413, r.text
        r = await op.request("GET", "/v1/engines", content=big)
        assert r.status_code == 413, r.text
        items = (await ad.get("/v1/audit", params={"limit": 1000})).json()["items"][::-1]
    got = [(e["who"].split(" ")[0], e["what"], e["outcome"]) for e in items]
    assert got == [("operate", f"POST {path}", "413")] * 2, got


async def _aiter(it):  # noqa: ANN001, ANN202
    for x in it:
        yield x


async def test_a_failover_or_drain_whose_earlier_attempt_ended_without_moving_the_engine_may_be_asked_again(
        api: tuple[str, SimulatedCluster, Path]) -> None:  # noqa: F811
    """An on-purpose incident that failed (no room elsewhere, no spec, a failed spawn) answered every later failover
    of that generation 409 for the record's 7 days, and a later drain started nothing and said nothing."""
    url, sim, _ = api
    engine = sim.engine_id("n0000", 0)
    base = incident_id_for(engine, 0, IncidentReason.MANUAL_FAILOVER)
    failed = apply(opened_record(id=base, engine_id=engine, reason=IncidentReason.MANUAL_FAILOVER, opened_at=0.0),
                   Trigger.DISPATCHED_FALLBACK, 0.0, D)
    await sim.store.put(incident_key(base), apply(failed, Trigger.DEADLINE_MISSED, 1.0, D))
    async with _client(url, "operate") as op:
        r = await op.post(f"/v1/engines/{engine}/failover", json={})
        assert r.status_code == 202 and r.json()["id"] == f"{base}-a2", r.text
        r = await op.post(f"/v1/engines/{engine}/failover", json={})  # the new attempt is open: one at a time
        assert r.status_code == 409, r.text
        r = await op.post("/v1/nodes/n0000/drain")
        assert r.status_code == 202, r.text
        out = r.json()
        assert f"{base}-a2" in out["not_moved"][engine], out  # said why, not silently skipped
        assert len(out["incidents"]) == 1 and set(out["engines"]) == {engine, sim.engine_id("n0000", 1)}, out
