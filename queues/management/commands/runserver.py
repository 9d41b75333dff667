"""Django's development server (daphne's, as Channels installs it), with Taskhoster's sweep
running beside it as under `serve`: without the sweep, lapsed leases, aged items and retention
would wait for good."""

import threading

from daphne.management.commands.runserver import Command as DaphneRunserver

from queues.serving import start_sweeper


class Command(DaphneRunserver):
    help = (
        "Django's development server, with Taskhoster's sweep running beside it. "
        "`manage.py serve` is the server to run for real."
    )

    def inner_run(self, *args, **options):
        stop = threading.Event()
        sweeping = start_sweeper(stop)
        self.stdout.write("Taskhoster's sweep runs beside this development server; `manage.py serve` is the one "
                          "to run for real.")
        try:
            return super().inner_run(*args, **options)
        finally:
            stop.set()
            for thread in sweeping:
                thread.join(1.0)
