"""Taskhoster settings, read from the environment (and an optional `.env` beside manage.py).

Every setting is read here and only here; the defaults make a single process run with no other
service: SQLite, the in-memory channel layer and a data directory under `var/`. What the server
makes outside the data directory (`var/`, the key file, a SQLite database) is owner-only.
"""

import hashlib
import os
import secrets
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

# What the server keeps outside the data directory: the secret key, the SQLite database, the data
# directory itself, unless they are set elsewhere. TASKHOSTER_VAR_DIR moves it all at once (a
# fresh installation per test, or a checkout that must stay read-only); the default is as ever.
VAR_DIR = Path(env.str("TASKHOSTER_VAR_DIR", default=str(BASE_DIR / "var")))
SECRET_KEY_MIN_CHARS = 32  # ours have 67; anything this short is not a key we made


def _make_owner_only_dir(path: Path) -> None:
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


def _var_dir_is_used() -> bool:
    """Whether anything defaults into VAR_DIR: the key file, the SQLite database or the data directory."""
    return not all(env.str(name, default="") for name in ("SECRET_KEY", "DATABASE_URL", "TASKHOSTER_DATA_DIR"))


def _secret_key() -> str:
    """SECRET_KEY from the environment, else one made on first start and kept owner-only."""
    if env.str("SECRET_KEY", default=""):
        return env.str("SECRET_KEY")
    return secret_key_from_file(VAR_DIR / "secret_key")


def secret_key_from_file(path: Path) -> str:
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


def _make_sqlite_file_owner_only(name: str) -> None:
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


if _var_dir_is_used():  # before anything is made in it, by us or by the store
    _make_owner_only_dir(VAR_DIR)

SECRET_KEY = _secret_key()
DEBUG = env.bool("DEBUG", default=False)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])

TASKHOSTER_DATA_DIR = Path(env.str("TASKHOSTER_DATA_DIR", default=str(VAR_DIR / "data")))
TASKHOSTER_SWEEP_INTERVAL = env.float("TASKHOSTER_SWEEP_INTERVAL", default=1.0)
TASKHOSTER_FSYNC = env.bool("TASKHOSTER_FSYNC", default=True)
TASKHOSTER_MAX_PAYLOAD_BYTES = env.int("TASKHOSTER_MAX_PAYLOAD_BYTES", default=1 << 20)
TASKHOSTER_MAX_BODY_BYTES = env.int("TASKHOSTER_MAX_BODY_BYTES", default=16 << 20)
# unset: 64 MiB, but at most 5% of the data directory's file system (queues/store/transitions.py)
TASKHOSTER_MIN_FREE_BYTES = env.int("TASKHOSTER_MIN_FREE_BYTES", default=None)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "queues",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "taskhoster_site.urls"
ASGI_APPLICATION = "taskhoster_site.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # several server processes share one SQLite file: wait for a writer instead of failing, and
    # take the write lock when a transaction begins (a deferred one fails at once on contention)
    DATABASES["default"].setdefault("OPTIONS", {}).update(timeout=20, transaction_mode="IMMEDIATE")
    _make_sqlite_file_owner_only(str(DATABASES["default"]["NAME"]))

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
LOGIN_URL = "admin:login"

# The channel layer only carries wake-ups between server processes (queues/bridge.py): hints a
# waiter can afford to lose, since it re-checks the disk every second anyway. So with Redis we
# take RedisPubSubChannelLayer: it measured faster here (~1,460 against ~800 msg/s) and has no
# per-channel capacity, where RedisChannelLayer silently drops what is over it (100 by default).
# Without Redis there is one process, and the in-memory layer is enough.
if env.str("REDIS_URL", default=""):
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
            # pub/sub ignores Redis database numbers: a prefix per data directory keeps two
            # installations on one Redis from waking each other
            "CONFIG": {
                "hosts": [env.str("REDIS_URL")],
                "prefix": "taskhoster-" + hashlib.sha256(str(TASKHOSTER_DATA_DIR.resolve()).encode()).hexdigest()[:12],
            },
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="WARNING")},
}
