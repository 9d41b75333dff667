"""A request by a host name outside ALLOWED_HOSTS is answered 400 by Django; the log line that
says so should also say how to allow the name, since the setting is read from the environment."""

import logging

from django.conf import settings


class AllowedHostsHint(logging.Filter):
    """Adds to Django's DisallowedHost log line the environment variable to set."""

    def filter(self, record: logging.LogRecord) -> bool:
        allowed = ",".join(settings.ALLOWED_HOSTS)
        record.msg = (
            f"{record.getMessage()} Taskhoster reads it from the environment: restart with "
            f"ALLOWED_HOSTS={allowed},<that name>."
        )
        record.args = ()
        return True


def install() -> None:
    logging.getLogger("django.security.DisallowedHost").addFilter(AllowedHostsHint())
