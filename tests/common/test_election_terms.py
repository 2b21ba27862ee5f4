"""A leader that steps down and campaigns again gets a new term: writes fenced by the old term never land."""

from __future__ import annotations

from libs.common.store import LeaderElection, Store


async def _fenced_put(store: Store, fence: list[object], key: str) -> bool:
    t = store.client.transactions
    ok, _ = await store.client.transaction(compare=fence, success=[t.put(store.full(key), b"x")], failure=[])
    return bool(ok)


async def test_a_write_fenced_by_an_earlier_term_of_the_same_candidate_fails(store: Store) -> None:
    election = LeaderElection(store, "terms", "me", ttl=2)
    await election.campaign()
    first = election.fence(store.client.transactions)
    assert await _fenced_put(store, first, "w/1")
    await election.resign()
    assert not await _fenced_put(store, first, "w/2")  # no leader key: nothing lands
    await election.campaign()  # the same candidate leads again
    try:
        assert election.term > 0
        assert not await _fenced_put(store, first, "w/3")  # the old term's fence still fails
        assert await _fenced_put(store, election.fence(store.client.transactions), "w/4")
    finally:
        await election.resign()


async def test_a_stale_key_of_this_candidate_is_replaced_by_a_fresh_term(store: Store) -> None:
    stale = await store.grant(30)  # an earlier term's key, its lease alive but refreshed by no one
    await store.put("leader/stale", b"me", lease=stale)
    election = LeaderElection(store, "stale", "me", ttl=2)
    await election.campaign()
    try:
        found = await store.client.get(store.full("leader/stale"))
        assert found is not None and found.lease == election.lease.id  # type: ignore[union-attr]
    finally:
        await election.resign()
        await store.revoke(stale)
