"""The /work sockets open on this server process, by the queues each has claimed from (a
worker socket is not bound to one queue: it counts for every queue it asked for items)."""

import threading
from collections import Counter


class ConnectedWorkers:
    def __init__(self):
        self._queues: dict[object, set[str]] = {}  # socket -> queues it claimed from
        self._lock = threading.Lock()

    def claims_from(self, socket: object, queue: str) -> None:
        with self._lock:
            self._queues.setdefault(socket, set()).add(queue)

    def gone(self, socket: object) -> None:
        with self._lock:
            self._queues.pop(socket, None)

    def by_queue(self) -> Counter:
        with self._lock:
            return Counter(queue for queues in self._queues.values() for queue in queues)


connected_workers = ConnectedWorkers()
