"""Starting engines: whether one more may start, and the start itself.

Admission first: an active engine only while its spec runs fewer than `replicas` (`supervision.admit_active`, the
one rule whatever path the engine comes by: invariant 11), and a start from outside (a cold start's Spawn) only
once a crash-looping spec's backoff has run out. Then the start: on the GPU placement picks (gpus.py), with the
engine's environment and `posix_spawn` (launcher.py), watched through its pidfd from the moment it exists, its
`engine.started` published and its record written. A TP spec's start is its rank 0, which starts the other ranks.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Protocol

from libs.common.errors import Conflict, Unavailable
from libs.common.events import EngineRole, EngineSpec, EngineStarted
from libs.common.ids import new_id, subject_token
from services.agent import gpus, launcher, supervision
from services.agent.backoff import Backoffs
from services.agent.engines import EngineRecord
from services.agent.gpu_health import GpuHealth
from services.agent.pidfd import proc_start_time
from services.agent.table import EngineTable

log = logging.getLogger("holdfast.agent")


class Host(EngineTable, Protocol):
    """What starting needs of the agent beyond its engine table: the crash-loop backoffs and the GPUs."""

    backoffs: Backoffs
    gpu_health: GpuHealth


class Starts:
    def __init__(self, host: Host) -> None:
        self.host = host

    def admit_active(self, key: str, *, replacing: EngineRecord | None = None, candidate: str | None = None) -> None:
        """Raise Conflict (and say so in the log) when one more active engine of `key` would exceed its spec's
        `replicas` (supervision.admit_active: the one rule, whatever path the engine comes by)."""
        why = supervision.admit_active(self.host.specs, self.host.records(), key, replacing=replacing,
                                       candidate=candidate)
        if why is not None:
            log.warning("refused an active engine: %s", why)
            raise Conflict(why)

    def admit_fresh_start(self, key: str) -> None:
        """Raise Unavailable while `key`'s engines crash-loop (its backoff, as the reconciler's starts wait it out).
        Asked of a start from outside (a cold start's Spawn): without it each cold engine that dies at once made
        its own incident, whose fallback spawned the next one at once (chains of `cs-inc-cs-inc-...` one or two
        seconds apart on the H200 while every engine exited at start)."""
        wait = self.host.backoffs.retry_in(key, time.monotonic())
        if wait > 0:
            why = f"engines of {key} keep failing: no new one for {wait:.1f} s"
            log.warning("refused a start: %s", why)
            raise Unavailable(why)

    def start(self, key: str, role: EngineRole, *, engine_id: str | None = None, generation: int = 0,
              extra_env: dict[str, str] | None = None, spec: EngineSpec | None = None,
              replacing: EngineRecord | None = None, gang: str | None = None, same_gpu: bool = True,
              spare: bool = False) -> EngineRecord:
        """Start one engine (a TP spec: its rank 0, which starts the others; `gang`: a successor group keeps its
        predecessor's gang id, a first group's is its own engine id). `replacing`: the engine whose slot it fills,
        on that engine's GPU (its memory cannot move) unless `same_gpu` is false (a degraded successor, or one
        from a KV backup: its predecessor's memory is host backups, and it runs on the GPUs its spec names).
        `spare`: a standby on a GPU of the spec where none of its actives runs (gpus.py invariant 5)."""
        host = self.host
        spec = spec or host.specs[key]
        engine_id = engine_id or new_id(subject_token(spec.model))
        if engine_id in host.engines and host.engines[engine_id].live:
            raise Conflict(f"engine {engine_id} already runs")
        if role is EngineRole.ACTIVE:
            self.admit_active(key, replacing=replacing)
        health = host.gpu_health
        where = gpus.pick_gpu(spec, key, role, health.gpus, host.records(), health.unhealthy,
                              replacing=replacing if same_gpu else None, spare=spare)
        gpu = where.index
        extra_env = {**(extra_env or {}), "HF_GPU_UUID": where.uuid} if where.uuid else extra_env
        if spare:  # engines/batched/config.py `spare`
            extra_env = {**(extra_env or {}), "HF_ENGINE_SPARE": "1"}
        rank_gpus = gpus.rank_gpus_of(spec, health.gpus)
        if rank_gpus:  # engines/reference/ranks.py `rank_place`
            extra_env = {**(extra_env or {}), "HF_ENGINE_RANK_GPUS": json.dumps(rank_gpus)}
        env = launcher.engine_env(host.settings, spec, engine_id=engine_id, role=role, gpu=gpu, extra=extra_env)
        log_path = host.settings.state_dir / "engines" / f"{engine_id}.log"
        pid = launcher.spawn(spec.command, env, log_path)
        rec = EngineRecord(engine_id=engine_id, model=spec.model, engine_class=spec.engine_class, role=role,
                           gpu=gpu, version=spec.version, spec_key=key, pid=pid, pid_start=proc_start_time(pid),
                           child=True, generation=generation, tp=spec.tp, rank_gpus=rank_gpus,
                           gang=(gang or engine_id) if spec.tp > 1 else None, spare=spare)
        host.engines[engine_id] = rec
        host.watcher.watch(engine_id, pid, child=True)  # our unreaped child: its pid cannot be recycled yet
        log.info("started %s engine %s (pid %d) for %s on GPU %d", "spare" if spare else role.value, engine_id, pid,
                 spec.model, gpu)
        host.publish(EngineStarted(engine=host.info(rec)))
        host.save(rec)
        return rec
