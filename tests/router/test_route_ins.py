"""The route-in's timeline: one entry per endpoint added, its first request and first answer only, bounded."""

from __future__ import annotations

from services.router.route_ins import RouteIns
from tests.support import Clock


def test_only_the_first_request_and_answer_after_an_addition_are_kept() -> None:
    log = RouteIns(clock=Clock(now=1000.0, step=1.0))
    log.sent("e1")  # before any addition: nothing to attach it to
    log.added("e1", published=1000.5)
    log.sent("e1")
    log.sent("e1")
    log.answered("e1")
    log.answered("e1")
    assert log.recent() == [{"engine_id": "e1", "published": 1000.5, "received": 1001.0, "first_sent": 1002.0,
                             "first_answered": 1003.0}]


def test_an_endpoint_added_again_starts_a_new_entry_and_old_ones_fall_off() -> None:
    log = RouteIns(keep=2, clock=Clock(now=1000.0, step=1.0))
    log.added("a", None)  # added by a reconcile, not an event: received is the only time there is
    log.sent("a")
    log.added("b", 1001.5)
    log.added("a", 1002.5)  # a again, later: its first request is still to come
    log.added("c", 1003.5)
    assert [(e["engine_id"], "first_sent" in e) for e in log.recent()] == [("a", False), ("c", False)]
    assert log.recent()[0]["published"] == 1002.5
