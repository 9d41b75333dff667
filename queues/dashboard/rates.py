"""Items ended in the last 60 seconds, per queue.

The store counts ended items per clock minute. The live feed looks at those counts every second,
so the difference between now and the look of 60 s ago is what ended in the last 60 s, within
the second between two looks. Until the feed has looked for a minute (a page just opened, a
server just started), the figure is estimated from the current minute and the share of the
previous one that falls in the last 60 s.
"""

from collections import deque

WINDOW_SECONDS = 60.0
SLACK_SECONDS = 3.0  # a look this much older than the window still stands for the look of 60 s ago

Rows = list[dict]  # a queue's throughput as the snapshot shows it: {"minute", "finished", "failed"}, oldest first


def estimate(throughput: Rows, now: float) -> dict:
    """The last 60 s from per-minute counts alone: this minute, and the previous minute in
    proportion to the part of it that lies within the last 60 s."""
    if not throughput:
        return {"finished": 0, "failed": 0}
    current = throughput[-1]
    previous = throughput[-2] if len(throughput) > 1 else {"finished": 0, "failed": 0}
    share = 1 - (now % 60) / 60
    return {status: current[status] + round(previous[status] * share) for status in ("finished", "failed")}


class LastMinute:
    def __init__(self, window: float = WINDOW_SECONDS):
        self.window = window
        self._looks: deque[tuple[float, dict[str, dict[str, tuple[int, int]]]]] = deque()

    def update(self, now: float, throughput: dict[str, Rows]) -> dict[str, dict]:
        """Take this look at every queue's per-minute counts; what ended in the last 60 s, per queue."""
        counts = {queue: {row["minute"]: (row["finished"], row["failed"]) for row in rows}
                  for queue, rows in throughput.items()}
        self._looks.append((now, counts))
        while len(self._looks) > 1 and self._looks[1][0] <= now - self.window:
            self._looks.popleft()  # keep one look at least a window old: the one to compare with
        then, earlier = self._looks[0]
        if not now - self.window - SLACK_SECONDS <= then <= now - self.window:
            return {queue: estimate(rows, now) for queue, rows in throughput.items()}
        return {queue: _since(earlier.get(queue, {}), minutes) for queue, minutes in counts.items()}


def _since(earlier: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]]) -> dict:
    ended = [0, 0]
    for minute, counts in now.items():
        before = earlier.get(minute, (0, 0))
        for index in (0, 1):
            ended[index] += max(0, counts[index] - before[index])
    return {"finished": ended[0], "failed": ended[1]}
