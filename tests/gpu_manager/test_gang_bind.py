"""A process registers into a gang only the leases it speaks for (gangs.py invariant 8, gang.py invariant 11): its
own, and its own group's ranks' (`rank_engine_id`). Before: rank 0 alone was checked, so any engine could name
another live engine as a rank of its gang. That engine's failover was then refused `partial_gang` (its leases move
only with the gang), and a freeze of the binder's gang froze its live leases. Any process could also say hello under
a live engine's id and register that engine's leases as a gang of one, to the same end."""

from __future__ import annotations

import json

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import Freeze, FreezeReply, LeaseState
from tests.gpu_manager.harness import ManagerProc
from tests.gpu_manager.test_gang_socket import rows


def register(gang_id: str, owners: list[str]) -> str:
    return f"call gang_register {json.dumps({'gang_id': gang_id, 'owners': owners})}"


async def test_an_engine_cannot_bind_another_live_engines_leases_into_its_gang_and_that_ones_failover_works(
        manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    victim = engines(manager, "eng-victim")
    lease = victim.ask("write 4096 1 weights")["lease"]
    binder = engines(manager, "att")
    assert "lease" in binder.ask("write 4096 2 weights")
    before = await rows(bus, settings)

    refused = binder.ask(register("g", ["att", "eng-victim"]))  # another engine as its rank 1
    assert refused["code"] == "permission_denied" and "own group" in refused["message"], refused
    impostor = engines(manager, "eng-victim")  # another process, saying hello under the live victim's id
    refused = impostor.ask(register("g", ["eng-victim"]))
    assert refused["code"] == "permission_denied" and "not held by this process" in refused["message"], refused
    assert await rows(bus, settings) == before

    # no gang holds the victim's lease: its successor takes it over alone, as any engine's
    victim.kill()
    frozen = await bus.request(settings.node, Freeze(owner="eng-victim"), FreezeReply)
    assert [i.id for i in frozen.leases] == [lease]
    taken = engines(manager, "eng-next").ask(f"takeover eng-victim {frozen.transfer_token}")
    assert taken["leases"] == {lease: 2}, taken
    assert {(o, s) for _, o, _, s in await rows(bus, settings)} == {("att", LeaseState.ACTIVE.value),
                                                                     ("eng-next", LeaseState.ACTIVE.value)}


async def test_a_group_registers_its_own_ranks_leases(
        manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    group = [engines(manager, engine_id) for engine_id in ("grp", "grp-r1")]
    for seed, e in enumerate(group):
        assert "lease" in e.ask(f"write 4096 {seed} weights")
    assert group[1].ask(register("grp", ["grp", "grp-r1"]))["code"] == "permission_denied"  # rank 0 registers it
    assert group[0].ask(register("grp", ["grp", "grp-r1"])) == {"code": "ok"}
