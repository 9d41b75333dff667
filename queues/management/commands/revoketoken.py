from django.core.management.base import CommandError

from queues.management.one_line import OneLineErrors
from queues.models import ApiToken


class Command(OneLineErrors):
    help = "Revoke (delete) the API tokens of this name: requests with them are refused within a second."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, *args, name, **options):
        revoked, _ = ApiToken.objects.filter(name=name).delete()
        if not revoked:
            raise CommandError(f"no token named {name!r} (python manage.py listtokens shows them)")
        self.stderr.write(f"revoked {revoked} token{'s' if revoked > 1 else ''} named {name!r}")
