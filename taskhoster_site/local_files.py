"""What the server keeps beside its code, outside the data directory: `var/`, the secret key file
and a SQLite database it makes. All owner-only whatever the umask; the key file written whole."""

import os
import secrets
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

SECRET_KEY_MIN_CHARS = 32  # ours have 67; anything this short is not a key we made


def make_owner_only_dir(path: Path) -> None:
    """Make `path` (mode 0700 whatever the umask) unless it exists; an existing one is left as is."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        return
    except OSError as exc:
        raise ImproperlyConfigured(
            f"Cannot make the directory {path} ({exc.strerror}): make its parent writable, "
            "or set TASKHOSTER_VAR_DIR to a writable directory."
        ) from exc
    path.chmod(0o700)  # mkdir's mode passes through the umask


def secret_key(path: Path) -> str:
    """The key kept in `path`, made there first if there is none. Of several processes starting
    at once, only the first to put its key in place wins, and the others read that key."""
    key = _read_key_file(path)
    if key is None:
        key = _make_key_file(path) or _read_key_file(path)
    if key is None or len(key) < SECRET_KEY_MIN_CHARS or not key.isprintable():
        raise ImproperlyConfigured(
            f"The secret key file {path} is empty or damaged: delete it to have a new key made, "
            "or set SECRET_KEY."
        )
    return key


def _read_key_file(path: Path) -> str | None:
    """The text of the key file, stripped; None if there is none; "" if it is not text."""
    try:
        return path.read_bytes().decode().strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        return ""
    except OSError as exc:
        raise ImproperlyConfigured(
            f"Cannot read the secret key file {path} ({exc.strerror}): fix it, or set SECRET_KEY."
        ) from exc


def _make_key_file(path: Path) -> str | None:
    """Put a new key in place at `path`, whole and flushed before any other process can see it;
    the key, or None if another process's key was there first."""
    key = secrets.token_urlsafe(50)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        _write_owner_only_file(temporary, key)
        os.link(temporary, path)  # unlike a rename, never replaces a key another process put there
        _fsync_dir(path.parent)
    except FileExistsError:
        return None
    except OSError as exc:
        raise ImproperlyConfigured(
            f"Cannot write the secret key file {path} ({exc.strerror}): free space or make "
            f"{path.parent} writable, or set SECRET_KEY."
        ) from exc
    finally:
        temporary.unlink(missing_ok=True)
    return key


def _write_owner_only_file(path: Path, text: str) -> None:
    """A new file at `path`, mode 0600 whatever the umask, with `text` flushed to the disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(fd, 0o600)
        handle.write(text)
        handle.flush()
        os.fsync(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_sqlite_file(name: str) -> None:
    """Make the SQLite database file, if it does not exist yet, empty and owner-only (0600
    whatever the umask) before Django connects: SQLite opens an empty file as a new database, and
    gives its journal files the database file's mode. A file that cannot be made is left for
    SQLite to report when it connects (manage.py tells it in one line, naming DATABASE_URL)."""
    if name in ("", ":memory:") or name.startswith("file:"):  # no file, or a URI SQLite opens itself
        return
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # there already, or its directory is missing or not writable
        return
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
