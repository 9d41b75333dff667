from django.core.management.base import BaseCommand

from queues.models import ApiToken


def describe(token: ApiToken) -> str:
    """One line: the name, its rights, its queues, when it was made and last used (never the value)."""
    given = (("produce", token.can_produce), ("work", token.can_work), ("metrics", token.can_read_metrics))
    rights = "+".join(right for right, has in given if has)
    queues = ",".join(token.queues) or "every queue"
    used = token.last_used_at.strftime("%Y-%m-%d %H:%M UTC") if token.last_used_at else "never"
    return f"{token.name}\t{rights}\t{queues}\tmade {token.created_at:%Y-%m-%d %H:%M UTC}\tlast used {used}"


class Command(BaseCommand):
    help = "List the API tokens, one a line: name, rights, queues, when made and last used. Values are never shown."

    def handle(self, *args, **options):
        for token in ApiToken.objects.order_by("name", "created_at"):
            self.stdout.write(describe(token))
