import json
import signal
import threading

from django.core.management.base import BaseCommand

from queues.models import Queue
from queues.runtime import get_store
from queues.sweep import Sweeper


def queue_configs():
    return [queue.config() for queue in Queue.objects.all()]


class Command(BaseCommand):
    help = "Apply every queue's timers: re-queue lapsed leases, fail aged items, delete retained ones."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="Run one pass and exit.")

    def handle(self, *args, once=False, **options):
        from django.conf import settings

        sweeper = Sweeper(get_store(), queue_configs)
        report = lambda changes: self.stdout.write(json.dumps(changes, sort_keys=True))  # noqa: E731
        if once:
            report(sweeper.sweep_once())
            return
        queue_configs()  # a database that cannot be reached at start is one line, not a traceback a pass
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        sweeper.run(interval=settings.TASKHOSTER_SWEEP_INTERVAL, stop=stop, report=report)
