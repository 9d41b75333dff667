"""Where the server is and which token to show it: arguments first, then the environment."""

import os
from urllib.parse import urlsplit, urlunsplit

from .errors import TaskhosterError

URL_VARIABLE = "TASKHOSTER_URL"
TOKEN_VARIABLE = "TASKHOSTER_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8000"  # where `manage.py serve` listens unless told otherwise


def server_settings(url: str | None, token: str | None) -> tuple[str, str]:
    """The server's base URL (no trailing slash) and the token, from the arguments or else from
    TASKHOSTER_URL (default: the address `manage.py serve` listens on) and TASKHOSTER_TOKEN."""
    url = url or os.environ.get(URL_VARIABLE, "") or DEFAULT_URL
    token = token or os.environ.get(TOKEN_VARIABLE, "")
    if not token:
        raise TaskhosterError(f"no token: pass one or set {TOKEN_VARIABLE} "
                              "(make one on the server with: python manage.py createtoken NAME)")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TaskhosterError(f"the server URL must look like http://host:port, not {url!r}")
    return url.rstrip("/"), token


def auth_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def work_socket_url(url: str) -> str:
    """The /work WebSocket URL of a server given by its HTTP base URL."""
    parts = urlsplit(url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/work", "", ""))
