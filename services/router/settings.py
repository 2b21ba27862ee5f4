"""The router's settings (flags `--router-port 18000`..., or env `HF_ROUTER_PORT`...)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from libs.common.config import DEFAULT_ROUTER_PORT, CommonSettings
from libs.common.ids import new_id
from libs.common.procs import usable_cpus
from libs.common.web.tokens import ROUTER_SCOPES, TokenTable


class RouterSettings(CommonSettings):
    instance: str = Field(default_factory=lambda: new_id("router"), description="this router's id")
    router_host: str = Field("127.0.0.1", description="HTTP listen address")
    router_port: int = Field(DEFAULT_ROUTER_PORT, description="HTTP port (0: a free one)")
    router_workers: int = Field(0, ge=0, le=64, validate_default=True,
                                description="router processes behind the one port, each with its own event loop "
                                "(services/router/workers.py), so that relaying many streams spreads over as many "
                                "cores; 0: one per 4 CPUs this process may use (its affinity, and its cgroup's CPU "
                                "quota: a container's limit), 1 to 8")
    router_worker_index: int = Field(0, ge=0, description="set by worker 0 for the workers it starts: which this is")
    router_worker_fds: str = Field("", description="set by worker 0: the inherited public and own socket descriptors")
    router_worker_ports: str = Field("", description="set by worker 0: every worker's own /stats port, in order")
    router_parent_pid: int = Field(0, ge=0, description="set by worker 0: its pid (a worker dies with it)")
    metrics_host: str = Field("127.0.0.1", description="address of the Prometheus /metrics server")
    metrics_port: int | None = Field(None, ge=0, description="port of the Prometheus /metrics server (0: a free "
                                     "one, in health's metrics_port); none: not served")
    api_keys: str = Field("", description="the API keys clients send (Authorization: Bearer), as hashes: "
                          "'infer:sha256:<hex>' entries, comma-separated (`holdfast api-token infer` prints one)")
    api_keys_file: Path | None = Field(None, description="a file of such entries, one a line (a mounted Secret); "
                                       "read at start")
    api_key: str = Field("", description="one plain key (development). With no key at all and anonymous clients "
                         "not allowed, one is generated into <state_dir>/router-api-key (0600)")
    allow_anonymous: bool | None = Field(None, description="serve clients without a key; unset: only where no key is "
                                         "configured and the router listens on loopback alone (where the node's "
                                         "users reach the engines' own ports anyway)")
    max_body_bytes: int = Field(16 << 20, gt=0, description="a request body over this is refused (413) before "
                                "it is read")
    max_context_tokens: int = Field(1 << 17, gt=0, description="the longest context (prompt tokens) of the models "
                                    "behind the router: an OpenAI request's longer prompt is refused (400 "
                                    "context_length_exceeded) before it reaches an engine, one that certainly cannot "
                                    "fit before its body is parsed")
    linger_max_bytes: int = Field(64 << 20, ge=0, description="after a refusal, what a client still sends is "
                                  "read and dropped up to this much, so that it reads its answer")
    linger_max_s: float = Field(5.0, ge=0, description="... and for at most this long")
    header_timeout_s: float = Field(10.0, ge=0, description="a request's headers must be complete this long after "
                                    "its connection opened or its first byte came, or the connection is closed")
    body_timeout_s: float = Field(30.0, ge=0, description="a request's body must be complete this long after its "
                                  "headers, or it is answered 408 and its connection closed (0: no bound)")
    hold_timeout_s: float = Field(10.0, description="a request waits this long for an endpoint of its model, then 503")
    recovery_hold_s: float = Field(300.0, ge=0, description="while an incident brings a successor in for an "
                                   "endpoint of the model (from its route-out to its route-in or its end), requests "
                                   "wait for it up to this long from the route-out, beyond hold_timeout_s")
    queue_max: int = Field(256, ge=0, description="new requests held per model at most; more get 503 at once")
    max_replays: int = Field(3, ge=0, description="resumptions of one request on another engine before an error")
    max_engine_errors: int = Field(2, ge=1, description="engines that may fail in-band (engine_error) while running "
                                   "one request before it is failed instead of replayed (relay.py invariant 6)")
    token_timeout_s: float = Field(30.0, description="an engine silent this long mid-stream counts as failed")
    resume_batch_s: float = Field(0.005, ge=0, description="replays that pick one engine within this window go as one "
                                  "POST /generate_many (services/router/resume_batch.py); 0: each alone")
    connect_timeout_s: float = Field(2.0, description="connecting to an engine")
    engine_spare_connections: int = Field(16, ge=0, description="connections opened to each engine ahead of need, so "
                                          "that a new request does not connect on its way (services/router/spare.py); "
                                          "0: none")
    engine_keepalive_connections: int = Field(1024, ge=0, description="idle connections to engines kept at most (all "
                                              "engines together)")
    engine_keepalive_s: float = Field(20.0, gt=0, description="an idle or spare connection to an engine is closed "
                                      "after this long (below the engines' own 30 s, so the router never reuses one "
                                      "the engine is closing)")
    suspect_s: float = Field(5.0, description="an engine whose connection failed gets no new requests this long "
                             "(or until an endpoint event says otherwise)")
    reconcile_s: float = Field(3.0, gt=0, description="re-read etcd's endpoints/ this often (and on every NATS "
                               "reconnect) and make the table equal to it")
    reconcile_grace_s: float = Field(5.0, ge=0, description="an endpoint event this recent outranks what etcd says "
                                     "(the controller's etcd write may land just after its event)")
    model_forget_s: float = Field(60.0, ge=0, description="a model stays known (held, listed in /v1/models) this "
                                  "long after its last endpoint went; then the OpenAI API answers 404 for it")
    router_loop_watch_ms: float = Field(0.0, ge=0, description="record wake-ups of the router's event loop later than 1 ms, "
                                 "ticking this often (GET /stats `loop_late`: a benchmark's view of the router); 0: off")
    reconcile_read_timeout_s: float = Field(5.0, gt=0, description="one read of etcd's endpoints/ gives up after this")

    @field_validator("router_workers")
    @classmethod
    def _auto_workers(cls, v: int) -> int:
        return v or min(8, max(1, usable_cpus() // 4))

    @field_validator("api_keys")
    @classmethod
    def _keys_parse(cls, v: str) -> str:
        TokenTable.parse(v, ROUTER_SCOPES)  # a bad entry stops the start with a clear error, not the first request
        return v
