"""A tensor-parallel batched engine's processes (`--tp N`): rank 0 is the engine (__main__.py's start-up, scheduler,
journal, HTTP, the agent's link); it starts ranks 1..N-1 (`python -m engines.batched.tp_group`), which load their
shards and follow rank 0's plans (tp.py).

- Engine ids: rank 0 is the engine's id, rank r > 0 `<id>-r<r>` (libs/common/events.py `rank_engine_id`): each
  rank is a gpu_manager client of its own, on GPU `gpu + r`, with its own weights lease (its shard, read from the
  file by safetensors slices) and its own KV lease (its kv heads; the journal tensors in it are rank 0's only to
  write).
- Start-up: cold, each rank reads its shard; a successor group (`HF_TAKEOVER_GANG` + `HF_TRANSFER_TOKEN` +
  `HF_GANG_GENERATION`) takes each rank's leases of the frozen gang over (`gang_takeover`: all ranks' or none) and
  reads nothing; rank 0 then adopts its journal as one engine does, and every rank's KV holds those positions
  (tp.py invariants 1-2). Every rank then meets at a barrier and checks that the ranks' caches agree (blocks,
  block size, handed on or new); cold, rank 0 registers the gang.
- KV backup (`--kv-backup`, backup.py): every rank opens its own backup (a host lease named for its rank; restored
  from when the group's caches were lost) before that barrier, so each backup lease is in the gang's commit;
  rank 0's writer and the others' talk over `BackupChannel`, a gloo group of their own. A successor group that
  leased new caches (restored from the backups: the lost caches are not in the gang it took over, gpu_manager
  gang.py invariant 9) registers the gang anew, its generation kept.
- One unit: ranks 1..N-1 die with rank 0 (PR_SET_PDEATHSIG); rank 0 exits 70 within ~50 ms when any of them exits
  (`Followers`); a rank whose peer died fails its next collective. So a SIGKILL of any rank ends the group. Rank 0
  names its followers' processes to the agent as it registers (`Followers.report`, the link's `followers`), and the
  agent watches each through a pidfd of its own: a follower's death is the group's one fault at once, rank 0's
  exit after it adding none; one incident for the group (docs/multi_gpu.md). `tp.pids`: every rank's pid.
- A standby group (`--role standby`): every rank starts, joins the communicator, warms its kernels and one
  all-reduce (`stand_by`), and holds no lease; rank 0 registers with the agent as the standby. Assigned a gang (the
  agent's `assign` names it, its generation and the token), rank 0 tells every rank (`assigned`: one broadcast, which
  the others wait in), and from there each rank runs a cold successor group's code (`load`, `commit`): one path.
  No runner is prepared over reservations (memory.py `reserve` lays out a whole model, not a shard; and CUDA graphs,
  what a prepared runner saves most, are off with tp > 1).
- A spare group (`--role standby --spare`, EngineSpec.spares: on GPUs where no engine of its spec runs): every rank
  also loads its shard and leases its cache while it stands by (`stand_by`, the cold path's `load_shard`), and is
  assigned a broken gang's KV backups (`assign` with `degraded`: a GPU fault's fallback) rather than a gang's leases:
  its ranks take the backups over as a degraded group's do (`HF_DEGRADE_GANG`'s path, every rank asking, rank 0
  getting them) and restore every sequence into the caches they hold (degrade.py, heads re-sharded when the old group
  had another size); nothing is loaded in the outage. A backup of another block count than the caches: every rank
  gives back what it holds and loads cold, as a degraded group does.
- A regroup (`HF_TAKEOVER_FROM` + `HF_TRANSFER_TOKEN` on a group: degrade.py): a single engine continued by a group
  from its KV backup alone, as a degraded group continues a broken gang's backups (`load`: rank 0 takes the backup,
  every rank loads its shard cold into a cache of the backup's block count), its gang registered under its own id.
  A group itself is taken over through its gang (`HF_TAKEOVER_GANG`), never by `HF_TAKEOVER_FROM`.
Not yet: sleep and wake (the asks are refused), CUDA graphs.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from engines.batched import degrade
from engines.batched.backup_start import open_backup
from engines.batched.config import EngineConfig
from engines.batched.journal import Journal
from engines.batched.memory import Loaded, layout_fn, open_memory
from engines.batched.tp import PlanChannel, ShardedRunner, follow
from engines.batched.warmup import warm_kernels
from engines.reference import ranks as reference_ranks
from engines.reference.config import get_config
from engines.reference.ranks import IDLE_FOREVER, free_port, rank_place
from engines.reference.startup import pick_device
from engines.reference.tp import read_shard, shard_config
from engines.reference.weights import check_file_matches
from libs.common.events import rank_engine_id

log = logging.getLogger("holdfast.engine.batched.tp")
SETTINGS_ENV = "HF_ENGINE_BATCHED_TP_SETTINGS"


class Followers(reference_ranks.Followers):
    """Ranks 1..N-1, started by rank 0 on its main thread and watched as the reference engine's are (one's exit
    ends rank 0, GROUP_DIED, within ~50 ms, unless rank 0 is stopping them: `wait`); they run this engine."""

    MODULE = "engines.batched.tp_group"
    SETTINGS_ENV = SETTINGS_ENV


class BackupChannel:
    """The ranks' KV backups (backup.py: `SoloChannel`'s calls, for a group) over a gloo group of their own: rank 0's
    writer thread never issues a collective on the communicator its step thread's forwards use."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.group = dist.new_group(backend="gloo")  # collective: every rank makes it at the same point (RankGroup)

    def gather(self, mine: Any) -> list[Any]:
        every: list[Any] = [None] * self.size
        dist.all_gather_object(every, mine, group=self.group)
        return every

    def share(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, 0, group=self.group)
        return box[0]

    def done(self) -> None:
        dist.barrier(group=self.group)


class RankComm:
    """Rank 0 -> the others over the group's communicator, before its first forward (degrade.py's restore):
    objects broadcast, tensors sent to one rank (on `device`: the GPU with NCCL, else the host)."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device

    def share(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, 0)
        return box[0]

    def send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t.to(self.device), dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src)
        return buf


class RankGroup:
    """This process's rank of the group: its shard config, device and engine id, the communicator, and (rank 0)
    the followers it started."""

    def __init__(self, cfg: EngineConfig, device: torch.device) -> None:
        if cfg.takeover_from and (not cfg.transfer_token or cfg.memory == "local" or cfg.takeover_gang
                                  or cfg.degrade_gang or cfg.role == "standby"):
            raise ValueError("HF_TAKEOVER_FROM on a group names a single engine whose KV backup it continues (a "
                             "regroup: degrade.py): with HF_TRANSFER_TOKEN and leased memory, an active group, no gang "
                             "(a group is taken over through its gang: HF_TAKEOVER_GANG)")
        if device.type == "cuda" and cfg.num_blocks is None and cfg.kv_cache_gib is None and not (
                cfg.degrade_gang or cfg.takeover_from):  # a group from backups: their block count (degrade.py inv. 2)
            raise ValueError("--tp > 1 on CUDA needs --num-blocks or --kv-cache-gib: every rank's cache must have "
                             "as many blocks, and each GPU's free memory differs")
        self.rank = cfg.tp_rank
        self.cfg = cfg if self.rank or cfg.tp_port else cfg.model_copy(update={"tp_port": free_port()})
        self.mcfg = shard_config(get_config(cfg.size), cfg.tp, cfg.tp_rank)
        device, gpu, backend = rank_place(cfg, cfg.gpu, self.rank, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.device = device
        self.owners = [rank_engine_id(cfg.id, r) for r in range(cfg.tp)]
        # this rank as a gpu_manager client: its own id, its own GPU
        self.me = self.cfg.model_copy(update={"id": self.owners[self.rank], "gpu": gpu})
        self.followers = Followers(self.cfg) if self.rank == 0 else None
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{self.cfg.tp_port}", rank=self.rank,
                                world_size=cfg.tp, timeout=IDLE_FOREVER)  # a follower waits however idle rank 0 is
        self.channel = PlanChannel(device)
        self.backup = BackupChannel(self.rank, cfg.tp) if cfg.kv_backup else None
        self.standing_by = False  # rank 0 of a standby group, not assigned yet: the followers wait for its word
        self.spare: Loaded | None = None  # a spare group's rank: its shard and cache, held while it stands by

    def stand_by(self, warm_kernels: Any, memory: Any, layout_of: Any) -> bool:
        """A standby group's rank: its kernels (`warm_kernels(mcfg, cfg, device)`, the single standby's warm-up) and
        the communicator warmed, and a spare's shard loaded and cache leased (`cfg.spare`); an ordinary standby group
        holds no lease. Rank 0 returns at once (the agent's assignment comes to it: `assigned`); any other rank waits
        for rank 0's word: True, the group's config then names the gang to take over; False, the group is stopping
        unassigned."""
        warm_kernels(self.mcfg, self.cfg, self.device)
        dtype = torch.float32 if self.mcfg.dtype == "float32" else torch.bfloat16
        dist.all_reduce(torch.zeros(1, self.mcfg.dim, dtype=dtype, device=self.device))
        if self.cfg.spare:
            self.spare = self._cold(memory, layout_of)
        if self.rank == 0:
            self.standing_by = True
            return True
        box: list[Any] = [None]
        dist.broadcast_object_list(box, 0)  # waits however long the group stands by (IDLE_FOREVER)
        if box[0] is None:
            return False
        self._take_orders(box[0])
        return True

    def assigned(self, gang: str | None, generation: int | None, token: str, degraded: bool = False) -> None:
        """Rank 0 of a standby group, assigned by the agent: every rank is told the gang, and each then takes its own
        rank's leases over as a cold successor group's does (`load`); `degraded` (a spare group, a GPU fault's
        fallback): the broken gang's KV backups, as a degraded group takes them."""
        if gang is None or generation is None:
            raise RuntimeError("a standby group's assignment must name a gang and its generation (the agent's takeover "
                               "of a TP group); got a single engine's")
        if degraded != (self.spare is not None):
            raise RuntimeError("a spare group is assigned a broken gang's backups (degraded), an ordinary standby "
                               f"group a gang's leases; this one {'is' if self.spare else 'is not'} a spare")
        orders = {"degrade_gang" if degraded else "takeover_gang": gang, "gang_generation": generation,
                  "transfer_token": token}
        dist.broadcast_object_list([orders], 0)
        self.standing_by = False
        self._take_orders(orders)

    def _take_orders(self, orders: dict[str, Any]) -> None:
        self.cfg = self.cfg.model_copy(update=orders)

    def comm(self) -> RankComm:
        return RankComm(self.rank, self.cfg.tp, self.device if dist.get_backend() == "nccl" else torch.device("cpu"))

    def load(self, memory: Any, layout_of: Any) -> Loaded:
        cfg = self.cfg
        if cfg.degrade_gang or cfg.takeover_from:  # from backups alone (degrade.py): rank 0 gets every one of them
            d = self._backups(memory)
            blocks = self.comm().share(d.num_blocks if d is not None else None)  # degrade.py invariant 2
            if self.spare is not None and self.spare.layout.num_blocks == blocks:
                if self.spare.weights_load is not None:  # loaded before the fault (the timeline says so)
                    self.spare.weights_load = {**self.spare.weights_load, "spare": True}
                return degrade.adopt(self.spare, d)  # a spare group: into the caches it holds
            if self.spare is not None:
                log.info("rank %d: the backups hold %s blocks, this spare's cache %d: loading cold", self.rank, blocks,
                         self.spare.layout.num_blocks)
                memory.release([lease_id for lease_id in memory.client.leases if lease_id not in
                                (d.lease_ids if d is not None else [])])
            return degrade.adopt(self._cold(memory, layout_of, blocks), d)
        if cfg.takeover_gang:
            if memory.kind != "leased" or not cfg.transfer_token or cfg.gang_generation is None:
                raise RuntimeError("HF_TAKEOVER_GANG needs leased memory, HF_TRANSFER_TOKEN and HF_GANG_GENERATION")
            return memory.gang_takeover(self.mcfg, cfg.takeover_gang, self.rank, self.owners, cfg.gang_generation,
                                        cfg.transfer_token, layout_of, cfg.adopt_wait_s)
        return self._cold(memory, layout_of)

    def _backups(self, memory: Any) -> degrade.Degraded | None:
        """The KV backups this group continues from (rank 0's; None on the others): a broken gang's every rank's
        (a degraded group: every rank asks, `HF_DEGRADE_GANG`), or a single engine's alone (a regroup,
        `HF_TAKEOVER_FROM`: rank 0 alone asks)."""
        cfg = self.cfg
        if memory.kind != "leased" or not cfg.transfer_token:
            raise RuntimeError("a group continued from KV backups (HF_DEGRADE_GANG, HF_TAKEOVER_FROM) needs leased "
                               "memory and HF_TRANSFER_TOKEN")
        if cfg.takeover_from:
            return memory.take_backup(cfg.takeover_from, cfg.transfer_token, cfg.adopt_wait_s) if self.rank == 0 else None
        if cfg.gang_generation is None:
            raise RuntimeError("HF_DEGRADE_GANG needs HF_GANG_GENERATION")
        return memory.take_backups(cfg.degrade_gang, self.rank, self.owners, cfg.gang_generation,
                                   cfg.transfer_token, cfg.adopt_wait_s)

    def _cold(self, memory: Any, layout_of: Any, num_blocks: int | None = None) -> Loaded:
        cfg = self.cfg
        whole = get_config(cfg.size)

        def read() -> dict[str, torch.Tensor]:  # only when no node copy of this rank's shard serves
            check_file_matches(cfg.weights, whole)
            return read_shard(cfg.weights, whole, cfg.tp, self.rank)
        return memory.load_shard(self.mcfg, read, layout_of, path=cfg.weights, tp=cfg.tp, rank=self.rank,
                                 num_blocks=num_blocks)

    def commit(self, memory: Any, loaded: Loaded) -> dict[str, Any]:
        """Every rank loaded (or took over) and committed: their caches must agree (a block id means the same
        positions on every rank; a handed-on cache is continued on every rank or on none); rank 0 of a cold group
        registers the gang. Rank 0's `tp` info."""
        # gloo gathers host tensors only (the ranks on one GPU: `tp_one_gpu`)
        at = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.tensor([loaded.layout.num_blocks, loaded.layout.block_size, int(loaded.kv_handed_on)],
                            dtype=torch.int64, device=at)
        every = [torch.empty_like(mine) for _ in range(self.cfg.tp)]
        dist.all_gather(every, mine)  # also the barrier: every rank committed its leases before it got here
        seen = [tuple(t.tolist()) for t in every]
        if len(set(seen)) != 1:
            raise RuntimeError(f"the ranks' KV caches disagree (blocks, block size, handed on): {seen}")
        reports: list[Any] = [None] * self.cfg.tp
        # each rank's cold load (which copy served it), and whether it holds a lease the gang it took over lacks
        dist.all_gather_object(reports, (loaded.weights_load, memory.kind == "leased" and outside_gang(memory.client)))
        loaded.weights_load = group_weights_load([r[0] for r in reports])  # rank 0's goes to the agent
        gang = None
        if memory.kind == "leased" and self.cfg.takeover_gang and not any(r[1] for r in reports):
            gang = memory.client.last_gang.model_dump()  # the manager moved the gang on with the takeover
        elif memory.kind == "leased" and self.rank == 0:  # cold, new caches (restored from the ranks' backups), or
            # a degraded group's (its ranks took the broken gang's id over: degrade.py; a regrouped one: its own id)
            gang = memory.register_gang(self.cfg.degrade_gang or self.cfg.takeover_gang or self.cfg.gang or self.cfg.id,
                                        self.owners)
        return {"ranks": self.cfg.tp, "engine_ids": self.owners, "backend": dist.get_backend(), "gang": gang,
                "head": "replicated", "pids": self.followers.pids() if self.followers is not None else {}}

    def runner(self, loaded: Loaded) -> ShardedRunner:
        return ShardedRunner(self.mcfg, loaded.weights, loaded.kv, loaded.layout.block_size,
                             deterministic=self.cfg.deterministic, cuda_graphs=False,
                             max_num_seqs=self.cfg.max_num_seqs, fused=loaded.fused,
                             deterministic_tile=self.cfg.deterministic_tile,
                             channel=self.channel if self.rank == 0 else None)

    def stop(self, runner: Any, step_thread_done: bool) -> None:
        """Rank 0, on its way out: the followers told to end after the last plan, and waited for. No stop is sent
        while a step may still be issuing collectives (the followers then die with this process)."""
        assert self.followers is not None
        self.followers.stopping = True
        if self.standing_by:  # a standby group stopping unassigned: its followers end cleanly
            try:
                dist.broadcast_object_list([None], 0)
            except Exception as e:  # noqa: BLE001 - a broken communicator: the followers die with this process
                log.warning("could not tell the standing-by followers to stop: %r", e)
                return
            self.followers.wait()
            return
        if isinstance(runner, ShardedRunner) and step_thread_done:
            try:
                runner.stop_followers()
            except Exception as e:  # noqa: BLE001 - a broken communicator: the followers die with this process
                log.warning("could not tell the followers to stop: %r", e)
                return
            self.followers.wait()


def outside_gang(client: Any) -> bool:
    """A successor rank holds a lease the gang it took over did not commit (a cache leased anew); False when it took
    no gang over (cold: the gang is registered anyway)."""
    gang = client.last_gang
    return gang is not None and any(lease_id not in gang.epochs for lease_id in client.leases)


SLOWER = {"peer": 0, "host": 1, "artifact": 2, "file": 3}  # a group is ready once its slowest rank's source served


def group_weights_load(reports: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The ranks' cold loads (`WeightsLoad.report()`, rank order) as one report: the slowest source among them and
    the longest load (the ranks load at once), `ranks` each rank's source, `per_rank` their reports, and each
    refused copy's reason prefixed by its rank. None when a rank loaded nothing cold (a takeover). Pure."""
    if not reports or any(r is None for r in reports):
        return None
    got = [r for r in reports if r is not None]
    sources = [str(r["source"]) for r in got]
    refused = "; ".join(f"rank {i}: {r['refused']}" for i, r in enumerate(got) if r.get("refused"))
    out: dict[str, Any] = {"source": max(sources, key=lambda s: SLOWER.get(s, len(SLOWER))),
                           "load_ms": max(float(r["load_ms"]) for r in got), "ranks": sources, "per_rank": got}
    if refused:
        out["refused"] = refused
    if all(r.get("spare") for r in got):
        out["spare"] = True  # a spare group's: loaded before the fault it stood by for
    return out


def follower_main() -> int:
    """Rank r > 0: load (or take over) its shard, meet the group, follow rank 0's plans until it says stop. A signal
    to the process group is rank 0's to handle; rank 0's death ends this process (PR_SET_PDEATHSIG)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # as rank 0's (engines/batched/__main__.py)
    cfg = EngineConfig(**json.loads(os.environ[SETTINGS_ENV]))
    logging.basicConfig(level=cfg.log_level, format=f"%(asctime)s %(levelname)s %(name)s[r{cfg.tp_rank}]: %(message)s")
    torch.set_num_threads(cfg.threads)
    group = RankGroup(cfg, pick_device(cfg.device))
    memory = open_memory(group.me, group.device)
    try:
        layout_of = layout_fn(cfg, group.mcfg, group.device)
        if cfg.role == "standby":
            if not group.stand_by(warm_kernels, memory, layout_of):
                log.info("rank %d of a standby group stopped unassigned", cfg.tp_rank)
                return 0
        loaded = group.load(memory, layout_of)
        if loaded.source == "degraded":  # rank 0 sends this rank its heads of the old ranks' backups
            degrade.restore_loaded(loaded, get_config(cfg.size), memory, group.comm())
        backup = open_backup(group.cfg, memory, loaded, group.backup)  # before the gang: its lease is the gang's
        group.commit(memory, loaded)
        if not loaded.kv_handed_on:
            Journal(loaded.layout, loaded.journal).format()  # an empty journal: rank 0's is the group's
        memory.start_heartbeats()
        if backup is not None:
            backup[0].start()  # copies the blocks rank 0's writer shares, round by round
        ran = follow(group.runner(loaded), group.channel)
        log.info("rank %d stopped after %d forwards", cfg.tp_rank, ran)
        if backup is not None:
            backup[0].join()  # rank 0 ended it before the forwards
        return 0
    finally:
        memory.close()


if __name__ == "__main__":
    sys.exit(follower_main())
