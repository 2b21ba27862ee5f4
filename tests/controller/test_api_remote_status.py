"""A node's typed refusal maps to the HTTP status the same error raised in the controller maps to."""

from __future__ import annotations

from libs.common.errors import CommandTimeout, NotFound, StaleEpoch, Unavailable
from services.controller.api.app import REMOTE_STATUS, STATUS_OF


def test_every_local_status_holds_for_the_same_code_from_a_node() -> None:
    for err, status in STATUS_OF.items():
        assert REMOTE_STATUS[err.code] == status


def test_a_node_timing_out_is_unavailable_not_a_bad_gateway() -> None:
    assert REMOTE_STATUS[CommandTimeout.code] == 503
    assert REMOTE_STATUS[Unavailable.code] == 503
    assert REMOTE_STATUS[NotFound.code] == 404
    assert REMOTE_STATUS[StaleEpoch.code] == 409
