"""A tensor-parallel group's processes, for both engines (tp_runner.py, the batched engine's tp_group.py): rank 0
starts ranks 1..N-1 (`Followers`: each dies with rank 0, rank 0 exits `GROUP_DIED` when any of them exits), where each
rank runs (`rank_place`), and the port of the group's rendezvous. Apart from tp_runner.py, which serves HTTP: the
batched engine's rank 0 serves from its front process and imports no web server."""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from engines.reference.settings import TensorParallelSettings
from libs.common.events import RankProcess
from libs.common.procs import start_time

log = logging.getLogger("holdfast.engine.tp")
SETTINGS_ENV = "HF_ENGINE_TP_SETTINGS"
GROUP_DIED = 70
IDLE_FOREVER = datetime.timedelta(days=365)  # a follower waits for rank 0's next forward however idle the engine


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


class Followers:
    """Ranks 1..N-1, started by rank 0 (main thread: PR_SET_PDEATHSIG follows the thread that forked): each runs
    `MODULE` with its settings (rank 0's, its own rank, no agent) as JSON in `SETTINGS_ENV`."""

    MODULE = "engines.reference.tp_runner"
    SETTINGS_ENV = SETTINGS_ENV

    def __init__(self, s: Any) -> None:  # EngineSettings here, the batched engine's EngineConfig in its subclass
        self.stopping = False
        self.procs = []
        self.started: list[int | None] = []  # each one's start time, read while it is our unreaped child
        for rank in range(1, s.tp):
            conf = s.model_copy(update={"tp_rank": rank, "ready_file": None, "agent": "off"})
            env = {**os.environ, self.SETTINGS_ENV: conf.model_dump_json()}
            proc = subprocess.Popen([sys.executable, "-m", self.MODULE], env=env, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent)
            self.procs.append(proc)
            self.started.append(start_time(proc.pid))
        threading.Thread(target=self._watch, name="tp-followers", daemon=True).start()

    def report(self) -> list[RankProcess]:
        """Ranks 1..N-1 as the agent watches them (AgentLink `followers`): pid and start time, so that a pid recycled
        after a follower's death is never taken for it."""
        return [RankProcess(rank=rank, pid=proc.pid, pid_start=started)
                for rank, (proc, started) in enumerate(zip(self.procs, self.started, strict=True), start=1)]

    def pids(self) -> dict[str, int]:
        """Every rank's pid by rank (rank 0: this process), for the ready file's and /health's `tp`."""
        return {"0": os.getpid(), **{str(rank): proc.pid for rank, proc in enumerate(self.procs, start=1)}}

    def _watch(self) -> None:
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self.stopping:
                    log.error("rank %d (pid %d) exited with %s: the group stops", rank, proc.pid, code)
                    os._exit(GROUP_DIED)
            time.sleep(0.05)

    def wait(self, timeout_s: float = 10.0) -> None:
        self.stopping = True
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()


def rank_place(s: TensorParallelSettings, gpu: int, rank: int, device: torch.device) -> tuple[torch.device, int, str]:
    """Where rank `rank` runs: its device, the GPU its leases are on, and the group's backend. Rank r on GPU
    `gpu + r` (or `rank_gpus[r]` when the group names its GPUs) over NCCL (CUDA) or gloo (the CPU); with
    `tp_one_gpu` every rank on GPU `gpu` over gloo (NCCL refuses two ranks of one communicator on one GPU; gloo
    moves each collective's CUDA tensors through the host)."""
    if s.rank_gpus and len(s.rank_gpus) != s.tp:
        raise ValueError(f"rank_gpus {s.rank_gpus} must name one GPU for each of the {s.tp} ranks")
    mine = s.rank_gpus[rank] if s.rank_gpus else gpu + rank
    if device.type != "cuda":
        return device, mine, "gloo"
    if s.tp_one_gpu:
        return torch.device("cuda", gpu), gpu, "gloo"
    return torch.device("cuda", mine), mine, "nccl"
