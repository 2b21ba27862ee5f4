"""The controller's view: the shared cluster view (`libs.common.cluster_view`) plus incidents.

Incident records are the controller's own (the API lists them; `open_by_engine` says which engine is in
an incident); the dc_manager's view does not parse them.
"""

from __future__ import annotations

import time
from typing import Any

from libs.common.cluster_view import ClusterView as BaseClusterView
from libs.common.cluster_view import GpuSlot
from libs.common.store import Store
from services.controller.announced_ends import AnnouncedEnds, Ledger
from services.controller.incident import IncidentRecord, IncidentState
from services.controller.rollout import RolloutRecord

__all__ = ["ClusterView", "GpuSlot"]


class ClusterView(BaseClusterView):
    def __init__(self) -> None:
        super().__init__()
        self.incidents: dict[str, IncidentRecord] = {}
        self.open_by_engine: dict[str, str] = {}
        # engine id -> the latest generation of it that an ended incident took out of service (replaced or gone; not
        # one that serves on, `serves_on` or a regroup's own engine): a late event of it routes nothing
        self.gone_generation: dict[str, int] = {}
        # engine id -> the latest generation of it an incident resolved by another engine (replaced for sure; its
        # record may outlive it, a lost node's: operations.py, routes.py `serves_on`)
        self.replaced_generation: dict[str, int] = {}
        self.rollouts: dict[str, RolloutRecord] = {}  # engine class -> its latest roll-out
        # Incident records this process is writing, by id: (the bytes sent, the record). When the watch brings
        # back exactly those bytes, the record is taken as is instead of parsed again (~4 per incident).
        # Several writes of one record may be on their way (sent one transaction after another): a queue per
        # id, in the order sent, which is the order etcd commits them and the watch brings them back.
        self._own: dict[str, list[tuple[bytes, IncidentRecord]]] = {}
        # Ended incidents (resolved, failed) whose end is announced: id -> when it ended, oldest first
        # (libs/common/retention.py deletes from the front; a record still to announce is never offered).
        self.ended: dict[str, float] = {}
        self.announced = AnnouncedEnds()  # the leader's ledgers of published ends (`announced/`, announced_ends.py)

    def expect_own(self, key: str, value: bytes | None, obj: Any) -> None:
        """A `BatchWriter.on_send` hook: an incident record of ours is on its way to etcd."""
        if value is None or not isinstance(obj, IncidentRecord) or not key.startswith("incidents/"):
            return
        if len(self._own) > 50_000:  # writes whose watch event never came (a failed transaction): forget them
            self._own.clear()
        self._own.setdefault(key[len("incidents/"):], []).append((value, obj))

    def _on_incidents(self, kind: str, rest: str, value: bytes | None) -> Any:
        if kind == "delete":
            self._own.pop(rest, None)
            self.ended.pop(rest, None)
            self.announced.deleted(rest, time.time())
            rec = self.incidents.pop(rest, None)
            if rec is not None and self.open_by_engine.get(rec.engine_id) == rest:
                del self.open_by_engine[rec.engine_id]
            return rec
        rec = None
        queue = self._own.get(rest)
        while queue:  # an entry that does not match was never committed (a failed transaction): dropped
            raw, obj = queue.pop(0)
            if raw == value:
                rec = obj  # our own write, byte for byte: the record it was encoded from
                break
        if queue is not None and not queue:
            del self._own[rest]
        if rec is None:
            rec = IncidentRecord.model_validate_json(value or b"{}")
        self.incidents[rest] = rec
        if rec.terminal:
            if self.open_by_engine.get(rec.engine_id) == rest:
                del self.open_by_engine[rec.engine_id]
            if not rec.serves_on and rec.successor_id != rec.engine_id:
                self.gone_generation[rec.engine_id] = max(rec.generation, self.gone_generation.get(rec.engine_id, -1))
            if rec.state is IncidentState.RESOLVED and rec.successor_id and rec.successor_id != rec.engine_id:
                self.replaced_generation[rec.engine_id] = max(rec.generation,
                                                              self.replaced_generation.get(rec.engine_id, -1))
            if rest not in self.ended and (not rec.end_unannounced or rest in self.announced):
                self.ended[rest] = rec.updated_at  # retention waits for its end's announcement
        else:
            self.open_by_engine[rec.engine_id] = rest
        return rec

    async def load(self, store: Store) -> None:
        await super().load(store)
        # The snapshot comes in key order: put the ended records in the order they ended (oldest first).
        self.ended = dict(sorted(self.ended.items(), key=lambda item: item[1]))
        self.announced.sweep(self.incidents, time.time())  # ledgers naming only deleted records are spent

    def _on_announced(self, kind: str, rest: str, value: bytes | None) -> Any:
        """A ledger of published ends: the ended records it names become retention's to delete."""
        if kind == "delete":
            self.announced.remove(rest)
            return None
        ids = Ledger.model_validate_json(value or b"{}").incidents
        self.announced.add(rest, ids, time.time())
        for inc_id in ids:
            rec = self.incidents.get(inc_id)
            if rec is not None and rec.terminal and inc_id not in self.ended:
                self.ended[inc_id] = rec.updated_at
        return ids

    def _on_rollouts(self, kind: str, rest: str, value: bytes | None) -> Any:
        if kind == "delete":
            return self.rollouts.pop(rest, None)
        rec = RolloutRecord.model_validate_json(value or b"{}")
        self.rollouts[rest] = rec
        return rec

    def out_of_service(self, engine_id: str, generation: int) -> bool:
        """That engine generation left service: an ended incident replaced it or found it gone, or its record says
        it failed or stopped."""
        engine = self.engines.get(engine_id)
        if engine is not None and engine.generation == generation and engine.state in ("failed", "stopped"):
            return True
        return self.gone_generation.get(engine_id, -1) >= generation

    def open_incident_for(self, engine_id: str) -> IncidentRecord | None:
        inc = self.open_by_engine.get(engine_id)
        return self.incidents.get(inc) if inc else None
