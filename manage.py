#!/usr/bin/env python
"""Django's command line. A start-up problem the user must fix (a setting, the secret key file, a
database that cannot be reached) is told in one line on stderr, with exit status 1, instead of a
traceback; `--traceback` shows the traceback."""
import os
import sys


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskhoster_site.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db import InterfaceError, OperationalError

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:  # its message says what to set
        return refuse(exc, str(exc))
    except (OperationalError, InterfaceError) as exc:  # cannot connect, or lost the connection
        return refuse(exc, f"Cannot use the database ({describe_database()}): {one_line(exc)}")
    return 0


def refuse(exc: Exception, message: str) -> int:
    if "--traceback" in sys.argv:
        raise exc
    print(f"Error: {message}", file=sys.stderr)
    return 1


def describe_database() -> str:
    """Which database DATABASE_URL names, without its password."""
    from django.db import connection

    config = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"DATABASE_URL: SQLite file {config['NAME']}"
    return f"DATABASE_URL: {connection.vendor} database {config['NAME']!r} on {config['HOST'] or 'localhost'}:{config['PORT'] or 'default port'}"


def one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())  # the drivers' messages may span several lines


if __name__ == "__main__":
    sys.exit(main())
