"""A tensor-parallel group's KV backups, the pure parts: when the ranks restore their caches from their backups at
start-up (kv_backup.py `group_restores`), and when a successor group registers its gang anew (tp_group.py
`outside_gang`). The group itself, end to end: tests/e2e/test_tp_kv_backup_incident.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engines.batched.kv_backup import group_restores
from engines.batched.tp_group import outside_gang

HANDED, LOST = True, False
BACKED, NONE = True, False


@pytest.mark.parametrize(("ranks", "restores"), [
    ([(LOST, BACKED)], True),  # one rank: its cache lost, its backup there
    ([(HANDED, BACKED)], False),  # the cache is the better copy
    ([(LOST, NONE)], False),  # nothing to restore from: a new cache, the router's replay
    ([(LOST, BACKED), (LOST, BACKED)], True),  # the group's GPU memory lost
    ([(HANDED, BACKED), (LOST, BACKED)], True),  # one rank's: every rank restores (rank 0's rows say where)
    ([(HANDED, BACKED), (HANDED, BACKED)], False),
    ([(LOST, BACKED), (LOST, NONE)], False),  # a rank without its backup: no restore on any rank
])
def test_the_ranks_restore_together_when_any_cache_was_lost_and_every_rank_is_backed(
        ranks: list[tuple[bool, bool]], restores: bool) -> None:
    assert group_restores(ranks) is restores


def test_a_successor_rank_that_leased_a_new_cache_holds_a_lease_outside_the_gang_it_took_over() -> None:
    gang = SimpleNamespace(epochs={"w": 2, "bk": 2})
    assert not outside_gang(SimpleNamespace(last_gang=gang, leases={"w": 1, "bk": 1}))  # all handed on
    assert outside_gang(SimpleNamespace(last_gang=gang, leases={"w": 1, "bk": 1, "kv-new": 1}))
    assert not outside_gang(SimpleNamespace(last_gang=None, leases={"w": 1, "kv": 1}))  # cold: registers anyway
