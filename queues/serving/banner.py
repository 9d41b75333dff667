"""What `serve` tells the person who started it: where everything is, how to get in, and the
settings that would otherwise surprise them later."""

import os
import socket

from django.conf import settings

ANY_ADDRESS = ("0.0.0.0", "::", "")


def banner(*, host: str, port: int) -> str:
    """The lines printed once the server listens."""
    base = f"{_display_host(host)}:{port}"
    lines = [
        "Taskhoster is serving.",
        f"  dashboard  http://{base}/   (log in as staff; make an account with: python manage.py createsuperuser)",
        f"  admin      http://{base}/admin/",
        f"  API        http://{base}/api/schema   (every call, as an OpenAPI document)",
        f"  workers    ws://{base}/work",
        "Make a queue with: python manage.py createqueue NAME",
        "Make an API token with: python manage.py createtoken NAME [--queues a,b] [--produce] [--work] [--metrics]",
    ]
    if host in ANY_ADDRESS:
        lines.append(
            f"Listening on every address. Browsers reach the dashboard only by a name in ALLOWED_HOSTS "
            f"(now {','.join(settings.ALLOWED_HOSTS)}); to use this machine's name, start with "
            f"ALLOWED_HOSTS=localhost,127.0.0.1,{_display_host(host)}"
        )
    lines.append("Stop with Ctrl-C.")
    return "\n".join(lines)


def start_warnings(environ=os.environ) -> list[str]:
    """Settings that look like one thing and do another, said once at start."""
    warnings = []
    moved_items_only = not (environ.get("DATABASE_URL") or environ.get("TASKHOSTER_VAR_DIR"))
    if environ.get("TASKHOSTER_DATA_DIR") and moved_items_only:
        warnings.append(
            f"TASKHOSTER_DATA_DIR moves only the item files; the queues, tokens and accounts stay in the "
            f"database {settings.DATABASES['default']['NAME']}. For a separate installation set DATABASE_URL "
            f"too (or TASKHOSTER_VAR_DIR, which moves everything)."
        )
    return warnings


def busy_port_hint(port: int) -> str:
    """What to try when the port cannot be had: most often another server holds it."""
    return f"is another server using port {port}? Choose another with --port {port + 1}"


def _display_host(host: str) -> str:
    """The host as a browser should use it: this machine's name instead of "every address"."""
    if host in ANY_ADDRESS:
        host = socket.gethostname() or "localhost"
    return f"[{host}]" if ":" in host else host
