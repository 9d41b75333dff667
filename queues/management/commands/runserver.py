"""Django's development server (daphne's, as Channels installs it), with Taskhoster's sweep
running beside it as under `serve`: without the sweep, lapsed leases, aged items and retention
would wait for good."""

import threading

import daphne.server  # first: installs Twisted's asyncio reactor
from daphne.management.commands.runserver import Command as DaphneRunserver
from twisted.internet import reactor

from queues.runtime import server_stopping
from queues.serving import start_sweeper
from queues.serving.limits import finish_leftover_tasks


class Command(DaphneRunserver):
    help = (
        "Django's development server, with Taskhoster's sweep running beside it. "
        "`manage.py serve` is the server to run for real."
    )

    def inner_run(self, *args, **options):
        # as under serve: before daphne cancels every socket, so what they hold goes back untried
        reactor.addSystemEventTrigger("before", "shutdown", server_stopping.set)
        stop = threading.Event()
        sweeping = start_sweeper(stop)
        self.stdout.write("Taskhoster's sweep runs beside this development server; `manage.py serve` is the one "
                          "to run for real.")
        try:
            return super().inner_run(*args, **options)
        finally:
            finish_leftover_tasks(daphne.server.twisted_loop)  # as serve does: else SIGSEGV at exit
            stop.set()
            for thread in sweeping:
                thread.join(1.0)
