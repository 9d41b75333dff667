import logging

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from ...framework import task_backends
from ...worker import DjangoWorker
from ....errors import TaskhosterError


class Command(BaseCommand):
    help = ("Run the tasks enqueued through a Taskhoster backend: claim them from its queues, run each, "
            "hand in what it returned or raised. Stops on SIGTERM or Ctrl-C (a second one: at once).")

    def add_arguments(self, parser):
        parser.add_argument("--backend", default="default", help="the alias in TASKS (default: default)")
        parser.add_argument("--queue-name", action="append", dest="queues", metavar="QUEUE",
                            help="work only this queue of the backend's (repeat for more; default: all)")
        parser.add_argument("--concurrency", type=int, help="tasks run at once (default: the backend's option)")

    def handle(self, *args, backend, queues, concurrency, verbosity, **options):
        from ...backend import TaskhosterBackend

        if concurrency is not None and concurrency < 1:
            raise CommandError("--concurrency must be at least 1")
        chosen = task_backends[backend]
        if not isinstance(chosen, TaskhosterBackend):
            raise CommandError(f"TASKS[{backend!r}] is {type(chosen).__name__}, not taskhoster.django.TaskhosterBackend")
        logging.basicConfig(level=logging.INFO if verbosity >= 1 else logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            worker = DjangoWorker(chosen, queues=queues, concurrency=concurrency)
            self.stdout.write(f"worker {worker.worker_id} on {', '.join(worker.queues)} at {chosen.settings.url}, "
                              f"{worker.concurrency} at once")
            self.stdout.flush()
            worker.run()
        except (ImproperlyConfigured, TaskhosterError) as exc:
            raise CommandError(str(exc)) from exc
