"""Reservations (`MemoryClient.reserve`): a warm standby keeps the addresses where a takeover will map its
predecessor's lease, backed by placeholder memory of its own; views made over them before the takeover read the
lease after it (host backend, real gpu_manager, a real SIGKILL)."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from libs.client.memory import MemoryClient, manager_split
from libs.common.events import Freeze, FreezeReply, ShareWeights, ShareWeightsReply
from tests.gpu_manager.conftest import engines, manager_factory  # noqa: F401 - fixtures

N = 3 * 1024 * 1024 + 7  # 4 chunks of the fixture's 1 MiB
NODE = "node-1"
PLACEHOLDER = 64 * 1024


def _placeholder_mappings() -> int:
    with open(f"/proc/{os.getpid()}/maps") as f:
        return sum("hf-placeholder" in line for line in f)


async def _frozen_after_kill(manager, start_engine, bus, seed: int) -> tuple[dict, str]:  # noqa: ANN001
    owner = start_engine(manager, "eng-owner")
    wrote = owner.ask(f"write {N} {seed}")
    frozen = await bus.request(NODE, Freeze(owner="eng-owner", incident_id=f"inc-{seed}"), FreezeReply)
    owner.kill()
    return wrote, frozen.transfer_token


async def test_a_view_made_over_a_reservation_before_the_takeover_reads_the_handed_on_lease(manager, engines, bus):  # noqa: F811
    with MemoryClient.connect("eng-sb", socket_path=manager.socket) as client:
        res = client.reserve(N, tag="weights", name="data", placeholder_bytes=PLACEHOLDER)
        early = res.torch("uint8", (N,))  # what a runner captured over the standby's addresses holds
        assert res.size >= N and _placeholder_mappings() == -(-res.size // PLACEHOLDER)
        early[0] = 7  # one placeholder backs every run of the range (virtual aliasing): its bytes show everywhere
        assert int(early[PLACEHOLDER]) == 7 and int(early[N // PLACEHOLDER * PLACEHOLDER]) == 7

        wrote, token = await _frozen_after_kill(manager, engines, bus, 3)
        att = client.takeover("eng-owner", token)
        lease = att.leases[0]
        assert lease.id == wrote["lease"] and lease.ptr == res.ptr  # mapped into the reservation
        assert client.last_timings_ms["reserved"] == 1 and client.reservations == []
        # the request split by the manager's marks: to it, its parse, its wait for the lease table, its grant, and
        # back; the parts add up to the request (the clock is the host's: same on both sides)
        manager_ms = client.last_timings_ms["manager_ms"]
        parts = ("to_manager_ms", "parsed_ms", "lock_wait_ms", "grant_ms", "back_ms")
        assert set(manager_ms) == set(parts) and min(manager_ms.values()) >= 0
        assert sum(manager_ms.values()) == pytest.approx(client.last_timings_ms["request_ms"], abs=0.05)
        assert hashlib.sha256(early.numpy().tobytes()).hexdigest() == wrote["expected"]
        assert _placeholder_mappings() == 0  # the placeholder gave way page for page


async def test_a_lease_of_another_size_is_mapped_elsewhere_and_the_reservation_freed(manager, engines, bus):  # noqa: F811
    with MemoryClient.connect("eng-sb2", socket_path=manager.socket) as client:
        res = client.reserve(N + 8192, tag="weights", name="data", placeholder_bytes=PLACEHOLDER)
        kept = client.reserve(N, tag="kv_cache", name="data", placeholder_bytes=PLACEHOLDER)  # another tag
        ptrs = {res.ptr, kept.ptr}
        wrote, token = await _frozen_after_kill(manager, engines, bus, 4)
        att = client.takeover("eng-owner", token)
        lease = att.leases[0]
        assert lease.ptr not in ptrs and client.last_timings_ms["reserved"] == 0
        assert client.reservations == [] and _placeholder_mappings() == 0
        view = att.tensors("torch")["data"]
        assert hashlib.sha256(view.numpy().tobytes()).hexdigest() == wrote["expected"]
        assert isinstance(view, torch.Tensor)


def _perms(lease_id: str) -> set[str]:
    """The permission strings of this process's mappings of the lease's memfds (e.g. {'r--s'})."""
    with open(f"/proc/{os.getpid()}/maps") as f:
        return {line.split()[1] for line in f if f"hf-{lease_id}-" in line}


async def test_a_shadow_into_a_reservation_is_given_back_and_taken_over_in_place(manager, engines, bus):  # noqa: F811
    """A prepared standby's shadow (engines/batched/standby.py): the owner's weights and KV cache mapped read-only
    into the reservations while the owner serves (it stays their one writer); dropped, the placeholders come back
    at the same addresses; shadowed again and taken over, nothing is mapped at the takeover, the weights stay
    read-only and the cache becomes this process's to write."""
    with MemoryClient.connect("eng-sb3", socket_path=manager.socket) as client:
        wres = client.reserve(N, tag="weights", name="weights", placeholder_bytes=PLACEHOLDER)
        kres = client.reserve(N, tag="kv_cache", name="kv_cache", placeholder_bytes=PLACEHOLDER)
        weights, cache = wres.torch("uint8", (N,)), kres.torch("uint8", (N,))
        owner = engines(manager, "eng-owner")
        w = owner.ask(f"write {N} 6 weights")
        k = owner.ask(f"write {N} 7 kv_cache")
        grant = await bus.request(NODE, ShareWeights(owner="eng-owner", grantee="eng-sb3"), ShareWeightsReply)

        att = client.share("eng-owner", grant.share_token, into_reserved=True)
        assert {lease.ptr for lease in att.leases} == {wres.ptr, kres.ptr} and client.reservations == []
        assert hashlib.sha256(weights.numpy().tobytes()).hexdigest() == w["expected"]  # the owner's bytes
        assert hashlib.sha256(cache.numpy().tobytes()).hexdigest() == k["expected"]
        assert _perms(w["lease"]) == {"r--s"} and _perms(k["lease"]) == {"r--s"} and _placeholder_mappings() == 0

        client.unshare()  # the owner went away, say: the placeholders are back, the addresses kept
        assert sorted(r.ptr for r in client.reservations) == sorted([wres.ptr, kres.ptr])
        assert _perms(w["lease"]) == set() and _perms(k["lease"]) == set()
        assert _placeholder_mappings() == 2 * -(-wres.size // PLACEHOLDER)
        cache[0] = 9  # the placeholder's memory again (aliased everywhere), not the owner's
        assert int(cache[PLACEHOLDER]) == 9 and owner.ask("hash")["kv_cache"] == k["expected"]

        client.share("eng-owner", grant.share_token, into_reserved=True)
        shared = client.share("eng-owner", grant.share_token, into_reserved=True)  # again: the last one dropped first
        metas = {lease.id: list(lease.tensor_metas) for lease in shared.leases}
        assert client.reservations == [] and len(client.shadow_reservations) == 2
        frozen = await bus.request(NODE, Freeze(owner="eng-owner", incident_id="inc-shadow"), FreezeReply)
        owner.kill()
        taken = client.takeover("eng-owner", frozen.transfer_token)
        assert {lease.ptr for lease in taken.leases} == {wres.ptr, kres.ptr}
        assert client.last_timings_ms["reserved"] == 0 and client.reservations == []  # nothing mapped now
        # granted as held: the layouts are those it shadowed, so no fd and no tensor came; it keeps the shadow's
        assert {k: v[:2] for k, v in client.last_timings_ms["leases"].items()} == {
            "weights:weights": ["held", 0], "kv_cache:kv_cache": ["held", 0]}
        assert {lease.id: lease.tensor_metas for lease in taken.leases} == metas
        assert _perms(w["lease"]) == {"r--s"} and _perms(k["lease"]) == {"rw-s"}
        assert hashlib.sha256(cache.numpy().tobytes()).hexdigest() == k["expected"]
        cache[0] = 1  # this process's cache now
        assert int(cache[0]) == 1


async def test_a_shadow_whose_layout_changed_since_is_granted_its_fds_and_tensors_again(manager, engines, bus):  # noqa: F811
    with MemoryClient.connect("eng-sb6", socket_path=manager.socket) as client:
        owner = engines(manager, "eng-owner")
        w = owner.ask(f"write {N} 8 weights")
        grant = await bus.request(NODE, ShareWeights(owner="eng-owner", grantee="eng-sb6"), ShareWeightsReply)
        client.share("eng-owner", grant.share_token)
        shadow = client.shared[w["lease"]]
        # as if the owner had registered another layout after this share: the hash it holds is not the lease's
        shadow.info = shadow.info.model_copy(update={"layout_hash": "0" * 64})
        frozen = await bus.request(NODE, Freeze(owner="eng-owner", incident_id="inc-relayout"), FreezeReply)
        owner.kill()
        taken = client.takeover("eng-owner", frozen.transfer_token)
        how, nfds, _ = client.last_timings_ms["leases"]["weights:weights"]
        assert how == "held" and nfds == 4  # its mapping kept, every chunk's fd sent, the lease's tensors taken
        assert taken.leases[0] is shadow and shadow.tensor_metas and shadow.info.layout_hash != "0" * 64
        assert hashlib.sha256(shadow.torch("uint8", (N,)).numpy().tobytes()).hexdigest() == w["expected"]


@pytest.mark.gpu
async def test_on_cuda_the_shadowed_cache_is_mapped_writable_and_the_takeover_grants_nothing(
        manager_factory, engines, bus):  # noqa: F811, ANN001
    """On the cuda backend the shadow maps the owner's KV cache read-write (memory.py `_map_grant`: a shadowing
    standby runs no GPU work, and making the cache writable at the takeover cost 10-20 ms of its map on an H100),
    the weights read-only where the driver grants it; the takeover then maps and grants nothing, the bytes are the
    owner's and the cache takes this process's writes."""
    manager = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="2", HF_GRACE_S="30").start()
    n = 64 * 1024 * 1024
    with MemoryClient.connect("eng-sb5", socket_path=manager.socket) as client:
        wres = client.reserve(n, tag="weights", name="weights", placeholder_bytes=4 << 20)
        kres = client.reserve(n, tag="kv_cache", name="kv_cache", placeholder_bytes=4 << 20)
        owner = engines(manager, "eng-owner", backend="cuda")
        w = owner.ask(f"write {n} 10 weights")
        k = owner.ask(f"write {n} 11 kv_cache")
        grant = await bus.request(NODE, ShareWeights(owner="eng-owner", grantee="eng-sb5"), ShareWeightsReply)
        att = client.share("eng-owner", grant.share_token, into_reserved=True)
        by_id = {lease.id: lease for lease in att.leases}
        assert {lease.ptr for lease in att.leases} == {wres.ptr, kres.ptr}
        assert not by_id[k["lease"]].mapping.read_only  # the cache: read-write while shadowed
        weights_read_only = by_id[w["lease"]].mapping.read_only  # where this driver grants read-only access
        frozen = await bus.request(NODE, Freeze(owner="eng-owner", incident_id="inc-cuda-rw"), FreezeReply)
        owner.kill()
        client.takeover("eng-owner", frozen.transfer_token)
        held = client.last_timings_ms["leases"]
        assert held["kv_cache:kv_cache"][0] == "held" and held["weights:weights"][0] == "held"
        assert by_id[w["lease"]].mapping.read_only == weights_read_only  # the weights stay as they were
        cache = kres.torch("uint8", (n,))
        assert hashlib.sha256(cache.cpu().numpy().tobytes()).hexdigest() == k["expected"]
        cache[0] = 1
        torch.cuda.synchronize()
        assert int(cache[0]) == 1


def test_the_split_places_the_managers_marks_in_the_request_and_passes_an_older_managers_on() -> None:
    took = {"read_wall": 100.002, "parsed_ms": 0.1, "lock_wait_ms": 0.4, "grant_ms": 1.5}
    split = manager_split(took, sent_wall=100.0, request_ms=5.0)
    assert split == pytest.approx({"to_manager_ms": 2.0, "parsed_ms": 0.1, "lock_wait_ms": 0.4, "grant_ms": 1.5,
                                   "back_ms": 1.0})
    assert manager_split({"lock_wait_ms": 0.4, "grant_ms": 1.5}, 100.0, 5.0) == {"lock_wait_ms": 0.4, "grant_ms": 1.5}
