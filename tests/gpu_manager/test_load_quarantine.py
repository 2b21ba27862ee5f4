"""A malformed row in the gpu_manager's SQL tables is set aside at start-up, never the whole node's memory service:
a real manager SIGKILLed, its SQLite file given bad gang rows (not JSON, unknown leases, wrong types, a lease of
another node, a lease claimed twice) and a bad lease row, then restarted: it starts, serves every good lease and
gang (the gang is frozen whole), moves each bad row to the `quarantine` table with its reason, and logs it once."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.errors import RemoteError
from libs.common.events import FreezeGang, FreezeGangReply, ListLeases, ListLeasesReply
from tests.gpu_manager.harness import ManagerProc
from tests.gpu_manager.test_gang_restart import group_with_leases

BAD_GANGS = ("bad-json", "bad-ids", "bad-types", "bad-generation", "foreign", "twice")


def db_path(manager: ManagerProc) -> Path:
    return manager.state_dir / "gpu_manager.db"


def corrupt(path: Path, node: str, gang_lease: str, solo_lease: str) -> None:
    """The kinds of bad rows a hand edit, a bug of an older version or a torn disk could leave."""
    with sqlite3.connect(path) as db:
        foreign = db.execute("SELECT * FROM leases WHERE id = ?", (solo_lease,)).fetchone()
        cols = [c[1] for c in db.execute("PRAGMA table_info(leases)")]
        row = dict(zip(cols, foreign, strict=True)) | {"id": "lease-foreign", "node": "another-node"}
        db.execute(f"INSERT INTO leases ({','.join(row)}) VALUES ({','.join('?' * len(row))})", tuple(row.values()))
        bodies = {
            "bad-json": (1, "{not json"),
            "bad-ids": (1, json.dumps({"owners": ["x-r0"], "epochs": {"lease-nowhere": 1}})),
            "bad-types": (1, json.dumps({"owners": 7, "epochs": ["a"]})),
            "bad-generation": ("soon", json.dumps({"owners": ["y-r0"], "epochs": {}})),
            "foreign": (1, json.dumps({"owners": ["z-r0"], "epochs": {"lease-foreign": 1}})),
            "twice": (1, json.dumps({"owners": ["w-r0"], "epochs": {gang_lease: 1}})),  # a lease of gang "g"
        }
        for gang_id, (generation, body) in bodies.items():
            db.execute("INSERT INTO gangs (node, gang_id, generation, body) VALUES (?, ?, ?, ?)",
                       (node, gang_id, generation, body))
        db.execute("UPDATE leases SET tensors = '[{\"name\": ' WHERE id = ?", (solo_lease,))


def quarantined(path: Path) -> dict[str, str]:
    with sqlite3.connect(path) as db:
        return {f"{kind}:{key}": reason for kind, key, reason in db.execute("SELECT kind, key, reason FROM quarantine")}


async def test_a_manager_restarted_over_malformed_rows_sets_them_aside_and_serves_every_good_lease_and_gang(
        manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    group_with_leases(engines, manager)
    solo = engines(manager, "solo")
    solo_lease = solo.ask(f"write {1 << 20} 5 weights")["lease"]
    before = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
    gang_leases = sorted(i.id for i in before if i.owner != "solo")
    assert len(gang_leases) == 4
    manager.kill()
    corrupt(db_path(manager), settings.node, gang_leases[0], solo_lease)

    manager.start()  # the process lives and listens (harness: it raises if the manager exits)

    after = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
    assert sorted(i.id for i in after) == gang_leases  # every good lease, none of the bad or foreign rows
    frozen = await bus.request(settings.node, FreezeGang(gang_id="g"), FreezeGangReply)
    assert sorted(i.id for i in frozen.leases) == gang_leases  # the good gang, whole
    for gang_id in BAD_GANGS:
        with pytest.raises(RemoteError) as e:
            await bus.request(settings.node, FreezeGang(gang_id=gang_id), FreezeGangReply)
        assert e.value.remote_code == "not_found"

    aside = quarantined(db_path(manager))
    assert set(aside) == {f"gang:{g}" for g in BAD_GANGS} | {f"lease:{solo_lease}"}
    assert "lease-nowhere" in aside["gang:bad-ids"] and "another-node" in aside["gang:foreign"]
    assert "gang g" in aside["gang:twice"] and "generation" in aside["gang:bad-generation"]
    log = manager.log()
    for key in aside:
        assert f"quarantined {key.replace(':', ' ')}" in log
    with sqlite3.connect(db_path(manager)) as db:  # set aside durably: gone from the live tables
        marks = ",".join("?" * len(BAD_GANGS))
        assert not db.execute(f"SELECT 1 FROM gangs WHERE gang_id IN ({marks})", BAD_GANGS).fetchall()
        assert not db.execute("SELECT 1 FROM leases WHERE id = ?", (solo_lease,)).fetchall()
        assert db.execute("SELECT node FROM leases WHERE id = 'lease-foreign'").fetchone() == ("another-node",)

    manager.kill()
    manager.start()  # nothing left to set aside: the next start is clean
    assert "quarantined" not in manager.log()
    again = await bus.request(settings.node, FreezeGang(gang_id="g"), FreezeGangReply)
    assert again.transfer_token == frozen.transfer_token and quarantined(db_path(manager)) == aside
