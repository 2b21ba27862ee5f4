"""`holdfast bench recovery`'s stacks leave nothing behind after a good run (each one's etcd data is ~60 MB: the
runs of a session filled a machine's disk once) and keep their files, said, after a failed one. The stack itself
is stood in for (its start, stop and trials): what is tested is the way's clean-up."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from rich.progress import Progress

from bench import recovery
from devstack.scenario import Scenario


@pytest.mark.parametrize("fails", [False, True])
def test_a_ways_work_dir_goes_after_a_good_run_and_stays_after_a_failed_one(monkeypatch: pytest.MonkeyPatch,
                                                                           fails: bool) -> None:
    made: list[Path] = []

    def start(self: Scenario) -> None:
        made.append(self.work_dir)
        (self.work_dir / "etcd-data").write_bytes(b"x" * 1024)

    async def trials(sc: Scenario, n: int, *_: object) -> list[object]:
        if fails:
            raise RuntimeError("a trial failed")
        return []

    monkeypatch.setattr(Scenario, "start", start)
    monkeypatch.setattr(Scenario, "stop", lambda self: None)
    monkeypatch.setattr(recovery, "_trials", trials)
    with Progress(disable=True) as progress:
        if fails:
            with pytest.raises(RuntimeError, match="a trial failed"):
                recovery._pipeline_way("host", "tiny", 1, 1, progress, "way")
        else:
            assert recovery._pipeline_way("host", "tiny", 1, 1, progress, "way") == []
    (work,) = made
    assert work.exists() is fails
    if fails:
        shutil.rmtree(work)
