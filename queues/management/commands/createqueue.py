import argparse
import json
import time

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from queues.exceptions import TaskhosterError
from queues.management.one_line import OneLineErrors
from queues.models import Queue
from queues.runtime import get_store
from queues.services import SETTING_FIELDS, describe_queue, save_queue, validation_messages

OPTION_NAMES = {"name": "name", **{field: "--" + field.replace("_", "-") for field in SETTING_FIELDS}}


UNSET = object()


def _max_attempts(text: str):
    """`none` (no limit) or a whole number, for argparse; its range is the model's to check."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'none', not {text!r}") from None


class Command(OneLineErrors):
    help = "Create a queue, or change only the given settings of an existing one; prints it as JSON."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--lease-seconds", type=int, help="1 to 86400")
        parser.add_argument("--queue-seconds", type=int, help="1 to 2592000 (30 days)")
        parser.add_argument("--retain-seconds", type=int, help="0 to 2592000 (30 days)")
        parser.add_argument("--retain-from", choices=["finished", "fetched"])
        paused = parser.add_mutually_exclusive_group()
        paused.add_argument("--paused", dest="paused", action="store_true", default=None)
        paused.add_argument("--unpaused", dest="paused", action="store_false")
        parser.add_argument("--max-attempts", type=_max_attempts, default=UNSET, metavar="N|none",
                            help="how often an item may be handed out, 1 to 1000; none: no limit (the default)")

    def handle(self, *args, name, **options):
        changes = {field: options[field] for field in SETTING_FIELDS if options.get(field) not in (None, UNSET)}
        if options["max_attempts"] is None:  # `none` given: no limit
            changes["max_attempts"] = None
        existed = Queue.objects.filter(name=name).exists()
        try:
            queue = save_queue(name, **changes)
        except ValidationError as exc:
            raise CommandError(validation_messages(exc, OPTION_NAMES)) from exc
        except TaskhosterError as exc:  # the data directory cannot be written
            raise CommandError(exc.message) from exc
        config = queue.config()
        counts = get_store().count_items(queue=config.name)
        self.stdout.write(json.dumps(describe_queue(config, counts, time.time())))
        # stdout stays the queue's JSON alone, for scripts; what happened is for the person
        self.stderr.write(f"{'updated' if existed else 'created'} queue {config.name}")
