"""Controller settings (environment `HF_...` or flags of `holdfast controller`)."""

from __future__ import annotations

import os
import socket

from pydantic import Field, field_validator

from libs.common.config import DEFAULT_API_PORT, CommonSettings
from libs.common.web.tokens import TokenTable


def default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class ControllerSettings(CommonSettings):
    instance: str = Field(default_factory=default_instance, description="this controller's id in the election")
    leader_ttl_s: int = Field(3, ge=1, description="etcd lease ttl of the leader key: hand-over time after a crash")
    api_enabled: bool = Field(True, description="serve the REST admin API in this process")
    api_host: str = Field("127.0.0.1", description="REST admin API bind address")
    api_port: int = Field(DEFAULT_API_PORT, description="REST admin API port (0: pick a free one)")
    api_tokens: str = Field("", description="the API's tokens as hashes: comma-separated '<scope>:sha256:<hex>' "
                            "(scope read, operate or admin; `holdfast api-token SCOPE` prints a new one)")
    admin_token: str = Field("", description="dev: a plain admin-scope token, hashed at start; empty: generated "
                             "into state_dir unless api_tokens is set")
    read_token: str = Field("", description="dev: a plain read-scope token, hashed at start; empty: none")
    api_cors_origins: str = Field("", description="comma-separated origins a browser may call the API from; "
                                  "empty: no CORS headers at all (browsers refuse cross-origin calls)")
    api_max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies are refused with 413 "
                                    "before they are read (every route)")
    api_linger_max_bytes: int = Field(64 << 20, ge=0, description="a connection the API closes while its client "
                                      "still sends (a refused body) first reads and drops up to this many bytes, "
                                      "so the client reads its 401/413 instead of a reset (api/linger.py)")
    api_linger_max_s: float = Field(10.0, ge=0, description="and lingers at most this long (0: close at once)")
    api_header_timeout_s: float = Field(10.0, ge=0, description="a request's headers must be complete this long "
                                        "after its connection opened or its first byte came, or it is closed")
    api_body_timeout_s: float = Field(30.0, ge=0, description="a request's body must be complete this long after "
                                      "its headers, or it is answered 408 and its connection closed (0: no bound)")
    freeze_deadline_s: float = Field(5.0, gt=0, description="freeze must be confirmed within this after dispatch")
    reattach_deadline_s: float = Field(30.0, gt=0, description="takeover must be confirmed within this after freeze")
    fallback_deadline_s: float = Field(300.0, gt=0, description="a cold start must be ready within this")
    dispatch_before_create: bool = Field(True, description="a routed engine's first fault is routed out and "
                                         "dispatched while its incident's create is in flight (pipeline.py "
                                         "`_dispatch_first`); false: the create is confirmed first")
    waiting_record_delay_s: float = Field(1.0, ge=0, description="an incident's waiting state (freezing, fallback) "
                                          "is recorded only if it still waits this long after dispatch (0: at once)")
    record_linger_s: float = Field(0.005, ge=0, description="written-behind etcd writes (later records, endpoint "
                                   "keys) wait up to this for an awaited write to share its transaction (0: none)")
    concurrency: int = Field(256, ge=1, description="events handled at once per durable consumer")
    result_concurrency: int = Field(1024, ge=1, description="intent results handled at once: a result holds "
                                    "its slot through route-in, its end's write and the end's announcement, a "
                                    "round trip more than a fault; with no more slots than the faults, results "
                                    "queue behind new incidents in a burst (docs/controlplane.md)")
    ack_wait_s: float = Field(3.0, gt=0, description="JetStream redelivers an unacked event after this")
    tick_s: float = Field(0.1, gt=0, description="how often deadlines are checked")
    node_lost_s: float = Field(10.0, ge=0, description="a node gone from etcd this long (its agent's key, a few "
                               "seconds' lease): its active engines that do not answer at their endpoints are "
                               "faulted as lost with it (services/controller/lost_nodes.py); 0: never")
    node_probe_timeout_s: float = Field(2.0, gt=0, description="how long a lost node's engine has to answer")
    standby_announce_s: float = Field(0.5, ge=0, description="how often routers are told of a routed engine's new "
                                      "shadowing standby, to keep spare connections to it (standbys.py); 0: never")
    standby_refresh_s: float = Field(30.0, gt=0, description="how often every standby is told again (a router that "
                                     "started since learns it)")
    regroup_after_s: float = Field(0.0, ge=0, description="a degraded engine (fewer ranks than its spec after its "
                                   "group lost a GPU) is regrouped into a whole group this long after its node has the "
                                   "GPUs for one again (regroup_driver.py). 0 (the default): only when an operator asks "
                                   "(POST /v1/engines/{id}/regroup), since every stream of the engine pauses while the "
                                   "group's ranks load their shards cold")
    incident_retention_s: float = Field(7 * 86_400.0, gt=0, description="an ended incident's record is deleted "
                                        "from etcd this long after it ended")
    incident_retention_max: int = Field(100_000, ge=0, description="more ended incident records than this: the "
                                        "oldest are deleted early (none younger than incident_retention_min_s)")
    incident_retention_min_s: float = Field(120.0, ge=0, description="no ended incident's record is deleted sooner "
                                            "than this: a redelivered or retried fault still finds it")
    incident_retention_check_s: float = Field(5.0, gt=0, description="how often ended records are checked")

    @field_validator("api_tokens")
    @classmethod
    def _tokens_parse(cls, v: str) -> str:
        TokenTable.parse(v)  # a bad entry stops the start with a clear error, not the first request
        return v
