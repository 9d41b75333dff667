"""Django's development server (daphne's, as Channels installs it), with Taskhoster's sweep
running beside it as under `serve`: without the sweep, lapsed leases, aged items and retention
would wait for good.

Under the autoreloader the server runs in a thread of a child process, without signal handlers,
so a Ctrl-C, a SIGTERM or a reload would end the child with the items its sockets hold still
processing until their leases lapse. Here the child takes the first stop signal (and ignores the
rest: Ctrl-C reaches both processes, and the parent passes its signals on) by stopping the reactor,
so its sockets give back what they hold, untried; and the parent waits for the child rather than
kill it, as Django's own reloader does."""

import os
import signal
import subprocess
import sys
import threading

import daphne.server  # first: installs Twisted's asyncio reactor
from daphne.management.commands.runserver import Command as DaphneRunserver
from django.utils import autoreload
from twisted.internet import reactor

from queues.runtime import TRANSITIONS_END_SECONDS, server_stopping
from queues.serving import start_sweeper
from queues.serving.limits import finish_leftover_tasks

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# what the server's thread gets to give back what its sockets hold: changes under way end within
# TRANSITIONS_END_SECONDS, twice at most (a cut request's, then the stop's own wait)
STOP_SECONDS = 2 * TRANSITIONS_END_SECONDS + 5
RELOAD_EXIT = 3  # the child's exit status that asks for a new child (Django's)


class _Stop(BaseException):
    """A stop signal came to the reloader's child (not an Exception: the reloader swallows those
    while it starts)."""


class Command(DaphneRunserver):
    help = (
        "Django's development server, with Taskhoster's sweep running beside it. "
        "`manage.py serve` is the server to run for real."
    )

    def run(self, **options):
        if not options["use_reloader"]:
            self.inner_run(None, **options)
        elif os.environ.get(autoreload.DJANGO_AUTORELOAD_ENV) == "true":
            self._serve_beside_the_reloader(options)
        else:
            sys.exit(_restart_while_reloading())

    def _serve_beside_the_reloader(self, options) -> None:
        def stopping(sig, frame):
            _ignore_stop_signals()
            raise _Stop

        for sig in STOP_SIGNALS:
            signal.signal(sig, stopping)
        reloader = autoreload.get_reloader()
        autoreload.logger.info("Watching for file changes with %s", type(reloader).__name__)
        try:
            autoreload.start_django(reloader, self.inner_run, **options)
        except _Stop:
            pass
        finally:  # stopped, or a reload (which exits RELOAD_EXIT)
            _ignore_stop_signals()  # this stop is under way
            server = next((t for t in threading.enumerate() if t.name == "django-main-thread"), None)
            if server is not None and reactor.running:
                reactor.callFromThread(reactor.stop)
                server.join(STOP_SECONDS)

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


def _ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _restart_while_reloading() -> int:
    """Django's reloader loop: the server in a child process, made again each time it exits
    RELOAD_EXIT; a stop signal is passed on to the child (one that comes before the child is
    made stops the loop there), whose exit status is returned."""
    environ = {**os.environ, autoreload.DJANGO_AUTORELOAD_ENV: "true"}
    child: list[subprocess.Popen] = []  # the one running
    asked: list[int] = []

    def pass_on(sig, frame):
        asked.append(sig)
        if child and child[0].poll() is None:
            child[0].send_signal(sig)

    for sig in STOP_SIGNALS:
        signal.signal(sig, pass_on)
    while not asked:
        child[:] = [subprocess.Popen(autoreload.get_child_arguments(), env=environ, close_fds=False)]
        if asked:  # came while the child was being made
            child[0].send_signal(asked[0])
        status = child[0].wait()
        if status != RELOAD_EXIT:
            return status
    return 0
