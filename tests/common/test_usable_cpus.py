"""CPUs a process may use (libs/common/procs.py `usable_cpus`): its affinity, lowered by its cgroup's CPU quota
(v1 and v2 files laid out under a root of the test's own; the real files where the machine has them)."""

from __future__ import annotations

import os
from pathlib import Path

from libs.common.procs import usable_cpus


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_affinity_bounds_it_and_a_cgroup_quota_lowers_it_rounded_up(tmp_path: Path) -> None:
    mine = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == mine  # no cgroup files: the affinity alone
    v2 = tmp_path / "v2"
    _write(v2, "proc/self/cgroup", "0::/pod/router\n")
    _write(v2, "sys/fs/cgroup/pod/router/cpu.max", "max 100000\n")
    assert usable_cpus(v2) == mine
    _write(v2, "sys/fs/cgroup/pod/router/cpu.max", "50000 100000\n")  # half a CPU: still one
    assert usable_cpus(v2) == 1
    v1 = tmp_path / "v1"
    _write(v1, "proc/self/cgroup", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n")
    _write(v1, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    _write(v1, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert usable_cpus(v1) == mine
    _write(v1, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")  # 1.5 CPUs
    assert usable_cpus(v1) == min(mine, 2)
    inside = tmp_path / "ns"  # a cgroup namespace: the path "/" and the files at the top
    _write(inside, "proc/self/cgroup", "1:cpu:/\n")
    _write(inside, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "100000\n")
    _write(inside, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    assert usable_cpus(inside) == 1


def test_this_machine_reads_at_least_one_and_at_most_its_affinity() -> None:
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
