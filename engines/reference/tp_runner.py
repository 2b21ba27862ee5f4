"""A tensor-parallel engine's processes (`serve --tp N`): rank 0 starts ranks 1..N-1, every rank loads (or takes
over) its own shard into its own leases, rank 0 registers the ranks' leases as one gang and serves HTTP; the other
ranks follow rank 0's forwards (tp.py).

- Engine ids: rank 0 is the engine's id, rank r > 0 `<id>-r<r>` (each rank is a gpu_manager client of its own).
- Devices: rank r on GPU `gpu + r` (its leases there too); CUDA ranks talk over NCCL, CPU ranks over gloo.
- Start-up: cold, each rank reads its shard of the weights file into a weights lease and leases its KV cache; with
  `HF_TAKEOVER_GANG` + `HF_TRANSFER_TOKEN` + `HF_GANG_GENERATION` (a successor group), each rank takes its rank's
  leases of the frozen gang over (`gang_takeover`: all ranks' leases move together or none) and nothing is read
  from disk. Every rank then meets at a barrier, and (cold) rank 0 registers the gang.
- One unit: ranks 1..N-1 die with rank 0 (PR_SET_PDEATHSIG); rank 0 exits (70) when any of them exits, and a rank
  whose peer died fails its next collective. So the group lives and dies whole. Rank 0 names its followers'
  processes to the agent when it registers (`Followers.report`: pids and start times), and the agent watches each
  through a pidfd of its own: a follower's death is the group's fault at once, not ~50 ms later through rank 0's 70
  (nor later still while rank 0 is stuck in a collective). The ready file's `tp` has every rank's pid (`pids`).
Not yet: standby groups, a rank's reattach alone (its new epoch makes the gang stale: the group is replaced).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from engines.http_thread import HttpThread
from engines.ready_file import write_ready_file
from engines.reference.config import get_config
from engines.reference.kv_reuse import retire_later
from engines.reference.memory import LeasedMemory, Loaded
from engines.reference.ranks import IDLE_FOREVER, SETTINGS_ENV, Followers, free_port, rank_place
from engines.reference.server import EngineState, build_app, warm_routes
from engines.reference.settings import EngineSettings
from engines.reference.startup import first_token, open_agent_link, open_memory, pick_device
from engines.reference.tp import (
    ForwardChannel,
    ShardedTransformer,
    TensorParallelCore,
    follow,
    read_shard,
    shard_config,
)
from libs.common.events import rank_engine_id

log = logging.getLogger("holdfast.engine.tp")
rank_id = rank_engine_id  # the agent and the control plane name the ranks the same way (libs/common/events.py)


def run_tp(s: EngineSettings) -> int:
    """Rank `s.tp_rank` of a tensor-parallel engine; rank 0 starts the others first."""
    logging.basicConfig(level=s.log_level, format=f"%(asctime)s %(levelname)s %(name)s[r{s.tp_rank}]: %(message)s")
    torch.set_num_threads(s.threads)
    if s.role != "active":
        raise ValueError("--tp > 1 runs active engines only: standby groups are not built yet (docs/multi_gpu.md)")
    whole = get_config(s.size)
    if whole.n_kv_heads % s.tp:
        raise ValueError(f"--tp {s.tp} does not divide {whole.name}'s {whole.n_kv_heads} kv heads: the reference "
                         "engine's cache has as many heads in every layer; the batched engine runs uneven groups")
    rank = s.tp_rank
    if rank == 0:
        s = s.model_copy(update={"tp_port": s.tp_port or free_port()})
    cfg = shard_config(whole, s.tp, s.tp_rank)
    max_seq = s.max_seq or cfg.max_seq
    device, gpu, backend = rank_place(s, s.gpu, rank, pick_device(s.device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    me = s.model_copy(update={"id": rank_id(s.id, rank), "gpu": gpu})
    owners = [rank_id(s.id, r) for r in range(s.tp)]
    followers = Followers(s) if rank == 0 else None
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{s.tp_port}",
                            rank=rank, world_size=s.tp, timeout=IDLE_FOREVER)
    state = EngineState(s.id, s.model, s.size)
    stop = threading.Event()
    http = None
    if rank == 0:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        http = HttpThread(build_app(state), s.host, s.port, warm_routes)
        http.start()
    memory = open_memory(me, device)
    try:
        t0 = time.perf_counter()
        state.state = "loading"
        loaded = _load(s, memory, cfg, rank, owners, max_seq)
        dist.barrier()  # every rank's leases committed (or taken over)
        gang_id = s.takeover_gang or s.gang or s.id
        gang = None
        if isinstance(memory, LeasedMemory) and s.takeover_gang and memory.client.last_gang is not None:
            gang = memory.client.last_gang.model_dump()  # the manager moved the gang on with the takeover
        elif isinstance(memory, LeasedMemory) and rank == 0:
            gang = memory.register_gang(gang_id, owners)
        memory.start_heartbeats()
        model = ShardedTransformer(cfg, loaded.weights)
        channel = ForwardChannel(device)
        if rank != 0:
            ran = follow(model, loaded.kv, channel)
            log.info("rank %d stopped after %d forwards", rank, ran)
            return 0
        core = _serve(s, state, model, loaded, channel, t0)
        assert followers is not None
        state.info["tp"] = {"ranks": s.tp, "engine_ids": owners, "backend": dist.get_backend(), "gang": gang,
                            "pids": followers.pids()}
        link = open_agent_link(s, followers=followers.report())
        state.state = "ready"
        if link is not None:
            link.ready(http.endpoint)  # type: ignore[union-attr]
        if s.ready_file:
            write_ready_file(s.ready_file, {"endpoint": http.endpoint, "pid": os.getpid(),  # type: ignore[union-attr]
                                            "engine_id": s.id, "state": "ready", **state.info})
        log.info("engine %s serving %s on %s: %d ranks (%s)", s.id, s.model, http.endpoint, s.tp,  # type: ignore[union-attr]
                 loaded.source)
        stop.wait()
        state.state = "stopping"
        followers.stopping = True
        core.stop()
        followers.wait()
        return 0
    finally:
        if http is not None:
            http.stop()
        memory.close()


def _load(s: EngineSettings, memory: Any, cfg: Any, rank: int, owners: list[str], max_seq: int) -> Loaded:
    if s.takeover_gang:
        if memory.kind != "leased" or not s.transfer_token or s.gang_generation is None:
            raise RuntimeError("HF_TAKEOVER_GANG needs leased memory, HF_TRANSFER_TOKEN and HF_GANG_GENERATION")
        return memory.gang_takeover(cfg, s.takeover_gang, rank, owners, s.gang_generation, s.transfer_token,
                                    s.slots, max_seq)
    return memory.load_shard(cfg, read_shard(s.weights, get_config(s.size), s.tp, rank), s.slots, max_seq)


def _serve(s: EngineSettings, state: EngineState, model: ShardedTransformer, loaded: Loaded, channel: ForwardChannel,
           t0: float) -> TensorParallelCore:
    """Rank 0's core: warmed after a cold load; after a takeover one token first, and the predecessor's requests
    keep their slots as a single engine's do (every rank ran the same forwards: tp.py invariant 1)."""
    recovered = loaded.source != "file"
    core = TensorParallelCore(model, loaded.kv, channel, prefill_chunk=s.prefill_chunk, marks=loaded.marks,
                              inherit=recovered and s.kv_reuse_s > 0)
    state.info["memory"] = {"kind": "leased" if loaded.marks is not None else "local", "source": loaded.source,
                            "timings_ms": loaded.timings_ms}
    if recovered:
        first_token(core)
        state.info["recovery"] = {"source": loaded.source, "first_token_ms": round((time.perf_counter() - t0) * 1000, 3)}
        if core.inherited is not None:
            retire_later(s.kv_reuse_s, core.retire_donor)
    else:
        state.info["warmup_ms"] = core.warm()
    state.install(core)
    return core


def main() -> None:
    """A follower rank: rank 0 ends it (STOP, or its death); a signal to the process group is rank 0's to handle."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    s = EngineSettings(**json.loads(os.environ[SETTINGS_ENV]))
    sys.exit(run_tp(s))


if __name__ == "__main__":
    main()
