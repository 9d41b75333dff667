"""What the dashboard counts as ended "in the last 60 s": the feed's looks at the per-minute
counts a minute apart, and an estimate until it has looked for a minute."""

from queues.dashboard.rates import LastMinute, estimate

MINUTE = 1_796_000_040.0  # a minute's start


def rows(*minutes: tuple[float, int, int]) -> list[dict]:
    return [{"minute": str(start), "finished": finished, "failed": failed} for start, finished, failed in minutes]


def test_a_burst_53_seconds_ago_in_the_previous_clock_minute_still_counts():
    last_minute = LastMinute()
    burst_at = MINUTE + 50  # 50 s into the minute; looks go on every second
    for second in range(0, 120):
        now = MINUTE + second
        ended = 30 if now >= burst_at else 0
        seen = last_minute.update(now, {"q": rows((MINUTE, ended, 0), (MINUTE + 60, 0, 0))})
    # the last look is at MINUTE + 119: the burst was 69 s ago; the look at MINUTE + 103 saw it 53 s after
    assert seen == {"q": {"finished": 0, "failed": 0}}

    last_minute = LastMinute()
    for second in range(0, 104):
        now = MINUTE + second
        ended = 30 if now >= burst_at else 0
        seen = last_minute.update(now, {"q": rows((MINUTE, ended, 0), (MINUTE + 60, 0, 0))})
    assert seen == {"q": {"finished": 30, "failed": 0}}  # 53 s later, in the next clock minute


def test_items_ended_in_several_minutes_are_added_up():
    last_minute = LastMinute()
    last_minute.update(MINUTE + 30, {"q": rows((MINUTE, 5, 1))})
    seen = last_minute.update(MINUTE + 90, {"q": rows((MINUTE, 8, 1), (MINUTE + 60, 4, 2))})

    assert seen == {"q": {"finished": 7, "failed": 2}}


def test_without_a_look_a_minute_old_the_figure_is_estimated_from_the_minutes():
    # 15 s into this minute: this minute's 4, and three quarters of the previous minute's 8
    assert estimate(rows((MINUTE, 8, 0), (MINUTE + 60, 4, 2)), MINUTE + 75) == {"finished": 10, "failed": 2}
    assert LastMinute().update(MINUTE + 75, {"q": rows((MINUTE, 8, 0), (MINUTE + 60, 4, 2))}) == {
        "q": {"finished": 10, "failed": 2}}
