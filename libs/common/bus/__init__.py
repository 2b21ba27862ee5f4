"""The NATS bus (docs/bus.md): typed events (durable through JetStream), durable consumers, typed commands.

One seam per concern: `connection` (transport, auth, the stream), `codec` (wire form, msgspec), `frames` (the hot path's NATS frames), `publish`
(events out), `receive` (events in, checked for where they come from), `durable` (JetStream pull consumers),
`commands` (request/reply); `client.Bus` composes them. Handlers run one at a time per core subscription
(nats-py's rule): keep them short or hand work to a task.
"""

from libs.common.bus.client import Bus
from libs.common.bus.codec import ok_reply
from libs.common.bus.codec import typed as _typed
from libs.common.bus.commands import retried_unanswered
from libs.common.bus.connection import nats_auth, server_answers
from libs.common.bus.durable import (
    MAX_DELIVER,
    BatchHandler,
    beside,
    delivery_attempt,
    delivery_attempts,
    holding,
)
from libs.common.bus.publish import Wired
from libs.common.bus.receive import EventHandler, Vet, engines_on_their_nodes
from libs.common.bus.spans import spans_exported

__all__ = ["MAX_DELIVER", "BatchHandler", "Bus", "EventHandler", "Vet", "Wired", "_typed", "beside",
           "delivery_attempt", "delivery_attempts", "engines_on_their_nodes", "holding", "nats_auth", "ok_reply",
           "retried_unanswered", "server_answers", "spans_exported"]
