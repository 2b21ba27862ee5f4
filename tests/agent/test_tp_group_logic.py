"""The agent's pure side of a tensor-parallel group: its record names its ranks and gang, its spec runs standby groups
only where its engine class builds them, a group is taken over only by a standby group of its shape, rank 0's
environment carries HF_ENGINE_TP, and a successor group's carries the gang takeover (never inherited)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libs.common.errors import Conflict
from libs.common.events import EngineRole, EngineSpec, Takeover
from services.agent import launcher, supervision
from services.agent.engines import EngineRecord, State
from services.agent.settings import AgentSettings
from services.agent.takeover import Takeovers


def spec(tp: int) -> EngineSpec:
    return EngineSpec(model="m", command=["serve"], tp=tp, standbys=1, gpus=[0])


def test_a_groups_record_names_its_ranks_gpus_and_gang() -> None:
    rec = EngineRecord(engine_id="e1", model="m", engine_class="reference", role=EngineRole.ACTIVE, gpu=2, tp=2,
                       gang="e0")
    info = rec.info("n")
    assert (info.tp, info.ranks, info.gang) == (2, ["e1", "e1-r1"], "e0")
    assert list(rec.gpus) == [2, 3]
    assert EngineRecord.from_info(info).gang == "e0" and EngineRecord.from_info(info).tp == 2
    single = EngineRecord(engine_id="s", model="m", engine_class="reference", role=EngineRole.ACTIVE).info("n")
    assert (single.tp, single.ranks, single.gang) == (1, [], None)


def test_a_tp_spec_runs_no_standby_and_rank_zero_gets_its_tp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert supervision.standbys_of(spec(2)) == 0 and supervision.standbys_of(spec(1)) == 1
    monkeypatch.setenv("HF_TAKEOVER_GANG", "stale")  # the agent's own environment never reaches an engine
    monkeypatch.setenv("HF_GANG_GENERATION", "9")
    settings = AgentSettings(state_dir=tmp_path)
    env = launcher.engine_env(settings, spec(2), engine_id="e", role=EngineRole.ACTIVE, gpu=0)
    assert env["HF_ENGINE_TP"] == "2" and "HF_TAKEOVER_GANG" not in env and "HF_GANG_GENERATION" not in env
    assert "HF_ENGINE_TP" not in launcher.engine_env(settings, spec(1), engine_id="e", role=EngineRole.ACTIVE, gpu=0)
    assert os.environ["HF_TAKEOVER_GANG"] == "stale"


def test_a_batched_tp_spec_runs_standby_groups() -> None:
    batched = spec(2).model_copy(update={"engine_class": "batched"})
    assert supervision.standbys_of(batched) == 1


def test_a_group_is_taken_over_only_by_a_standby_group_on_its_gpus() -> None:
    def standby(engine_id: str, tp: int, gpu: int, age: float) -> EngineRecord:
        return EngineRecord(engine_id=engine_id, model="m", engine_class="batched", role=EngineRole.STANDBY,
                            state=State.STANDBY, gpu=gpu, tp=tp, spawned_mono=age)

    single, group, elsewhere = standby("s", 1, 0, 1.0), standby("g", 2, 0, 2.0), standby("x", 2, 2, 0.5)
    records = [single, group, elsewhere]
    assert supervision.pick_standby(records, "m") is single  # a single engine's successor: never a group
    assert supervision.pick_standby(records, "m", tp=2, gpu=0) is group  # not the older group on GPUs 2-3
    assert supervision.pick_standby(records, "m", tp=2, gpu=0, named="s") is None
    assert supervision.pick_standby([single], "m", tp=2, gpu=0) is None  # the cold fresh group then


def test_a_standby_and_a_cold_successor_group_get_the_same_orders() -> None:
    cmd = Takeover(incident_id="i", engine_id="e", transfer_token="t" * 24, gang="g", gang_generation=3)
    orders = Takeovers._orders(cmd, "e")
    assert orders == {"transfer_token": "t" * 24, "incident_id": "i", "gang": "g", "gang_generation": "3"}
    assert set(Takeovers._takeover_env(cmd, "e").values()) == set(orders.values())


def test_a_successor_group_takes_the_gang_over_with_its_generation() -> None:
    cmd = Takeover(incident_id="i", engine_id="e", transfer_token="t" * 24, gang="g", gang_generation=3)
    env = Takeovers._takeover_env(cmd, "e")
    assert env == {"HF_TRANSFER_TOKEN": "t" * 24, "HF_INCIDENT_ID": "i", "HF_TAKEOVER_GANG": "g",
                   "HF_GANG_GENERATION": "3"}
    assert "HF_TAKEOVER_FROM" in Takeovers._takeover_env(cmd.model_copy(update={"gang": None}), "e")
    with pytest.raises(Conflict):
        Takeovers._takeover_env(cmd.model_copy(update={"gang_generation": None}), "e")
