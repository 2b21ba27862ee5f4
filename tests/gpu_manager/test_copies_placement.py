"""A node's weight copies reach placement (issues 21, 22): the gpu_manager publishes its peer leases, host tier and
artifact copies in its GPU records in etcd, and a cold start of that class is placed on the node holding one, over
a node with more free memory and none."""

from __future__ import annotations

import asyncio
import json

from libs.common.cluster_view import GpuSlot
from services.dc_manager.placement import Action, node_copies, place
from tests.gpu_manager.harness import until
from tests.gpu_manager.test_tier import MIB, load

G = 1 << 30


async def test_a_cold_start_goes_to_the_node_whose_gpu_manager_published_a_host_copy(manager_factory, store,
                                                                                    tmp_path):
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_CLASSES='["tiered"]',
                        HF_HOST_TIER_BYTES=str(4 * MIB), HF_ARTIFACT_BLOCK_BYTES=str(MIB),
                        HF_ARTIFACT_FILE_BYTES=str(2 * MIB)).start()
    client, lease_id, _ = await asyncio.to_thread(load, m, "eng-c1", "tiered", 5)  # the policy copies it to the tier

    async def record(kind: str) -> dict | None:
        raw = await store.get("gpus/node-1/0")
        rec = json.loads(raw) if raw else None
        return rec if rec and rec.get("copies", {}).get("tiered.w") == kind else None

    slots = [GpuSlot("node-1", 0, True, 80 * G, 60 * G, 1), GpuSlot("node-2", 0, True, 80 * G, 0, 0)]
    # While its engine runs, the lease the copy was written from (hashed by that write) is a peer: the closest copy.
    peer = await until(lambda: record("peer"))
    p = place("node-3", 0, memory_lost=True, needed_bytes=10 * G, slots=slots, alive={"node-1", "node-2"},
              copies=node_copies({("node-1", 0): peer, ("node-2", 0): {"copies": {}}}, "tiered"))
    assert p.node == "node-1" and "weights from peer" in p.reason
    await asyncio.to_thread(client.release, lease_id)  # the engine gone: the host tier's copy is the closest

    published = await until(lambda: record("host"))
    records = {("node-1", 0): published, ("node-2", 0): {"copies": {}}}
    copies = node_copies(records, "tiered")
    assert copies == {"node-1": "host"}
    p = place("node-3", 0, memory_lost=True, needed_bytes=10 * G, slots=slots, alive={"node-1", "node-2"},
              copies=copies)
    assert (p.action, p.node) == (Action.COLD_START, "node-1") and "weights from host" in p.reason
    other = place("node-3", 0, memory_lost=True, needed_bytes=10 * G, slots=slots, alive={"node-1", "node-2"},
                  copies=node_copies(records, "untiered"))
    assert other.node == "node-2"  # no copy of that class anywhere: the most free memory
    client.close()


async def test_a_gpu_managers_nvlinks_reach_placement_through_etcd(manager_factory, store):
    """Config `gpu_links` (the host backend's stand-in for NVML): each GPU's record in etcd names the GPUs it reaches,
    the dc_manager's view reads them into its slots, and a group of 2 goes on the linked pair 0 and 2."""
    from libs.common.cluster_view import ClusterView

    manager_factory(HF_GPUS='["0","1","2"]', HF_GPU_LINKS='["0-2"]', HF_GPU_PUBLISH_INTERVAL_S="0.1").start()

    async def records() -> dict | None:
        got = {g: await store.get(f"gpus/node-1/{g}") for g in range(3)}
        return got if all(got.values()) else None

    recs = await until(records)
    assert [json.loads(recs[g])["links"] for g in range(3)] == [[2], [], [0]]
    view = ClusterView()
    view.apply("put", "nodes/node-1", json.dumps({"node": "node-1", "gpus": []}).encode())
    for g, raw in recs.items():
        view.apply("put", f"gpus/node-1/{g}", raw)
    p = place("node-1", 0, memory_lost=True, needed_bytes=1, slots=view.gpu_slots(), alive={"node-1"}, tp=2)
    assert (p.action, p.gpus) == (Action.COLD_START, (0, 2))
