"""Read-only shares of weights for warm standbys (the `share` command and the engine socket's `share`)."""

from __future__ import annotations

import signal

import pytest

from libs.common.errors import RemoteError
from libs.common.events import (
    Freeze,
    FreezeReply,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    ShareWeights,
    ShareWeightsReply,
)

N = 3 * 1024 * 1024 + 7
NODE = "node-1"



def _memfd_perms(pid: int, lease_id: str) -> set[str]:
    """The permission strings of this process's mappings of the lease's memfds (e.g. {'r--s'})."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[1] for line in f if f"hf-{lease_id}-" in line}


async def test_a_standby_maps_the_owners_weights_read_only_and_only_with_its_own_token(manager, engines, bus):
    owner = engines(manager, "eng-owner")
    wrote = owner.ask(f"write {N} 5")
    grant = await bus.request(NODE, ShareWeights(owner="eng-owner", grantee="eng-sb"), ShareWeightsReply)
    assert grant.lease_ids == [wrote["lease"]] and grant.bytes >= N
    again = await bus.request(NODE, ShareWeights(owner="eng-owner", grantee="eng-sb"), ShareWeightsReply)
    assert again.share_token == grant.share_token  # one grant per (owner, grantee)

    intruder = engines(manager, "eng-intruder")
    assert intruder.ask(f"share eng-owner {grant.share_token}")["code"] == "permission_denied"
    standby = engines(manager, "eng-sb")
    assert standby.ask("share eng-owner not-the-token")["code"] == "permission_denied"
    assert standby.ask(f"share eng-other {grant.share_token}")["code"] == "permission_denied"

    shadow = standby.ask(f"share eng-owner {grant.share_token}")
    assert shadow["data"] == wrote["expected"]
    assert shadow["read_only"] == {wrote["lease"]: True}
    assert _memfd_perms(standby.pid, wrote["lease"]) == {"r--s"}
    assert "w" in "".join(_memfd_perms(owner.pid, wrote["lease"]))

    # Nothing changed hands: the owner still holds its lease, at its epoch.
    listed = await bus.request(NODE, ListLeases(owner="eng-owner"), ListLeasesReply)
    assert [(i.id, i.state, i.epoch) for i in listed.leases] == [(wrote["lease"], LeaseState.ACTIVE, 1)]
    assert owner.ask("hash")["data"] == wrote["expected"]

    with pytest.raises(RemoteError) as none:
        await bus.request(NODE, ShareWeights(owner="eng-nobody", grantee="eng-sb"), ShareWeightsReply)
    assert none.value.remote_code == "not_found"


async def test_a_share_maps_the_owners_kv_cache_read_only_too_but_no_other_lease(manager, engines, bus):
    owner = engines(manager, "eng-owner")
    weights = owner.ask(f"write {N} 5")
    kv = owner.ask(f"write {N} 6 kv_cache")
    other = owner.ask(f"write {N} 7 other")
    grant = await bus.request(NODE, ShareWeights(owner="eng-owner", grantee="eng-sb"), ShareWeightsReply)
    assert sorted(grant.lease_ids) == sorted([weights["lease"], kv["lease"]]) and grant.bytes >= 2 * N

    shadow = engines(manager, "eng-sb").ask(f"share eng-owner {grant.share_token}")
    assert shadow["read_only"] == {weights["lease"]: True, kv["lease"]: True}
    assert shadow["kv_cache"] == kv["expected"] and "other" not in shadow
    listed = await bus.request(NODE, ListLeases(owner="eng-owner"), ListLeasesReply)
    assert {i.id for i in listed.leases} == {weights["lease"], kv["lease"], other["lease"]}


async def test_a_shadow_takes_the_leases_over_after_the_owners_death_keeping_its_mapping(manager, engines, bus):
    owner = engines(manager, "eng-owner")
    wrote = owner.ask(f"write {N} 6")
    grant = await bus.request(NODE, ShareWeights(owner="eng-owner", grantee="eng-sb"), ShareWeightsReply)
    standby = engines(manager, "eng-sb")
    shadow_ptr = standby.ask(f"share eng-owner {grant.share_token}")["ptrs"][wrote["lease"]]

    frozen = await bus.request(NODE, Freeze(owner="eng-owner", incident_id="inc-sh"), FreezeReply)
    assert standby.ask(f"takeover eng-owner {frozen.transfer_token}")["code"] == "predecessor_alive"
    owner.kill()
    got = standby.ask(f"takeover eng-owner {frozen.transfer_token}")
    assert got["leases"] == {wrote["lease"]: 2} and got["data"] == wrote["expected"]
    status = standby.ask("status")
    assert status["ptrs"] == {wrote["lease"]: shadow_ptr}  # the shadow's mapping, now owned: nothing re-mapped
    assert status["shared"] == {}
    # Asking again what it holds (after a reply lost to a broken connection, the SDK's caller does this) gives
    # the same lease at the same epoch over the same mapping: nothing is unmapped under the model.
    again = standby.ask("attach")
    assert again["leases"] == {wrote["lease"]: 2} and again["data"] == wrote["expected"]
    assert standby.ask("status")["ptrs"] == {wrote["lease"]: shadow_ptr}
    listed = await bus.request(NODE, ListLeases(owner="eng-sb"), ListLeasesReply)
    assert [(i.id, i.state, i.epoch) for i in listed.leases] == [(wrote["lease"], LeaseState.ACTIVE, 2)]


async def test_a_shadow_that_writes_faults_and_the_owners_bytes_stay_as_they_were(manager, engines, bus):
    owner = engines(manager, "eng-owner")
    wrote = owner.ask(f"write {N} 7")
    grant = await bus.request(NODE, ShareWeights(owner="eng-owner", grantee="eng-sb"), ShareWeightsReply)
    standby = engines(manager, "eng-sb")
    standby.ask(f"share eng-owner {grant.share_token}")
    with pytest.raises(RuntimeError):
        standby.ask("poke")
    assert standby.proc.wait(10) == -signal.SIGSEGV
    assert owner.ask("hash")["data"] == wrote["expected"]


async def test_a_share_cut_off_by_a_manager_restart_is_asked_again_and_maps_the_owners_weights(manager, engines, bus):
    from tests.gpu_manager.harness import until

    owner = engines(manager, "eng-owner")
    wrote = owner.ask(f"write {N} 8")
    assert owner.ask("heartbeats 0.1") == {"ok": True}  # reconnects by itself after the restart
    standby = engines(manager, "eng-sb")  # its socket breaks unseen: its next call finds it broken
    assert standby.ask("status")["connected"]
    manager.kill()
    manager.start()
    await until(lambda: owner.ask("status")["connected"])
    grant = await bus.request(NODE, ShareWeights(owner="eng-owner", grantee="eng-sb"), ShareWeightsReply)
    shadow = standby.ask(f"share eng-owner {grant.share_token}")
    assert shadow["data"] == wrote["expected"] and shadow["read_only"] == {wrote["lease"]: True}
