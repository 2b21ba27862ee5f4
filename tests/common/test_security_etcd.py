"""etcd with TLS client certificates and RBAC on key ranges, as the stack sets it up (`/holdfast/`, the real
per-identity ranges of security.policy): an etcd of this module's own, the session's CA and certificates."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aetcd
import grpc
import pytest
from aetcd import rpc

from libs.common import procs
from libs.common.config import CommonSettings
from libs.common.security import identities, mint
from libs.common.security.servers import etcd_setup, etcd_tls_flags
from libs.common.store import Store

NODES = ["node-1", "node-2"]


@pytest.fixture(scope="module")
def secured_etcd(infra_dir: Path, credentials: Path) -> Iterator[str]:
    port, peer = procs.free_port(), procs.free_port()
    data = infra_dir / f"etcd-rbac-{port}"
    child = procs.etcd_server(port, peer, data, infra_dir / "etcd-rbac.log", tls_flags=etcd_tls_flags(credentials)).start()
    try:
        procs.wait_port(port, child)
        etcd_setup(f"127.0.0.1:{port}", credentials, identities(NODES), prefix="/holdfast/")
        yield f"127.0.0.1:{port}"
    finally:
        child.stop()


@pytest.fixture
async def as_(secured_etcd: str, credentials: Path, tmp_path: Path) -> AsyncIterator[object]:
    opened: list[Store] = []

    async def connect(source: str, node: str = "node-1") -> Store:
        s = CommonSettings(etcd_endpoints=secured_etcd, credentials_dir=credentials, node=node, state_dir=tmp_path)
        store = await Store.connect(s, source=source, timeout=5)
        opened.append(store)
        return store

    yield connect
    for s in opened:
        await s.close()


def _denied(e: BaseException) -> bool:
    return "permission denied" in str(e).lower()


async def _refused(coro: object) -> None:
    with pytest.raises(Exception) as info:  # noqa: PT011 - aetcd wraps gRPC's PERMISSION_DENIED in its own error
        await coro  # type: ignore[misc]
    assert _denied(info.value), repr(info.value)


async def test_an_anonymous_client_can_neither_read_nor_write(secured_etcd: str, credentials: Path) -> None:
    host, port = secured_etcd.split(":")
    plain = aetcd.Client(host=host, port=int(port), timeout=2)  # no TLS at all
    with pytest.raises(Exception):  # noqa: PT011, B017 - the TLS-only listener drops the plaintext connection
        await plain.put(b"/holdfast/endpoints/m/e", b"evil")
    await plain.close()
    # TLS against the right CA, but no client certificate: the handshake is refused
    channel = grpc.aio.secure_channel(secured_etcd, grpc.ssl_channel_credentials((credentials / "ca.pem").read_bytes()))
    with pytest.raises(grpc.RpcError):
        await rpc.KVStub(channel).Range(rpc.RangeRequest(key=b"/holdfast/"), timeout=2)
    with pytest.raises(grpc.RpcError):
        await rpc.KVStub(channel).Put(rpc.PutRequest(key=b"/holdfast/incidents/x", value=b"evil"), timeout=2)
    await channel.close()


async def test_a_certificate_from_another_ca_is_refused(secured_etcd: str, tmp_path: Path, credentials: Path) -> None:
    other = mint(tmp_path / "other", ["controller"])  # same names, a CA etcd does not trust
    channel = grpc.aio.secure_channel(secured_etcd, grpc.ssl_channel_credentials(
        (credentials / "ca.pem").read_bytes(), (other / "controller.key").read_bytes(), (other / "controller.pem").read_bytes()))
    with pytest.raises(grpc.RpcError):
        await rpc.KVStub(channel).Put(rpc.PutRequest(key=b"/holdfast/incidents/x", value=b"evil"), timeout=2)
    await channel.close()


async def test_a_nodes_gpu_manager_writes_its_own_node_only(as_) -> None:  # type: ignore[no-untyped-def]
    gm = await as_("gpu_manager:node-1")
    await gm.put("allocations/node-1/l1", {"ok": True})
    await _refused(gm.put("allocations/node-2/l1", {"evil": True}))
    await _refused(gm.put("endpoints/m/e", {"url": "http://evil"}))
    await _refused(gm.put("incidents/i1", {"evil": True}))
    assert await gm.get("allocations/node-1/l1") is not None  # and it reads what the node's mirror needs


async def test_a_nodes_agent_writes_its_node_key_not_anothers(as_) -> None:  # type: ignore[no-untyped-def]
    agent = await as_("agent:node-2", node="node-2")
    await agent.put("nodes/node-2", {"node": "node-2"})
    await _refused(agent.put("nodes/node-1", {"node": "evil"}))
    await _refused(agent.put("allocations/node-2/l1", {"evil": True}))  # the gpu_manager's, not the agent's
    await agent.put("engines/node-2/e2", {"engine_id": "e2"})  # its own engines' records, and no other node's
    await _refused(agent.put("engines/node-1/e1", {"engine_id": "e1", "node": "node-2"}))
    await _refused(agent.put("engines/e1", {"engine_id": "e1"}))  # nor a key outside every node's range


async def test_the_router_reads_endpoints_and_writes_nothing(as_) -> None:  # type: ignore[no-untyped-def]
    controller = await as_("controller:c1")
    await controller.put("endpoints/m/e1", {"url": "http://127.0.0.1:1"})
    await controller.put("incidents/i1", {"id": "i1"})
    router = await as_("router:r1")
    assert await router.get_prefix("endpoints/") != {}
    await _refused(router.put("endpoints/m/e2", {"url": "http://evil"}))
    await _refused(router.delete("endpoints/m/e1"))
    await _refused(router.get("incidents/i1"))


async def test_the_controller_owns_incidents_and_endpoints_and_the_dc_manager_its_progress(as_) -> None:  # type: ignore[no-untyped-def]
    controller = await as_("controller:c1")
    assert await controller.create("incidents/i2", {"id": "i2"})
    dcm = await as_("dc_manager:d1")
    await dcm.put("dcm/intents/i2", {"step": "freeze"})
    await _refused(dcm.put("incidents/i2", {"evil": True}))
    await _refused(dcm.put("endpoints/m/e9", {"url": "http://evil"}))
    assert await dcm.get("leader/controller") is None  # it reads the controller's term (libs/common/terms.py)
    lease = await dcm.grant(2)  # leases need no key permission; the key bound to one does
    for key in ("leader/controller", "leader/dc_manager"):  # it runs no election: it could only depose the leader
        await _refused(dcm.put(key, {"who": "d1"}, lease=lease))
        await _refused(dcm.put(key, "not-a-controller"))
    await asyncio.sleep(0)
