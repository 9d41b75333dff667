"""The sweep: one pass applies every queue's timers and repairs what crashes left behind; and the
promotion of scheduled items that came due, which runs more often than the sweep."""

import logging
import threading
from collections.abc import Callable, Iterable

from .store import QueueConfig, Store

log = logging.getLogger(__name__)

PROMOTE_SECONDS = 0.25  # how often due items are looked for: well within a second of their runAt

class Sweeper:
    """Runs passes over every queue. Safe beside other sweepers: each change is a transition
    under the item's lock, and one another sweeper already made is simply skipped."""

    def __init__(self, store: Store, configs: Callable[[], Iterable[QueueConfig]]):
        self.store = store
        self.configs = configs
        self._queue_seconds: dict[str, int] = {}  # each queue's limit at the last pass

    def sweep_once(self) -> dict[str, dict[str, int]]:
        """One pass; returns what changed per queue (queues with no change are left out)."""
        changes = {}
        for config in self.configs():
            try:
                changed = self._sweep_queue(config)
            except Exception:  # one queue's trouble must not stop the others
                log.exception("sweep of queue %s failed", config.name)
                continue
            if any(changed.values()):
                changes[config.name] = changed
        return changes

    def _sweep_queue(self, config: QueueConfig) -> dict[str, int]:
        before = self._queue_seconds.get(config.name)
        if before is not None and config.queue_seconds < before:
            # lowered: the change's save marked what was scheduled then; this process may have
            # scheduled more under the old limit until it heard of it
            self.store.mark_timeouts(config=config)
        self._queue_seconds[config.name] = config.queue_seconds
        changes = self.store.sweep_queue(config=config)
        return {
            "promoted": len(changes.promoted),
            "repaired": len(changes.repaired),
            "failed": len(changes.failed),
            "requeued": len(changes.requeued),
            "deleted": len(changes.deleted),
            "tmpRemoved": changes.tmp_removed,
        }

    def run(self, *, interval: float, stop: threading.Event, report: Callable[[dict], None] | None = None) -> None:
        """A pass every `interval` seconds until `stop` is set."""
        while not stop.is_set():
            try:
                changes = self.sweep_once()
            except Exception:  # e.g. the database is down for a moment: try again next pass
                log.exception("sweep pass failed")
                changes = {}
            if changes and report:
                try:
                    report(changes)
                except Exception:  # its output was closed, say: the sweeping goes on
                    log.exception("could not report what a sweep pass changed")
            stop.wait(interval)


class Promoter:
    """Moves the scheduled items that came due to pending, a look every `interval` seconds, so an
    item is pending within a moment of its runAt whatever the sweep's interval. A look costs a
    directory listing or two a queue however many items wait for later."""

    def __init__(self, store: Store, configs: Callable[[], Iterable[QueueConfig]]):
        self.store = store
        self.configs = configs

    def promote_once(self) -> dict[str, int]:
        """One look at every queue; how many items each promoted (queues with none left out)."""
        promoted = {}
        for config in self.configs():
            try:
                count = len(self.store.promote_due(config=config))
            except Exception:  # one queue's trouble must not stop the others
                log.exception("promoting the due items of queue %s failed", config.name)
                continue
            if count:
                promoted[config.name] = count
        return promoted

    def run(self, *, interval: float, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.promote_once()
            except Exception:  # the database is down for a moment, say: try again next look
                log.exception("promoting due items failed")
            stop.wait(interval)
