"""dc_manager settings (environment `HF_...` or flags of `holdfast dc-manager`)."""

from __future__ import annotations

from pydantic import Field

from libs.common.config import CommonSettings
from libs.common.events import EngineSpec


class DcManagerSettings(CommonSettings):
    nodes: str = Field("", description="comma-separated nodes this manager serves; empty: every node")
    freeze_timeout_s: float = Field(2.0, gt=0, description="one freeze request's timeout")
    takeover_timeout_s: float = Field(30.0, gt=0, description="how long a takeover is asked for (the controller's "
                                      "reattach deadline is 30 s)")
    takeover_attempt_s: float = Field(5.0, gt=0, description="one takeover request's wait: unanswered, it is sent "
                                      "again (idempotent by incident) until takeover_timeout_s has passed; a node "
                                      "agent restarted while a takeover it had received ran lost it, and the one "
                                      "request waited its whole 30 s")
    spawn_timeout_s: float = Field(60.0, gt=0, description="one cold-start spawn request's timeout")
    freeze_result_after_s: float = Field(0.5, ge=0, description="a takeover not answered this long after its freeze: "
                                         "publish the freeze's own result first (else one result per intent)")
    # Safe because the controller routes a successor in only once the freeze ends (controller/pipeline.py).
    promote_shadows_early: bool = Field(True, description="a standby that shadows the failed engine is promoted "
                                        "while the freeze runs (it owns the leases later, with the token chosen here)")
    retries: int = Field(3, ge=1, description="attempts per command when the node does not answer")
    retry_backoff_s: float = Field(0.1, ge=0, description="first pause between attempts (doubles each time, at "
                                   "most a second)")
    retry_window_s: float = Field(3.0, ge=0, description="a node service that does not answer is asked again for "
                                  "at least this long (a gpu_manager or agent restarting answers nobody for a "
                                  "second or two); within the controller's freeze deadline (5 s)")
    concurrency: int = Field(256, ge=1, description="intents handled at once")
    progress_retention_s: float = Field(600.0, gt=0, description="an intent's progress record (dcm/intents/) is "
                                        "deleted this long after it was written")
    progress_retention_max: int = Field(100_000, ge=0, description="more progress records than this: the oldest "
                                        "are deleted early (none younger than progress_retention_min_s)")
    progress_retention_min_s: float = Field(60.0, ge=0, description="no progress record is deleted sooner: a "
                                            "redelivered intent still finds it (no second freeze)")
    progress_retention_check_s: float = Field(5.0, gt=0, description="how often progress records are checked")
    ack_wait_s: float = Field(5.0, gt=0, description="an intent not finished by a dead manager is redelivered after this")
    specs: dict[str, EngineSpec] = Field(default_factory=dict,
                                         description="engine class -> spec for cold starts (etcd specs/<class> wins)")

    def node_set(self) -> frozenset[str] | None:
        items = frozenset(n.strip() for n in self.nodes.split(",") if n.strip())
        return items or None
