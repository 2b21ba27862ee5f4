"""The admin API's audit record: every state-changing call, who, what, when, outcome; admin only to list."""

from __future__ import annotations

import time

from devstack.simcluster import SimulatedCluster
from tests.controller.test_api import ADMIN, READER, _client, api  # noqa: F401 - `api` is the fixture used here


async def test_every_admin_action_is_audited_with_its_outcome_and_a_read_token_gets_403(
        api: tuple[str, SimulatedCluster]) -> None:  # noqa: F811
    url, sim = api
    t0 = time.time()
    async with _client(url) as admin, _client(url, READER) as ro:
        lease = f"L-{sim.engine_id('n0000', 1)}"
        assert (await admin.post(f"/v1/leases/{lease}/reclaim")).status_code == 200
        assert (await admin.post("/v1/leases/L-nope/reclaim")).status_code == 404
        assert (await admin.post("/v1/nodes/n0002/drain")).status_code == 202
        sleeper = sim.engine_id("n0003", 0)
        bad = await admin.post(f"/v1/engines/{sleeper}/sleep", content=b'{"level": NaN}',
                               headers={"content-type": "application/json"})
        assert bad.status_code == 422  # the client's error: audited as such, not as the service's
        for path in (f"/v1/leases/{lease}/reclaim", "/v1/nodes/n0001/drain",
                     f"/v1/engines/{sim.engine_id('n0001', 0)}/failover"):
            assert (await ro.post(path)).status_code == 403
        assert (await ro.get("/v1/audit")).status_code == 403
        r = await admin.get("/v1/audit")
        assert r.status_code == 200
        items = r.json()["items"][::-1]  # oldest first
    got = [(e["what"], e["outcome"], e["who"].split(" ")[0]) for e in items]
    assert got == [
        (f"POST /v1/leases/{lease}/reclaim", "ok", "admin"),
        ("POST /v1/leases/L-nope/reclaim", "not_found", "admin"),
        ("POST /v1/nodes/n0002/drain", "ok", "admin"),
        (f"POST /v1/engines/{sleeper}/sleep", "422", "admin"),
        (f"POST /v1/leases/{lease}/reclaim", "403", "read"),
        ("POST /v1/nodes/n0001/drain", "403", "read"),
        (f"POST /v1/engines/{sim.engine_id('n0001', 0)}/failover", "403", "read"),
    ]
    assert all(t0 <= e["time"] <= time.time() and "127.0.0.1" in e["who"] for e in items)
    assert not any(ADMIN in e["who"] or READER in e["who"] for e in items)  # fingerprints, never tokens
