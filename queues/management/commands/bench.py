import argparse
import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, DjangoHelpFormatter

from queues.bench.harness import (
    GROUPS, MEASURES, QUICK, BadSettings, BenchSettings, check, expand, run, settings_from,
)
from queues.bench.peers import PEERS
from queues.bench.report import KEYS
from queues.serving import SERVERS

FULL = BenchSettings()
FSYNC_MODES = {"on": (True,), "off": (False,), "both": (True, False)}


class _HelpFormatter(DjangoHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Django's order of options, and the description's and epilog's lines kept as written."""


def _numbers(option: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part.replace("_", "")) for part in text.split(","))
    except ValueError:
        raise CommandError(f"{option} takes whole numbers separated by commas, not {text!r}") from None


def _listed(numbers: tuple[int, ...]) -> str:
    return ",".join(map(str, numbers))


class Command(BaseCommand):
    help = (
        "Measure Taskhoster on its own throw-away servers (or --url) as users see it, through our\n"
        "Producer and Worker: single posts while 2 workers consume, end to end, round trips,\n"
        "concurrent producers, batches; beside it the server alone (a lean raw-socket producer),\n"
        "the disk's own flush, claims and a quiet sweep on big queues, scheduled and keyed items; with --peers,\n"
        "Celery and RQ on the same workload and concurrent producers. Prints one JSON line; progress and a\n"
        "summary go to stderr. client-cpu, the client library's own CPU per call, needs no server (it runs\n"
        "against stub servers of its own, with --url too)."
    )

    def create_parser(self, prog_name, subcommand, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        kwargs.setdefault("epilog", KEYS)
        return super().create_parser(prog_name, subcommand, **kwargs)

    def add_arguments(self, parser):
        parser.add_argument("--quick", action="store_true",
                            help=f"small sizes for CI ({QUICK.items} items, {QUICK.round_trips} round trips, "
                                 f"producers {_listed(QUICK.producers)}, pending sizes "
                                 f"{_listed(QUICK.pending_sizes)}); asserts no speed")
        parser.add_argument("--fsync", choices=FSYNC_MODES, default="both",
                            help="TASKHOSTER_FSYNC of the servers (default both)")
        parser.add_argument("--only", help=f"comma-separated, some of: {','.join(MEASURES)}; or "
                                           f"{' and '.join(GROUPS)} for all of theirs (default all); "
                                           f"client-cpu needs no server and runs with --url too")
        parser.add_argument("--peers", help=f"also run some of {','.join(PEERS)} on the users' workload and "
                                            "concurrent producers (what of client-end-to-end, client-round-trip "
                                            "and client-producers is selected), each on a Redis of its own in "
                                            "memory and with AOF appendfsync always (needs redis-server on PATH "
                                            "and pip install -e '.[bench]')")
        parser.add_argument("--items", type=int, help=f"items of the end-to-end runs (default {FULL.items})")
        parser.add_argument("--workers", type=int, help=f"worker processes, ours and the peers' (default {FULL.workers})")
        parser.add_argument("--batch", type=int, help=f"items per post in batches (default {FULL.batch})")
        parser.add_argument("--claim-batch", type=int,
                            help=f"most items per claim of a worker (default {FULL.claim_batch}; 1 with --peers)")
        parser.add_argument("--round-trips", type=int,
                            help=f"round trips timed one at a time (default {FULL.round_trips})")
        parser.add_argument("--producers",
                            help=f"threads of the concurrent producers, one run each (default {_listed(FULL.producers)})")
        parser.add_argument("--pending-sizes",
                            help=f"pending items to measure a claim at (default {_listed(FULL.pending_sizes)})")
        parser.add_argument("--scheduled-items", type=int,
                            help=f"scheduled items to measure a claim, a post and a sweep beside "
                                 f"(default {FULL.scheduled_items})")
        parser.add_argument("--due-together", type=int,
                            help=f"scheduled items coming due in the same second (default {FULL.due_together})")
        parser.add_argument("--keyed-items", type=int,
                            help=f"keyed items to measure a keyed post beside (default {FULL.keyed_items})")
        parser.add_argument("--post-seconds", type=float,
                            help=f"how long each kind of post runs (default {FULL.post_seconds:g})")
        parser.add_argument("--cpu-calls", type=int,
                            help=f"timed calls of each kind for client-cpu, after untimed ones (a tenth as "
                                 f"many, at least 100) (default {FULL.cpu_calls})")
        parser.add_argument("--flush-tries", type=int,
                            help=f"files made durable to time the disk's flush (default {FULL.flush_tries})")
        parser.add_argument("--server-claims", type=int,
                            help=f"claims served on the biggest queue (default {FULL.server_claims})")
        parser.add_argument("--server", choices=SERVERS,
                            help="serve's --server for the bench's own servers (default: serve's default)")
        parser.add_argument("--url", help="measure this server instead of starting our own (API measures only)")
        parser.add_argument("--token", help="with --url: a token that may produce and work")
        parser.add_argument("--post-queue", help=f"with --url: the queue posts go to (default {FULL.post_queue})")
        parser.add_argument("--work-queue", help=f"with --url: the queue the workers work (default {FULL.work_queue})")
        parser.add_argument("--profile", type=Path, metavar="DIR",
                            help="record each measurement's server with py-spy into DIR (needs py-spy on PATH)")

    def handle(self, *args, **options):
        only, peers = options.pop("only"), options.pop("peers")
        options["measures"] = expand(only.split(",")) if only else None
        options["peers"] = tuple(peers.split(",")) if peers else None
        for name, option in (("pending_sizes", "--pending-sizes"), ("producers", "--producers")):
            if options[name]:
                options[name] = _numbers(option, options[name])
        if options["peers"] and options["claim_batch"] is None:
            options["claim_batch"] = 1  # the peers' workers take one task at a time: so do ours beside them
        options["fsync"] = FSYNC_MODES[options["fsync"]]
        options["profile_dir"] = options.pop("profile")
        settings = settings_from(options)
        try:
            check(settings)
        except BadSettings as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(json.dumps(run(settings, self._say), separators=(",", ":")))

    def _say(self, message: str) -> None:
        self.stderr.write(message)
        self.stderr.flush()
