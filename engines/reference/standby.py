"""A warm standby's life before its assignment, and the instant takeover of the engine it shadows.

Before any failure the agent tells the standby to *shadow* an active engine of its model on its GPU: it maps
that engine's weights read-only, leases a KV cache of its own, builds the full model over them and runs it
once (kernels, allocator, the real shapes). When that engine fails and the standby is assigned to it, the
standby serves at once: nothing is mapped, built or loaded on the recovery path. It maps that engine's KV cache
too (read-only): the requests the router replays find their prefixes there (kv_reuse.py) for `kv_reuse_s`.

Why serving may start before the predecessor's death is confirmed: the two share only the weights, which
neither writes (read-only here: a write faults); each has its own KV cache. Ownership of the leases still
moves only after the death (the gpu_manager refuses the takeover while the predecessor lives): `adopt`
runs on a thread of its own and retries until then. If it cannot (the leases were reclaimed, the
manager refused), this process exits with 75 (lease lost), as an engine that lost its memory must.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from engines.reference import stall_watch
from engines.reference.config import ModelConfig
from engines.reference.engine import EngineCore
from engines.reference.kv_reuse import retire_later
from engines.reference.memory import LeasedMemory, LocalMemory, retry_until
from engines.reference.model import Transformer
from engines.reference.server import EngineState
from engines.reference.settings import EngineSettings
from libs.common.gc_tuning import long_lived_gc
from libs.common.procs import ms_since, wall_time_of

log = logging.getLogger("holdfast.engine.standby")

EXIT_LEASE_LOST = 75



@dataclass
class ShadowCore:
    owner: str
    core: EngineCore
    read_only: bool
    timings_ms: dict[str, float]


class Standby:
    def __init__(self, s: EngineSettings, cfg: ModelConfig, memory: LocalMemory | LeasedMemory, link: Any,
                 state: EngineState, max_seq: int) -> None:
        self.s, self.cfg, self.memory, self.link, self.state, self.max_seq = s, cfg, memory, link, state, max_seq
        self.shadow: ShadowCore | None = None
        self._continuing: threading.Thread | None = None  # the predecessor's generations in flight, resumed

    def wait_assignment(self) -> Any:
        """Follow shadow/unshadow instructions until the assignment comes; return it."""
        from libs.client.agent_link import Assignment, OwnerDown, Shadow

        while True:
            ins = self.link.wait_instruction()
            if isinstance(ins, Assignment):
                return ins
            if isinstance(ins, OwnerDown):
                if self.shadows(ins.owner):  # its failure is published: the assignment will likely be ours
                    self._continue(early=True)
            elif isinstance(ins, Shadow):
                self._shadow(ins.owner, ins.share_token)
            else:
                self.drop()
                self.link.shadowing(None)

    def _shadow(self, owner: str, share_token: str) -> None:
        t0 = time.perf_counter()
        self.drop()
        try:
            loaded = self.memory.shadow(self.cfg, owner, share_token, self.s.slots, self.max_seq)
            donor = loaded.donor if self.s.kv_reuse_s > 0 else None
            core = EngineCore(Transformer(self.cfg, loaded.weights), loaded.kv, prefill_chunk=self.s.prefill_chunk,
                              graphs=self.s.graphs, marks=loaded.marks, donor=donor)
            warm_ms = core.warm()
            core.warm_concurrent(core.slots)  # what the first requests would allocate, allocated now
        except Exception as e:  # noqa: BLE001 - a failed shadow leaves a plain warm standby, said to the agent
            log.warning("cannot shadow %s: %s: %s", owner, type(e).__name__, e)
            self.drop()
            self.link.shadowing(None)
            return
        long_lived_gc()  # the model and the process live on: no full collection on the takeover's path
        timings = {**loaded.timings_ms, "warm_ms": round(warm_ms, 3), "total_ms": ms_since(t0)}
        self.shadow = ShadowCore(owner, core, loaded.read_only, timings)
        self.state.info["shadow"] = {"owner": owner, "read_only": loaded.read_only, "timings_ms": timings}
        log.info("shadowing %s (%s) in %.1f ms", owner, "read-only" if loaded.read_only else "read-write mapping",
                 timings["total_ms"])
        self.link.shadowing(owner, read_only=loaded.read_only)

    def drop(self) -> None:
        """Forget the shadow: the model over its memory first, then the mappings."""
        if self.shadow is None:
            return
        if self._continuing is not None:  # its forwards read the mappings about to go
            self._continuing.join()
            self._continuing = None
        self.shadow = None
        self.state.info.pop("shadow", None)
        gc.unfreeze()  # frozen by _shadow: the model must be collectable again
        gc.collect()  # the model's tensors must be gone before their memory is unmapped
        self.memory.drop_shadow()

    def shadows(self, predecessor: str) -> bool:
        return self.shadow is not None and self.shadow.owner == predecessor

    def promote(self, predecessor: str, transfer_token: str, t_start: float) -> EngineCore:
        """Serve the shadowed predecessor's model now; own its leases once it is dead (background)."""
        assert self.shadow is not None
        shadow = self.shadow
        rec: dict[str, Any] = {"source": "shadow", "first_token_ms": ms_since(t_start), "read_only": shadow.read_only,
               "shadow_timings_ms": shadow.timings_ms, "t0_wall": wall_time_of(t_start)}
        self.state.info["recovery"] = rec

        def at(key: str):  # noqa: ANN202 - a callback recording ms since the promotion
            return lambda t: rec.__setitem__(key, round((t - t_start) * 1000, 3))

        self.state.on_first_request = at("first_request_ms")  # the router's first request reached us
        self.state.on_first_token = at("first_request_token_ms")  # and its first token left
        shadow.core.trace_next(rec.setdefault("first_generation", {}), t_start)
        if shadow.core.donor is not None:  # the predecessor's cache, for the replayed requests' prefixes
            self._continue(early=False)
            retire_later(self.s.kv_reuse_s, shadow.core.retire_donor)
        stall_watch.watch(rec.setdefault("stalls", []), 0.3)  # who holds the interpreter meanwhile
        threading.Thread(target=self._adopt, args=(predecessor, transfer_token), name="adopt", daemon=True).start()
        return shadow.core

    def _continue(self, *, early: bool) -> None:
        """Resume the shadowed engine's generations in flight (continuation.py) on a thread, once: on the
        agent's word that it failed (`early`), else at the promotion. Results wait in the shadow's own slots
        and are served only once it is promoted; a dropped shadow waits for the thread first. What it did goes
        to /health `continued`."""
        if self._continuing is not None or self.shadow is None or self.shadow.core.donor is None:
            return
        self._continuing = self.shadow.core.continue_in_background(self.state.info.setdefault("continued", {}),
                                                                   early=early)

    def _adopt(self, predecessor: str, token: str) -> None:
        from libs.client.protocol import NotFrozenYet, PredecessorAlive
        from libs.common.errors import Unavailable

        t0 = time.perf_counter()
        waits = (PredecessorAlive, Unavailable, NotFrozenYet)
        try:
            # not dead yet (PredecessorAlive); the gpu_manager restarting (Unavailable); or its leases not frozen
            # yet (the control plane promotes a shadow while it freezes); for good only after the wait
            timings, tries = retry_until(lambda: self.memory.adopt(predecessor, token), waits, self.s.adopt_timeout_s)
        except waits as e:
            log.critical("cannot own %s's leases after %.0f s: %s", predecessor, self.s.adopt_timeout_s, e)
        except Exception as e:  # noqa: BLE001 - any other refusal means the memory is not ours to serve
            log.critical("taking over %s's leases failed: %s: %s", predecessor, type(e).__name__, e)
        else:
            self.state.info["recovery"]["adopted"] = {**timings, "after_ms": ms_since(t0), "tries": tries}
            log.info("owns %s's leases now (%.1f ms after the promotion, %d tries)", predecessor, ms_since(t0), tries)
            return
        os._exit(EXIT_LEASE_LOST)
