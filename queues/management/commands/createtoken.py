from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from queues.models import ApiToken
from queues.services import validation_messages


class Command(BaseCommand):
    help = (
        "Make an API token (to produce and work unless --produce, --work or --metrics is given); prints only the token."
    )

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--queues", default="", help="Comma-separated queue names; none means every queue.")
        parser.add_argument("--produce", action="store_true", help="May post items and read them.")
        parser.add_argument("--work", action="store_true", help="May claim items and hand in results.")
        parser.add_argument("--metrics", action="store_true", help="May read /metrics (alone: nothing else).")

    def handle(self, *args, name, queues, produce, work, metrics, **options):
        both = not (produce or work or metrics)
        token = ApiToken(
            name=name,
            can_produce=produce or both,
            can_work=work or both,
            can_read_metrics=metrics,
            queues=[q.strip() for q in queues.split(",") if q.strip()],
        )
        raw = token.set_new_value()
        try:
            token.full_clean()
        except ValidationError as exc:
            raise CommandError(validation_messages(exc)) from exc
        token.save()
        self.stdout.write(raw)
