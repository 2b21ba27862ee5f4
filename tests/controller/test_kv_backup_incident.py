"""An engine whose KV cache is backed up to host (engines/batched/backup.py): the loss of its cache's lease keeps its
incident on the reattach path while the backup and the weights live (intake.py `recoverable_without`), any other
loss still goes to the fallback (cold start, the router's replay), and the reattach's timeline row says where the
successor's KV came from (pure: no I/O)."""

from __future__ import annotations

import time

from libs.common.events import (
    KV_BACKUP_LEASE,
    EngineInfo,
    EngineReattached,
    EngineRole,
    Envelope,
    IntentResult,
    LeaseInfo,
    LeaseState,
    Step,
    Tag,
)
from services.controller.incident import Deadlines, Trigger, apply, opened_record
from services.controller.intake import Intake, recoverable_without
from services.controller.moves import next_record, result_moves
from services.controller.open_incidents import OpenIncidents
from services.controller.view import ClusterView

D = Deadlines(freeze_s=1, reattach_s=2, fallback_s=3)


def lease(i: str, tag: Tag, name: str = "", state: LeaseState = LeaseState.ACTIVE) -> LeaseInfo:
    return LeaseInfo(id=i, node="n", gpu=0, size=1, chunk_size=1, tag=tag, name=name, owner="e", epoch=1, state=state,
                     created_at=time.time(), last_seen=time.time())


WEIGHTS, KV = lease("w", Tag.WEIGHTS, "weights"), lease("kv", Tag.KV_CACHE, "kv_cache")
BACKUP = lease("bk", Tag.OTHER, KV_BACKUP_LEASE)


def test_a_lost_cache_is_recoverable_only_while_its_backup_and_the_weights_live() -> None:
    assert recoverable_without(KV, [WEIGHTS, KV, BACKUP])
    assert not recoverable_without(KV, [WEIGHTS, KV])  # no backup: the fallback and the router's replay
    assert not recoverable_without(KV, [KV, BACKUP])  # the weights went too (a GPU fault)
    assert not recoverable_without(KV, [WEIGHTS, KV, lease("bk", Tag.OTHER, KV_BACKUP_LEASE, LeaseState.RECLAIMED)])
    assert not recoverable_without(WEIGHTS, [WEIGHTS, KV, BACKUP])
    assert recoverable_without(BACKUP, [WEIGHTS, KV, BACKUP])  # the cache itself is still there
    assert not recoverable_without(BACKUP, [WEIGHTS, BACKUP])
    assert not recoverable_without(lease("x", Tag.OTHER, "scratch"), [WEIGHTS, KV, BACKUP])


def test_the_reattach_row_says_the_kv_came_from_the_host_backup() -> None:
    rec = opened_record(id="i", engine_id="e", opened_at=100.0)
    rec = apply(rec, Trigger.DISPATCHED, 100.1, D)
    result = IntentResult(incident_id="i", step=Step.REATTACH, ok=True, detail="standby", successor_id="s",
                          endpoint="http://s", frozen_at=100.2, kv="KV from host backup: 8 sequences")
    (move,) = result_moves([Envelope(type=result.type, source="dc_manager", data=result)])
    rec = next_record(rec, move, 100.3, D, held=True).record
    assert rec is not None and rec.steps[Step.REATTACH].status == "done"
    assert rec.steps[Step.REATTACH].detail == "KV from host backup: 8 sequences"
    assert [row["detail"] for row in rec.timeline() if row["step"] == "reattach" and row["event"] == "done"] == \
        ["KV from host backup: 8 sequences"]


def test_a_reattach_of_the_handed_on_cache_keeps_its_row_as_it_was() -> None:
    rec = apply(opened_record(id="i", engine_id="e", opened_at=100.0), Trigger.DISPATCHED, 100.1, D)
    result = IntentResult(incident_id="i", step=Step.REATTACH, ok=True, detail="standby", successor_id="s",
                          endpoint="http://s", frozen_at=100.2)
    (move,) = result_moves([Envelope(type=result.type, source="dc_manager", data=result)])
    rec = next_record(rec, move, 100.3, D, held=True).record
    assert rec is not None and rec.steps[Step.REATTACH].detail == "" and rec.kv_source is None


def test_the_agents_reattached_event_carries_the_kv_source_too() -> None:
    rec = apply(opened_record(id="i", engine_id="e", opened_at=100.0), Trigger.DISPATCHED, 100.1, D)
    rec = apply(rec, Trigger.FROZEN, 100.2, D)
    info = EngineInfo(engine_id="s", node="n", model="m", engine_class="batched", role=EngineRole.ACTIVE,
                      endpoint="http://s", kv="KV from host backup: 2 sequences")
    move = Intake(ClusterView(), OpenIncidents()).event_move(EngineReattached(incident_id="i", predecessor_id="e",
                                                                             engine=info, used_standby=True))
    assert move is not None
    rec = next_record(rec, move, 100.3, D, held=True).record
    assert rec is not None and rec.steps[Step.REATTACH].detail == "KV from host backup: 2 sequences"
