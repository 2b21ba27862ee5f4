"""`Backoff` (libs/common/backoff.py): the one retry-delay rule of the bus, the controller's campaign and the dev
stack's restarts."""

from libs.common.backoff import Backoff


def test_delays_double_from_the_first_up_to_the_cap() -> None:
    b = Backoff(first_s=0.2, max_s=2.0)
    assert [b.next_delay() for _ in range(7)] == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    assert b.failures == 7


def test_reset_starts_again_from_the_first_delay() -> None:
    b = Backoff(first_s=0.5, max_s=30.0)
    for _ in range(10):
        b.next_delay()
    b.reset()
    assert b.next_delay() == 0.5


def test_a_long_run_of_failures_stays_at_the_cap() -> None:
    b = Backoff(first_s=1.0, max_s=30.0, failures=10_000)
    assert b.next_delay() == 30.0


def test_jittered_delays_lie_below_the_plain_ones_and_never_pass_the_cap() -> None:
    plain, jittered = Backoff(first_s=0.05, max_s=2.0), Backoff(first_s=0.05, max_s=2.0, jitter=0.5)
    for _ in range(12):
        d, j = plain.next_delay(), jittered.next_delay()
        assert 0.5 * d <= j <= d <= 2.0
    drawn = {Backoff(first_s=1.0, max_s=1.0, jitter=0.5).next_delay() for _ in range(50)}
    assert len(drawn) > 1  # spread: clients of one restarted server do not knock at once
