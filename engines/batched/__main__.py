"""`python -m engines.batched --weights w.safetensors [--size tiny] [--max-num-seqs 256] ...` (config.py).

Start-up is one straight line: config -> memory (weights, KV cache, journal) -> model runner -> scheduler ->
engine (adopting the journal's sequences when the KV lease was handed on) -> HTTP server -> ready.
A standby stops after the HTTP server: it warms its kernels on a scratch model, holds no memory of a lease, and
on its assignment takes the predecessor's weights, KV cache and journal over and continues from there. Where it can
tell the predecessor's lease sizes (leased memory, and a KV cache sized by --num-blocks / --kv-cache-gib, or on the
CPU), it first reserves their addresses (memory.py `reserve`: placeholder memory), builds its runner over them and
captures every decode graph: after the takeover maps the leases at those addresses that runner serves at once. A
lease that lands elsewhere (other sizes, another placement) falls back to a runner built after the takeover, its
graphs captured then.
A standby group (`--tp N`, tp_group.py) warms every rank and the communicator, prepares no runner, and once assigned
starts as a cold successor group does (`load_memory`).
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from engines.batched import degrade, isolation
from engines.batched.backup import SOLO, BackupWriter, backed_journal
from engines.batched.backup_start import describe_restore, open_backup
from engines.batched.config import EngineConfig, parse_config
from engines.batched.drain import NO_MARK, DrainMark, PageLayout, Pending, open_drain
from engines.batched.engine import LLMEngine
from engines.batched.front_link import EngineSide, FrontLink
from engines.batched.journal import Journal, JournalLayout, counted
from engines.batched.memory import (
    LeasedMemory,
    Loaded,
    Spare,
    journal_generation,
    layout_fn,
    open_memory,
    placed_alike,
    wait_fence,
)
from engines.batched.model_runner import ModelRunner
from engines.batched.rehearsal import prompts, rehearse, scratch
from engines.batched.scheduler import Scheduler, SchedulerConfig
from engines.batched.sleep import install as install_sleep
from engines.batched.standby import await_assignment
from engines.batched.tp_group import RankGroup
from engines.batched.warmup import warm_kernels
from engines.ready_file import write_ready_file
from engines.reference import stall_watch
from engines.reference.config import ModelConfig, get_config
from engines.reference.startup import pick_device
from libs.common import procs
from libs.common.gc_tuning import long_lived_gc
from libs.common.procs import ms_between, ms_since

log = logging.getLogger("holdfast.engine.batched")
HEARTBEAT_S = 0.2
REHEARSAL_SEQS = 64  # a prepared standby's rehearsal (rehearsal.py): its requests, as many rows as a loaded step's



def open_agent_link(cfg: EngineConfig, *, can_shadow: bool, group: RankGroup | None = None) -> Any:
    """`group`: rank 0 of a tensor-parallel group names its followers' processes, which the agent then watches."""
    if cfg.agent == "off" or (cfg.agent == "auto" and not os.environ.get("HF_AGENT_SOCKET")):
        return None
    from libs.client.agent_link import AgentLink

    followers = group.followers.report() if group is not None and group.followers is not None else []
    link = AgentLink.connect(cfg.id, role=cfg.role, model=cfg.model, can_shadow=can_shadow,
                             fences=cfg.role == "standby" and cfg.fenced_takeover and cfg.tp == 1,
                             followers=followers)
    if cfg.role == "active":
        link.start_heartbeats(HEARTBEAT_S)
    return link


def new_runner(cfg: EngineConfig, mcfg: ModelConfig, loaded: Loaded) -> ModelRunner:
    return ModelRunner(mcfg, loaded.weights, loaded.kv, loaded.layout.block_size, deterministic=cfg.deterministic,
                       cuda_graphs=cfg.cuda_graphs, max_num_seqs=cfg.max_num_seqs, fused=loaded.fused,
                       max_step_tokens=cfg.max_num_batched_tokens, deterministic_tile=cfg.deterministic_tile)


def build_engine(cfg: EngineConfig, mcfg: ModelConfig, loaded: Loaded, layout: JournalLayout, *,
                 capture_now: bool, runner: ModelRunner | None = None, backup: BackupWriter | None = None,
                 mark: DrainMark | None = None, pend: Pending | None = None) -> tuple[LLMEngine, dict[str, Any]]:
    """Runner (`runner`: one built before over the same addresses, its graphs captured), scheduler and journal over
    the loaded tensors; the journal's sequences adopted when the KV lease came from before (and was written for
    this layout): clear of what a predecessor's queue may still write, `pend` (isolation.py). Every journal write is
    stamped in `mark` (drain.py), the engine's from then on."""
    runner = runner or new_runner(cfg, mcfg, loaded)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                                          prefill_chunk=cfg.prefill_chunk, max_model_len=layout.max_len,
                                          max_waiting=cfg.max_waiting, deterministic=cfg.deterministic,
                                          block_size=layout.block_size, num_blocks=layout.num_blocks,
                                          prefix_caching=cfg.prefix_caching))
    journal = Journal(layout, loaded.journal) if backup is None else backed_journal(backup, layout, loaded.journal)
    journal.mark = mark or NO_MARK
    if capture_now and runner.use_graphs:
        t0 = time.perf_counter()
        runner.warmup()  # a cold start captures its decode graphs before serving
        graphs_ms: float | None = ms_since(t0)
    else:
        graphs_ms = None
    engine = LLMEngine(runner, scheduler, journal, adopt_claim_s=cfg.adopt_claim_s,
                       capture_graphs_when_idle=not capture_now and runner.use_graphs, async_schedule=cfg.async_schedule,
                       forget_on_failure=cfg.tp == 1)
    engine.drain = mark
    info: dict[str, Any] = {"adopted": 0, "journal": "new", "graphs_ms": graphs_ms}
    if loaded.kv_handed_on and journal.matches():
        t0 = time.perf_counter()
        entries, dropped = journal.recover(pend.slots if pend is not None else frozenset())
        timings = {"recover": ms_since(t0), "recover_read": journal.read_ms}
        hold: frozenset[int] = frozenset()
        if pend is None:
            entries, spent = journal.adopt(entries)  # journal.py invariant 8: adoptions counted
            dropped += len(spent)
        else:  # isolation.py: the predecessor's queue may still run
            # counted in the rows rehome writes again; a spent row is emptied unless its slot is pending
            entries, spent = counted(entries)
            for e in spent:
                if e.slot not in pend.slots:
                    journal.release(e.slot)
            dropped += len(spent)
            p = isolation.plan(entries, pend, free_slots=journal.free_slot_ids(), num_blocks=layout.num_blocks,
                               block_size=layout.block_size)
            t1 = time.perf_counter()
            split = isolation.apply(p, loaded.kv, journal, journal.gen + 1, journal.mark)
            timings["apply"] = ms_since(t1)
            timings.update({f"apply_{k}": v for k, v in split.items()})
            entries, dropped, hold = p.entries, dropped + len(p.dropped), p.hold_blocks
            assert loaded.fence, "an isolated takeover has a predecessor to watch"
            engine.held = isolation.Held(loaded.fence[0].pid, loaded.fence[0].pid_start, p.hold_slots)
            isolated = {"moved": p.moved, "copied_blocks": len(p.copies), "dropped": len(p.dropped),
                        "held_slots": len(p.hold_slots), "held_blocks": len(p.hold_blocks)}
        t2 = time.perf_counter()
        engine.adopt(entries, dropped, hold)
        timings["adopt"] = ms_since(t2)
        bucket = runner.bucket_for(len(entries)) if entries and runner.use_graphs else None
        if bucket is not None:  # the adopted sequences' decode graph (~60-90 ms at 8b) is the step thread's first
            engine.capture_first = [bucket]  # work, while the router's replays come in; the rest when idle
        info = {"adopted": len(entries), "dropped": dropped, "journal": "adopted",
                "positions_kept": sum(e.computed for e in entries), "adopt_ms": timings}
        if pend is not None:
            info["isolated"] = isolated
    else:
        journal.format()
    return engine, info


def can_reserve(cfg: EngineConfig, memory: Any, device: torch.device) -> bool:
    """Whether a standby can tell where its predecessor's leases will be: leased memory, and a KV cache whose size
    is the configuration's (on CUDA the default sizes it from the free memory of the moment, the predecessor's)."""
    return cfg.prepare_standby and not cfg.spare and isinstance(memory, LeasedMemory) and (
        cfg.num_blocks is not None or cfg.kv_cache_gib is not None or device.type == "cpu")


def prepare_runner(cfg: EngineConfig, mcfg: ModelConfig, memory: LeasedMemory,
                   layout_of: Any) -> tuple[Loaded, ModelRunner, dict[str, Any]]:
    """A standby's runner over its reservations (memory.py `reserve`), every decode graph captured (CUDA): the
    successor's first step replays instead of capturing (60-90 ms a bucket at 8b)."""
    reserved = memory.reserve(mcfg, cfg.weights, layout_of)
    runner = new_runner(cfg, mcfg, reserved)
    t0 = time.perf_counter()
    runner.warmup()  # placeholder content: garbage logits, nothing written (padding rows), nothing kept
    info = {**reserved.timings_ms, "graphs_ms": ms_since(t0), "buckets": runner.buckets if runner.use_graphs else []}
    if cfg.rehearse == "on" or cfg.rehearse == "auto" and reserved.kv.device.type == "cuda":
        info["rehearsal"] = rehearse_takeover(cfg, mcfg, reserved)
        gc.collect()  # its engines' cycles, so that the cache below is given back with the rest
    if reserved.kv.device.type == "cuda":
        torch.cuda.empty_cache()  # the eager passes' blocks; the graphs' pool stays
    return reserved, runner, info


def rehearse_takeover(cfg: EngineConfig, mcfg: ModelConfig, reserved: Loaded) -> dict[str, Any]:
    """rehearsal.py: this configuration's engines over scratch memory beside the placeholder weights, with an eager
    runner of their own; a failure is said and the standby stands by unrehearsed (rehearsal.py invariant 3)."""
    try:
        layout = reserved.layout
        texts = prompts(max(1, min(cfg.max_num_seqs - 1, REHEARSAL_SEQS)), vocab=mcfg.vocab_size,
                        budget=cfg.max_num_batched_tokens, chunk=cfg.prefill_chunk, max_len=layout.max_len)
        mem = scratch(reserved, mcfg, texts)
        runner = new_runner(cfg.model_copy(update={"cuda_graphs": False}), mcfg, mem)

        def build(loaded: Loaded, *, mark: DrainMark | None, pend: Pending | None) -> tuple[LLMEngine, dict[str, Any]]:
            return build_engine(cfg, mcfg, loaded, loaded.layout, capture_now=False, runner=runner, mark=mark, pend=pend)

        played = rehearse(build, mem, texts)
        log.info("the takeover rehearsed over scratch memory: %s", played)
        return played
    except Exception as e:  # noqa: BLE001 - only the rehearsal's warmth is lost
        log.warning("the takeover's rehearsal failed (the standby stands by unrehearsed): %r", e)
        return {"failed": repr(e)}


def adopt_prepared(prepared: tuple[Loaded, ModelRunner, dict[str, Any]] | None,
                   loaded: Loaded) -> tuple[ModelRunner | None, str]:
    """The prepared runner if the takeover put every tensor where it was built, else None (and why)."""
    if prepared is None:
        return None, "none"
    moved = placed_alike(prepared[0], loaded)
    if moved:
        log.warning("the leases taken over are not where the standby prepared its runner (%d tensors moved, e.g. "
                    "%s): building a new one", len(moved), moved[:3])
        return None, f"moved: {len(moved)} tensors"
    return prepared[1], "reused"


def load_memory(cfg: EngineConfig, mcfg: ModelConfig, memory: Any, group: RankGroup | None, layout_of: Any) -> Loaded:
    """Every start but a single standby's: a group's ranks (cold, a successor group, a degraded or regrouping group
    from KV backups, or a standby group once assigned: one path, tp_group.py), a cold successor's takeover, a
    restarted engine's reattach, or a cold load."""
    if group is not None:
        return group.load(memory, layout_of)  # committed as a group once every rank's backup is open (run)
    if cfg.degrade_gang:  # its cache filled from every rank's backup at start-up (degrade.py)
        assert cfg.transfer_token and cfg.gang_generation is not None  # config.py
        d = memory.take_backups(cfg.degrade_gang, 0, [cfg.id], cfg.gang_generation, cfg.transfer_token,
                                cfg.adopt_wait_s)
        return degrade.adopt(memory.load(mcfg, cfg.weights, layout_of, num_blocks=d.num_blocks), d)
    if cfg.takeover_from:
        if not cfg.transfer_token:
            raise RuntimeError("HF_TAKEOVER_FROM needs HF_TRANSFER_TOKEN")
        return memory.takeover(mcfg, cfg.takeover_from, cfg.transfer_token, layout_of, cfg.adopt_wait_s,
                               weights=cfg.weights)  # a KV backup alone handed on: the weights loaded cold
    if memory.pending():
        return memory.attach(mcfg, layout_of)
    return memory.load(mcfg, cfg.weights, layout_of)


def report_fatal(link: Any) -> None:
    """Fault injection (chaos runs, SIGUSR1): behave as an engine whose CUDA context hit a fatal error: tell the
    agent through the link, then exit without cleanup. On a thread of its own: the signal handler runs on the
    main thread, which may hold the link's send lock at that moment."""
    try:
        if link is not None:
            link.report_fatal("cuda_error", "injected: an illegal memory access was encountered")
    finally:
        os._exit(70)


def front_args(cfg: EngineConfig, max_len: int) -> list[str]:
    """The HTTP front's settings (front.py)."""
    return ["--engine-id", cfg.id, "--model", cfg.model, "--size", cfg.size, "--max-model-len", str(max_len),
            "--max-waiting", str(cfg.max_waiting), "--max-num-seqs", str(cfg.max_num_seqs), "--hold-s", str(cfg.hold_s),
            "--loop-watch-s", str(cfg.loop_watch_s), "--log-level", cfg.log_level,
            "--max-body-bytes", str(cfg.max_body_bytes), "--header-timeout-s", str(cfg.header_timeout_s),
            "--body-timeout-s", str(cfg.body_timeout_s)]


def front_gone() -> None:
    """The HTTP front died (front_link.py invariant 2): so does the engine, as a crash (its leases kept for a
    successor), the way it would if it could not serve."""
    logging.shutdown()
    os._exit(70)


def run(cfg: EngineConfig) -> int:
    procs.reserve_fds()  # the burst of resumed streams' connections after a takeover never waits to grow the table
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.threads)
    t_process = time.perf_counter()
    mcfg = get_config(cfg.size)
    max_len = cfg.max_model_len or mcfg.max_seq
    device = pick_device(cfg.device)
    group = RankGroup(cfg, device) if cfg.tp > 1 else None  # ranks 1.. started, the communicator up (tp_group.py)
    if group is not None:
        mcfg, device = group.mcfg, group.device  # this rank's shard of the model, on its GPU
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    http = FrontLink(cfg.host, cfg.port, front_args(cfg, max_len), on_gone=front_gone)  # the HTTP front's process
    state = EngineSide(http, cfg.id, cfg.model, cfg.size)
    state.role = cfg.role
    state.info["front"] = {"pid": http.proc.pid}
    memory = open_memory(cfg, device)
    prepares = cfg.role == "standby" and group is None and can_reserve(cfg, memory, device)
    link = open_agent_link(cfg, can_shadow=prepares and cfg.shadow, group=group)
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=report_fatal, args=(link,), daemon=True).start())
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 <pid>`: every thread's stack in its log
    engine: LLMEngine | None = None
    prepared: tuple[Loaded, ModelRunner, dict[str, Any]] | None = None  # a standby's runner over its reservations
    stalls: list[dict[str, Any]] = []  # late wake-ups of a sleeper during a takeover, with every thread's frame

    layout_of = layout_fn(cfg, mcfg, device)
    loaded: Loaded | None = None
    spare: Spare | None = None  # a spare's weights and cache, before its assignment (memory.py `load_spare`)
    kv_backup: tuple[BackupWriter, dict[str, Any]] | None = None
    try:
        t_start = t_process
        if cfg.role == "standby":
            state.become("standby")
            if group is not None:  # every rank's kernels and the communicator (tp_group.py)
                t_warm = time.perf_counter()
                group.stand_by(warm_kernels, memory, layout_of)
                state.info["warmup_ms"] = ms_since(t_warm)
            else:
                state.info["warmup_ms"] = warm_kernels(mcfg, cfg, device)
            if link is None:
                raise RuntimeError("standby mode needs an agent (HF_AGENT_SOCKET) to receive its assignment")
            if prepares:
                assert isinstance(memory, LeasedMemory)
                prepared = prepare_runner(cfg, mcfg, memory, layout_of)
                state.info["prepared"] = prepared[2]
            if cfg.spare and group is None:  # its own weights and cache on its own GPU, before it stands by (a
                # spare group's ranks loaded theirs in `stand_by`)
                assert isinstance(memory, LeasedMemory)  # config.py
                spare = memory.load_spare(mcfg, cfg.weights, layout_of)
                state.info["spare"] = {"weights": spare.got.report(), "ms": spare.load_ms,
                                       "num_blocks": spare.layout.num_blocks}
            # The warm heap is collected and frozen (a full collection of a torch process holds the interpreter
            # for ~1 s on a loaded machine) before heartbeats begin: the agent's hang watch would take that
            # pause for a hung engine. ready() then finds nothing left to collect.
            long_lived_gc()
            link.start_heartbeats(HEARTBEAT_S)
            http.wait_hello()
            link.ready(http.endpoint)  # known to the controller: routers may send it requests while it takes over
            a = await_assignment(link, memory, state.info) if link.can_shadow else link.wait_assignment()
            t_start = time.perf_counter()
            if cfg.loop_watch_s > 0:  # who holds the interpreter while the takeover runs (the recovery's `stalls`)
                stall_watch.watch(stalls, cfg.loop_watch_s, late_ms=10.0, keep=16)
            state.role = "active"
            state.become("loading")
            state.info["assignment"] = {"predecessor": a.predecessor, "incident_id": a.incident_id, "gang": a.gang,
                                        "shadowed": state.info.pop("shadow", None)}  # mapped before the kill
            if group is not None:  # every rank told the gang: from here on a cold successor group's path, below
                group.assigned(a.gang, a.gang_generation, a.transfer_token, a.degraded)
            elif spare is not None:  # its predecessor's KV backup beside its own weights, or a fresh start
                assert isinstance(memory, LeasedMemory)
                loaded = memory.spare_takeover(mcfg, spare, a.predecessor, a.transfer_token, layout_of,
                                               cfg.adopt_wait_s)
                loaded.weights_load = {**spare.got.report(), "spare": True}  # loaded before the fault
            else:
                loaded = memory.takeover(mcfg, a.predecessor, a.transfer_token, layout_of, cfg.adopt_wait_s,
                                         fenced=cfg.fenced_takeover, known=prepared[0] if prepared else None)
        if loaded is None:
            state.become("loading")
            loaded = load_memory(cfg, mcfg, memory, group, layout_of)
        memory.start_heartbeats()
        layout = loaded.layout
        t_build = time.perf_counter()
        points = {"taken": t_build}  # a successor's way to ready, as points since its assignment (recovery `at_ms`)
        # A recovered engine serves first, eagerly: capturing its graphs (~60 ms a bucket at 8b) would hold every
        # adopted sequence; it captures them once it is idle (engine.py).
        runner, how = adopt_prepared(prepared, loaded)
        t_fence = points["runner"] = time.perf_counter()
        # a fenced takeover: nothing read or written before (isolated: nothing its predecessor may still write)
        isolate = cfg.isolated_takeover and cfg.drain_mark and group is None and not cfg.kv_backup
        fence, pend = wait_fence(loaded, cfg.adopt_wait_s, isolate=isolate)
        points["fenced"] = time.perf_counter()
        if loaded.source == "degraded":  # every old rank's backup into this engine's (group's) caches, given back
            state.info["degraded"] = degrade.restore_loaded(loaded, get_config(cfg.size), memory,
                                                            group.comm() if group is not None else degrade.ALONE)
        # a lost cache restored from its host backup (backup.py); a group's ranks all at once, before the gang
        kv_backup = open_backup(cfg, memory, loaded, group.backup if group is not None else SOLO)
        if group is not None:
            state.info["tp"] = group.commit(memory, loaded)  # the ranks' caches agree; the gang registered
            runner = group.runner(loaded)  # broadcasts each forward's plan to the other ranks first (tp.py)
        prepared = None  # a runner that did not fit is dropped (its reservations were freed by the takeover)
        mark, mark_ms = None, None
        if (cfg.drain_mark and device.type == "cuda" and group is None and kv_backup is None
                and isinstance(memory, LeasedMemory)):  # drain.py invariant 1; its bank: this engine's generation
            prior = journal_generation(loaded)
            gen = 0 if prior is None else prior + (pend is not None)
            t_mark = time.perf_counter()
            mark = open_drain(memory.client, loaded.drain, device, PageLayout(layout.slots, layout.num_blocks), gen)
            mark_ms = ms_since(t_mark)
            points["marked"] = time.perf_counter()
        engine, adopted = build_engine(cfg, mcfg, loaded, layout, capture_now=loaded.source == "file", runner=runner,
                                       backup=kv_backup[0] if kv_backup else None, mark=mark, pend=pend)
        points["built"] = time.perf_counter()
        if kv_backup:
            adopted["kv_backup"] = kv_backup[1]
            state.info["kv_backup"] = kv_backup[0].stats
        if how != "none":
            adopted["prepared_runner"] = how
        if mark is not None:
            adopted["drain_mark_ms"] = mark_ms
            adopted["drain_mark_split_ms"] = mark.opened_ms
        state.serve(engine)  # its passes' output goes to the front
        engine.start()
        points["started"] = time.perf_counter()
        long_lived_gc(collect=False)  # the model's objects live as long as the process; no full pass under heartbeats
        if isinstance(memory, LeasedMemory) and group is None:  # the control plane's sleep and wake asks (sleep.py)
            install_sleep(state, engine, memory.client, link)
        state.info["memory"] = {"kind": memory.kind, "source": loaded.source, "timings_ms": loaded.timings_ms,
                                "build_ms": ms_since(t_build), "num_blocks": layout.num_blocks,
                                "block_size": layout.block_size, "kv_bytes": loaded.kv.numel() * loaded.kv.element_size()}
        if loaded.weights_load is not None:
            state.info["memory"]["weights"] = loaded.weights_load
        if loaded.source != "file":
            state.t_start = t_start
            shadowed = (state.info.get("assignment") or {}).get("shadowed")  # its leases mapped before the kill
            at_ms = {k: ms_between(t_start, t) for k, t in points.items()}
            state.info["recovery"] = {"source": loaded.source, "ready_ms": ms_since(t_start), "at_ms": at_ms,
                                      "shadowed": bool(shadowed),
                                      "t0_wall": time.time() - (time.perf_counter() - t_start),
                                      "memory_ms": loaded.timings_ms, **adopted}
            if cfg.loop_watch_s > 0:
                state.info["recovery"]["stalls"] = stalls  # filled on while its watch runs
                # the kernel's ids of its threads: what a sampler of /proc/<pid>/task reads them by
                state.info["recovery"]["threads"] = {t.name: t.native_id for t in threading.enumerate()}
            if fence is not None:  # granted before the predecessor's exit: what waited for it, how, and when
                state.info["recovery"]["fence"] = {**fence, "from_ms": ms_between(t_start, t_fence)}
        state.become("ready")
        http.wait_hello()
        if link is not None:
            kv = (degrade.describe(state.info["degraded"]) if loaded.source == "degraded"
                  else describe_restore(kv_backup[1]) if kv_backup else None)
            link.ready(http.endpoint, weights=loaded.weights_load, kv=kv)
        if cfg.ready_file:
            write_ready_file(cfg.ready_file, {"endpoint": http.endpoint, "pid": os.getpid(), "engine_id": cfg.id,
                                              "state": "ready", **state.info})
        log.info("engine %s serving %s on %s (%s, %s, %d blocks)", cfg.id, cfg.model, http.endpoint, loaded.source,
                 device, layout.num_blocks)
        while not stop.wait(0.5):
            if engine.fatal is not None:
                return 70
            stall = kv_backup[0].stalled(time.time()) if kv_backup is not None else None
            if stall is not None:  # said once per stall, with every thread's stack (a group's ranks: SIGUSR2)
                log.warning("%s; every thread's stack follows", stall)
                faulthandler.dump_traceback(all_threads=True)
        state.become("stopping")
        return 0
    finally:
        stopped = engine.stop() if engine is not None else True
        if engine is not None and engine.drain is not None and stopped:
            engine.drain.stop()
        if kv_backup is not None:
            kv_backup[0].stop()  # and the other ranks' writers (a group), before the forwards' followers
        if group is not None:
            group.stop(engine.runner if engine is not None else None, stopped)
        http.close()
        if link is not None:
            link.close()
        memory.close()


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(parse_config(list(sys.argv[1:] if argv is None else argv))))


if __name__ == "__main__":
    main()
