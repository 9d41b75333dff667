import json
import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import close_old_connections

from queues.models import Queue
from queues.runtime import get_registry, get_store
from queues.sweep import PROMOTE_SECONDS, Promoter, Sweeper


def queue_configs():
    # a connection the database dropped (a restart, say) is replaced, not failed on for good
    close_old_connections()
    try:
        return [queue.config() for queue in Queue.objects.all()]
    finally:
        close_old_connections()


def cached_queue_configs():
    """For the promotion's frequent looks: read from the database at most once a second."""
    registry = get_registry()
    registry.refresh()
    return registry.queues()


class Command(BaseCommand):
    help = (
        "Apply every queue's timers: move scheduled items that came due to pending, re-queue lapsed "
        "leases, fail aged items, delete retained ones. Several sweepers may run at once."
    )

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="Run one pass and exit.")

    def handle(self, *args, once=False, **options):
        sweeper = Sweeper(get_store(), queue_configs)
        report = lambda changes: self.stdout.write(json.dumps(changes, sort_keys=True))  # noqa: E731
        if once:
            report(sweeper.sweep_once())
            return
        queue_configs()  # a database that cannot be reached at start is one line, not a traceback a pass
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        promoting = threading.Thread(
            target=Promoter(get_store(), cached_queue_configs).run,
            kwargs={"interval": PROMOTE_SECONDS, "stop": stop},
            name="promote",
            daemon=True,
        )
        promoting.start()
        sweeper.run(interval=settings.TASKHOSTER_SWEEP_INTERVAL, stop=stop, report=report)
        promoting.join()
