"""The checks that set a stored row aside (pure: records.py's readers, quarantine.py's gang checks)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from libs.common.events import LeaseInfo, LeaseState, Tag
from services.gpu_manager.gang import Gang
from services.gpu_manager.quarantine import LeaseRow, gang_defects
from services.gpu_manager.records import LeaseRecord, RowDefect, gang_from_row, gang_to_row

NODE = "node-1"


def lease_row(**over: object) -> SimpleNamespace:
    info = LeaseInfo(id="l1", node=NODE, gpu=0, size=4096, chunk_size=4096, tag=Tag.WEIGHTS, owner="e", epoch=1,
                     state=LeaseState.ACTIVE, created_at=time.time(), last_seen=time.time())
    row = LeaseRecord(info=info, owner_uid=0, owner_pid=1).to_row() | over
    return SimpleNamespace(**row, _mapping=row)


def test_a_lease_row_as_written_reads_back() -> None:
    rec = LeaseRecord.from_row(lease_row(), NODE)
    assert rec.id == "l1" and rec.owner_uid == 0


@pytest.mark.parametrize(("over", "why"), [
    ({"info": "{"}, "info: "),
    ({"tensors": '{"a": 1}'}, "tensors: "),
    ({"owner_uid": "root"}, "owner_uid"),
    ({"state": "FROZEN"}, "is not its row's"),
    ({"id": "l2"}, "is not its row's"),
    ({"info": lease_row().info.replace('"chunk_size":4096', '"chunk_size":0')}, "chunk size 0"),
    ({"tensors": json.dumps([{"name": "w", "lease_id": "l9", "offset": 0, "shape": [1], "dtype": "uint8"}])},
     "other leases ['l9']"),
])
def test_a_malformed_lease_row_is_a_defect_that_says_why(over: dict, why: str) -> None:
    with pytest.raises(RowDefect, match=why.replace("[", r"\[").replace("]", r"\]")):
        LeaseRecord.from_row(lease_row(**over), NODE)


def test_a_lease_row_of_another_node_is_a_defect() -> None:
    with pytest.raises(RowDefect, match="node"):
        LeaseRecord.from_row(lease_row(), "node-2")


def gang_row(**over: object) -> SimpleNamespace:
    return SimpleNamespace(**gang_to_row(Gang("g", 2, {0: "a", 1: "b"}, {"l1": 1, "l2": 3}, 2), NODE) | over)


def test_a_gang_row_as_written_reads_back() -> None:
    assert gang_from_row(gang_row()) == Gang("g", 2, {0: "a", 1: "b"}, {"l1": 1, "l2": 3}, 2)


@pytest.mark.parametrize(("over", "why"), [
    ({"body": "[1]"}, "not an object"),
    ({"body": json.dumps({"owners": [], "epochs": {}})}, "owners"),
    ({"body": json.dumps({"owners": ["a", "a"], "epochs": {}})}, "twice"),
    ({"body": json.dumps({"owners": ["a"], "epochs": {"l1": "1"}})}, "epochs"),
    ({"body": json.dumps({"owners": ["a"], "epochs": {"l1": 0}})}, "below 1"),
    ({"generation": 0}, "generation"),
    ({"generation": 1.5}, "generation"),
])
def test_a_malformed_gang_row_is_a_defect_that_says_why(over: dict, why: str) -> None:
    with pytest.raises(RowDefect, match=why):
        gang_from_row(gang_row(**over))


def test_gangs_naming_leases_they_cannot_hold_are_set_aside_and_a_lease_set_aside_leaves_its_gang_broken() -> None:
    g = Gang("g", 1, {0: "a"}, {"l1": 1})
    rows = {"l1": LeaseRow(NODE, "a"), "l2": LeaseRow("node-2", "x"), "l3": LeaseRow(NODE, None)}
    gangs = [g, Gang("away", 1, {0: "x"}, {"l2": 1}), Gang("ghost", 1, {0: "y"}, {"l7": 1}),
             Gang("aside", 1, {0: "z"}, {"l3": 1})]
    why = gang_defects(gangs, rows, NODE)
    assert set(why) == {"away", "ghost"}  # "aside" names a lease set aside: loaded, broken (reconciler rule 6)
    assert "node-2" in why["away"] and "l7" in why["ghost"]


def test_of_two_gangs_naming_one_lease_the_one_whose_rank_holds_it_stays() -> None:
    rows = {"l1": LeaseRow(NODE, "b"), "l2": LeaseRow(NODE, "c")}
    first, rightful = Gang("a-gang", 1, {0: "x"}, {"l1": 1}), Gang("b-gang", 2, {0: "b", 1: "c"}, {"l1": 1, "l2": 1})
    assert gang_defects([first, rightful], rows, NODE) == {"a-gang": "lease l1 is gang b-gang's"}
    other = Gang("c-gang", 1, {0: "y"}, {"l2": 1})  # a rank of b-gang holds l2: c-gang goes
    assert gang_defects([rightful, other], rows, NODE) == {"c-gang": "lease l2 is gang b-gang's"}
