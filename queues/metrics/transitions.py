"""The store's observer: it counts the transitions this process makes, as the store makes them
(every post, claim, re-queue and end passes through it once it is on disk), so no handler,
consumer or sweep carries a metric call of its own."""

from collections.abc import Sequence

from ..store import Item
from .families import CANCELED, FAILED, FINISHED, ITEM_RUN, ITEM_WAIT, POSTED, REQUEUED, RETRIED


class TransitionCounter:
    def items_posted(self, queue: str, items: Sequence[Item]) -> None:
        retries = sum(item.retry_of is not None for item in items)
        if retries:
            RETRIED.inc(retries)
        if len(items) > retries:
            POSTED.inc(len(items) - retries)

    def items_claimed(self, queue: str, items: Sequence[Item]) -> None:
        for item in items:
            if item.attempts == 1 and item.claimed_at is not None:
                ready_at = max(item.posted_at, item.run_at or item.posted_at)
                ITEM_WAIT.observe(max(0.0, item.claimed_at - ready_at))

    def item_requeued(self, queue: str, item: Item, reason: str) -> None:
        REQUEUED.labels(reason).inc()

    def items_ended(self, queue: str, items: Sequence[Item]) -> None:
        for item in items:
            if item.status == "finished":
                FINISHED.inc()
                if item.claimed_at is not None and item.finished_at is not None:
                    ITEM_RUN.observe(max(0.0, item.finished_at - item.claimed_at))
            else:
                FAILED.labels(item.error or "unknown").inc()
                if item.error == "canceled":
                    CANCELED.inc()


transition_counter = TransitionCounter()
