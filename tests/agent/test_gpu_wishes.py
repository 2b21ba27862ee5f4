"""The agent's pending GPU health wishes on disk (services/agent/gpu_wishes.py): written whole and 0600, keyed by UUID,
gone once none is pending, and a file that cannot be read kept aside rather than stopping the agent."""

from __future__ import annotations

import stat
from pathlib import Path

from libs.common.gpu import simulated_gpus
from services.agent.gpu_wishes import WISHES_FILE, GpuWishes

GPUS = simulated_gpus(["0", "1"], "node-1")


def wishes_in(state: Path) -> GpuWishes:
    return GpuWishes(state / WISHES_FILE, lambda i: GPUS[i].uuid)


def test_a_wish_is_kept_by_uuid_in_a_private_file_until_dropped(tmp_path: Path) -> None:
    wishes = wishes_in(tmp_path)
    wishes.put(1, False, "XID 79")
    wishes.put(0, True, "")
    path = tmp_path / WISHES_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert wishes_in(tmp_path).load() == {GPUS[1].uuid: (False, "XID 79"), GPUS[0].uuid: (True, "")}
    wishes.put(1, True, "repaired")  # the latest wish replaces the older one
    wishes.drop(0)
    assert wishes_in(tmp_path).load() == {GPUS[1].uuid: (True, "repaired")}
    wishes.drop(1)
    assert not path.exists() and [p.name for p in tmp_path.iterdir()] == []  # no temporary file left either


def test_an_unreadable_file_is_kept_aside_and_read_as_no_wish(tmp_path: Path) -> None:
    (tmp_path / WISHES_FILE).write_text('{"GPU-x": {"healthy": fal')  # what no atomic write leaves; a hand edit may
    wishes = wishes_in(tmp_path)
    assert wishes.load() == {}
    assert (tmp_path / f"{WISHES_FILE}.broken").exists() and not (tmp_path / WISHES_FILE).exists()
    wishes.put(1, False, "XID 48")
    assert wishes_in(tmp_path).load() == {GPUS[1].uuid: (False, "XID 48")}
