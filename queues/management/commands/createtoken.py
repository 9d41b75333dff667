from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db import transaction

from queues.management.one_line import OneLineErrors
from queues.models import ApiToken, Queue
from queues.services import validation_messages


class Command(OneLineErrors):
    help = (
        "Make an API token (to produce and work unless --produce, --work or --metrics is given); prints only "
        "the token. A name may be given to several tokens; --replace revokes the others of that name."
    )

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--queues", default="", help="Comma-separated queue names; none means every queue.")
        parser.add_argument("--produce", action="store_true", help="May post items and read them.")
        parser.add_argument("--work", action="store_true", help="May claim items and hand in results.")
        parser.add_argument("--metrics", action="store_true", help="May read /metrics (alone: nothing else).")
        parser.add_argument("--replace", action="store_true",
                            help="Revoke the tokens of this name and make a new one in their place.")

    def handle(self, *args, name, queues, produce, work, metrics, replace, **options):
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
        with transaction.atomic():
            others = ApiToken.objects.select_for_update().filter(name=name)
            revoked = others.delete()[0] if replace else 0
            kept = others.exists() and not replace
            token.save()
        existing = Queue.objects.filter(name__in=token.queues).values_list("name", flat=True)
        for unknown in sorted(set(token.queues) - set(existing)):
            self.stderr.write(f"no queue named {unknown!r} yet; the token may use it once it is made "
                              f"(python manage.py createqueue {unknown})")
        if revoked:
            self.stderr.write(f"revoked the old token {name!r}; requests with it are refused within a second")
        if kept:
            self.stderr.write(f"the token named {name!r} made before stays valid too; --replace would revoke it, "
                              f"python manage.py revoketoken {name} revokes all of that name")
        self.stdout.write(raw)
