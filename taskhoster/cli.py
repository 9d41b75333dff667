"""The `taskhoster` command.

    taskhoster post QUEUE [JSON] [--delay S | --run-at TIME] [--key KEY]
                                              post one item (or one JSON per line from stdin); prints ids
    taskhoster get QUEUE ID [--wait S]        print the item as JSON, after waiting up to S s for it to end
    taskhoster retry QUEUE ID                 post an ended item again; prints the new item
    taskhoster cancel QUEUE ID                end an item that has not ended; prints it
    taskhoster stats [QUEUE]                  print a queue (or every queue, one per line) as JSON
    taskhoster work QUEUE [--concurrency N] [--retry] -- CMD ARGS...
                                              run CMD per item: payload on stdin, result from stdout
    taskhoster --version                      print the client's version

The server and the token come from --url/--token or TASKHOSTER_URL/TASKHOSTER_TOKEN (the URL
defaults to http://127.0.0.1:8000). An error is
one line on stderr and exit status 1 (2 for a mistake in the command line itself).
"""

import argparse
import importlib.metadata
import json
import logging
import math
import os
import shutil
import sys

from .errors import TaskhosterError
from .jobs import decode
from .producer import Producer
from .program import CommandUnusable, ProgramHandler
from .worker import Worker

USAGE_ERROR = 2


class UsageError(TaskhosterError):
    """The command line is wrong."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (see: taskhoster --help)")


def _count(text: str) -> int:
    """A whole number of at least 1, for argparse."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return value


def _seconds(text: str) -> float:
    """A finite number of seconds, 0 or more, for argparse."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected seconds, 0 or more, not {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected seconds, more than 0, not {text!r}")
    return value


QUOTING_HINT = "a text payload is a JSON string, quoted for the shell too: taskhoster post QUEUE '\"hello\"'"


def parse_json(text: str, what: str):
    try:
        return decode(text)
    except ValueError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc} ({QUOTING_HINT})") from None


def _version() -> str:
    try:
        return importlib.metadata.version("taskhoster")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _print_json(value) -> None:
    print(json.dumps(value, separators=(", ", ": ")), flush=True)


def post(args) -> int:
    if args.json is not None:
        payloads = [parse_json(args.json, "the payload")]
    else:
        # every line is checked before anything is sent, so a bad line posts nothing
        payloads = [parse_json(line, f"line {number} of stdin")
                    for number, line in enumerate(sys.stdin.buffer, 1) if line.strip()]
    if args.key is not None and len(payloads) != 1:
        raise UsageError(f"--key names one item, and {len(payloads)} were given")
    keys = None if args.key is None else [args.key]
    with Producer(args.url, args.token) as producer:
        try:
            items = producer.post_many(args.queue, payloads, delay=args.delay, run_at=args.run_at, keys=keys)
        except TaskhosterError as exc:
            for item in getattr(exc, "posted", []):  # batches that did go in before the error
                print(item["id"])
            raise
    for item in items:
        print(item["id"])
    return 0


def get(args) -> int:
    with Producer(args.url, args.token) as producer:
        if args.wait:
            item = producer.wait(args.queue, args.id, timeout=args.wait, payload=args.payload)
        else:
            item = producer.get(args.queue, args.id, payload=args.payload)
    _print_json(item)
    return 0


def retry(args) -> int:
    with Producer(args.url, args.token) as producer:
        _print_json(producer.retry(args.queue, args.id))
    return 0


def cancel(args) -> int:
    with Producer(args.url, args.token) as producer:
        _print_json(producer.cancel(args.queue, args.id))
    return 0


def stats(args) -> int:
    with Producer(args.url, args.token) as producer:
        if args.queue is not None:
            _print_json(producer.stats(args.queue))
        else:
            for queue in producer.stats():
                _print_json(queue)
    return 0


def work(args) -> int:
    command = args.command
    if not command:
        raise UsageError("give the command to run after --, e.g. taskhoster work QUEUE -- ./handle.sh")
    if shutil.which(command[0]) is None:
        found = os.sep in command[0] and os.path.isfile(command[0])  # a path to a file that may not run
        raise UsageError(f"{command[0]} is not executable (chmod +x it)" if found else f"command not found: {command[0]}")
    queues = [name for name in args.queue.split(",") if name]
    try:
        worker = Worker(args.url, args.token, queues=queues, concurrency=args.concurrency, grace=args.grace,
                        on_error="retry" if args.retry else "result", retry_base=args.retry_base,
                        retry_cap=args.retry_cap)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="taskhoster: %(message)s")
    try:
        worker.run(ProgramHandler(command))
    except CommandUnusable as exc:
        print(f"taskhoster: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    # --url/--token are accepted before or after the subcommand
    server = _Parser(add_help=False)
    server.add_argument("--url", default=argparse.SUPPRESS, help="server URL (default: $TASKHOSTER_URL)")
    server.add_argument("--token", default=argparse.SUPPRESS, help="API token (default: $TASKHOSTER_TOKEN)")

    parser = _Parser(prog="taskhoster", parents=[server],
                     description="Post items to a Taskhoster server, read them, or work a queue.",
                     epilog="The server's URL defaults to http://127.0.0.1:8000. Each command has its own "
                            "--help, e.g. taskhoster work --help.")
    parser.add_argument("--version", action="version", version=f"taskhoster {_version()}")
    commands = parser.add_subparsers(dest="subcommand", required=True, parser_class=_Parser)

    p = commands.add_parser("post", parents=[server], help="post one item, or one JSON per line from stdin")
    p.add_argument("queue")
    p.add_argument("json", nargs="?", help="the payload; without it, one payload per line is read from stdin")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--delay", type=_seconds, metavar="S", help="schedule the items S seconds from now")
    when.add_argument("--run-at", metavar="TIME",
                      help="schedule the items for TIME, ISO-8601 with an offset (2026-12-24T18:00:00+01:00)")
    p.add_argument("--key", help="the item's idempotency key: posted again with it, the item is not made twice "
                                 "(its id is printed)")
    p.set_defaults(run=post)

    p = commands.add_parser("get", parents=[server], help="print an item")
    p.add_argument("queue")
    p.add_argument("id")
    p.add_argument("--wait", type=_seconds, metavar="S", help="wait up to S seconds for the item to finish or fail")
    p.add_argument("--payload", action="store_true", help="include the payload")
    p.set_defaults(run=get)

    p = commands.add_parser("retry", parents=[server], help="post a finished or failed item again, as a new item")
    p.add_argument("queue")
    p.add_argument("id")
    p.set_defaults(run=retry)

    p = commands.add_parser("cancel", parents=[server], help="end a scheduled, pending or processing item now")
    p.add_argument("queue")
    p.add_argument("id")
    p.set_defaults(run=cancel)

    p = commands.add_parser("stats", parents=[server], help="print a queue's settings and counts, or every queue's")
    p.add_argument("queue", nargs="?")
    p.set_defaults(run=stats)

    p = commands.add_parser(
        "work", parents=[server], help="run a command for each item of a queue",
        usage="taskhoster work QUEUE [--concurrency N] [--retry] -- CMD ARGS...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run CMD ARGS... once for each item claimed from QUEUE, until SIGTERM or Ctrl-C.\n\n"
                    "  stdin   the item's payload, as one line of JSON\n"
                    "  stdout  the item's result: it must be JSON (a bare word is not; print '\"ok\"')\n"
                    "  env     TASKHOSTER_ITEM_ID, TASKHOSTER_QUEUE, TASKHOSTER_ATTEMPTS, "
                    "TASKHOSTER_MAX_ATTEMPTS\n\n"
                    "A command that exits non-zero, or prints something that is not JSON, gives the item an "
                    "error result\n(or, with --retry, gives it back for another try).",
        epilog="example: taskhoster work shout -- tr a-z A-Z")
    p.add_argument("queue", help="the queue to work (several: a,b)")
    p.add_argument("--concurrency", type=_count, default=1, metavar="N", help="items at once (default 1)")
    p.add_argument("--retry", action="store_true",
                   help="when CMD fails, give the item back for another try after a backoff, while the "
                        "queue's maxAttempts allows (default: its error is the result)")
    p.add_argument("--retry-base", type=_positive_seconds, default=1.0, metavar="S",
                   help="the first retry waits up to S seconds, each next one up to twice as long (default 1)")
    p.add_argument("--retry-cap", type=_positive_seconds, default=600.0, metavar="S",
                   help="no retry waits more than S seconds (default 600)")
    p.add_argument("--grace", type=_seconds, default=30.0, metavar="S",
                   help="on SIGTERM, seconds to let running commands finish (default 30)")
    p.set_defaults(run=work, command=[])
    return parser


def _before_command(argv: list[str]) -> list[str]:
    """`work`'s own arguments: what comes before the `--` that starts the command to run."""
    if "work" in argv and "--" in argv[argv.index("work"):]:
        return argv[: argv.index("--", argv.index("work"))]
    return argv


def _after_command(argv: list[str]) -> list[str]:
    return argv[len(_before_command(argv)) + 1:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(_before_command(argv))
        if args.subcommand == "work":
            args.command = _after_command(argv)
        args.url = getattr(args, "url", None)
        args.token = getattr(args, "token", None)
        return args.run(args)
    except UsageError as exc:
        print(f"taskhoster: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except TaskhosterError as exc:
        print(f"taskhoster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader of our output went away (| head): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
