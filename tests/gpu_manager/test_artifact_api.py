"""`POST /v1/leases/{id}/snapshot` on a real controller reaches the lease's node's gpu_manager (a node command)
and answers once the artifact is whole; `holdfast snapshot` is the same call from the command line."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from libs.client.memory import MemoryClient
from services.gpu_manager.artifact import read_manifest
from tests.gpu_manager.conftest import AdminApi

MIB = 1024 * 1024


async def test_the_snapshot_route_and_command_write_the_artifact_on_the_node(manager_factory, admin_api: AdminApi,
                                                                             tmp_path: Path):
    artifacts = tmp_path / "artifacts"
    manager = manager_factory(HF_ARTIFACT_DIR=str(artifacts)).start()

    def engine() -> tuple[MemoryClient, str]:
        c = MemoryClient.connect("eng-api", socket_path=manager.socket, engine_class="cls")
        lease = c.allocate(2 * MIB, tag="weights", name="w")
        lease.numpy("uint8", (2 * MIB,))[:] = 7
        c.register([lease.meta("t", "uint8", (2 * MIB,))])
        c.commit()
        return c, lease.id

    client, lease_id = await asyncio.to_thread(engine)
    c = admin_api.http
    await admin_api.wait_lease_of("eng-api")
    assert (await c.post("/v1/leases/lease-nope/snapshot")).status_code == 404
    r = await c.post(f"/v1/leases/{lease_id}/snapshot", json={"artifact": "by-api"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["artifact"] == "by-api" and r.json()["bytes"] == 2 * MIB
    assert read_manifest(artifacts / "by-api").root == r.json()["root_hash"]
    r = await c.post(f"/v1/leases/{lease_id}/snapshot", json={"artifact": "../escape"})
    assert r.status_code == 422

    cli = await admin_api.cli("snapshot", lease_id)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert '"artifact": "cls.w"' in cli.stdout
    man = read_manifest(artifacts / "cls.w")
    assert man.source_lease == lease_id and man.engine_class == "cls"
    data = (artifacts / "cls.w" / "data-000.bin").read_bytes()
    assert np.all(np.frombuffer(data, dtype=np.uint8) == 7)
    client.close()
