"""Taskhoster settings, read from the environment (and an optional `.env` beside manage.py).

Every setting is read here and only here, and each is described for users in docs/settings.md
(change both together). The defaults make a single process run with no other service: SQLite,
the in-memory channel layer and a data directory under `var/`. What the server makes outside the
data directory (`var/`, the key file, a SQLite database) is owner-only.
"""

import hashlib
import math
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from taskhoster_site import local_files, logs

BASE_DIR = Path(__file__).resolve().parent.parent

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

# What the server keeps outside the data directory: the secret key, the SQLite database, the data
# directory itself, unless they are set elsewhere. TASKHOSTER_VAR_DIR moves it all at once (a
# fresh installation per test, or a checkout that must stay read-only); the default is as ever.
VAR_DIR = Path(env.str("TASKHOSTER_VAR_DIR", default=str(BASE_DIR / "var")))


def _var_dir_is_used() -> bool:
    """Whether anything defaults into VAR_DIR: the key file, the SQLite database or the data directory."""
    return not all(env.str(name, default="") for name in ("SECRET_KEY", "DATABASE_URL", "TASKHOSTER_DATA_DIR"))


def _secret_key() -> str:
    """SECRET_KEY from the environment, else one made on first start and kept owner-only."""
    if env.str("SECRET_KEY", default=""):
        return env.str("SECRET_KEY")
    return local_files.secret_key(VAR_DIR / "secret_key")


if _var_dir_is_used():  # before anything is made in it, by us or by the store
    local_files.make_owner_only_dir(VAR_DIR)

SECRET_KEY = _secret_key()
DEBUG = env.bool("DEBUG", default=False)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])


def _proxy_ssl_header() -> tuple[str, str] | None:
    """SECURE_PROXY_SSL_HEADER as `HTTP_X_FORWARDED_PROTO,https`: the header (as Django names
    it in META) and the value that says the client's connection to the proxy was HTTPS."""
    raw = env.str("SECURE_PROXY_SSL_HEADER", default="")
    if not raw:
        return None
    name, _, value = (part.strip() for part in raw.partition(","))
    if not name.startswith("HTTP_") or not value:
        raise ImproperlyConfigured(
            "Set SECURE_PROXY_SSL_HEADER to the header's META name and its HTTPS value, e.g. HTTP_X_FORWARDED_PROTO,https"
        )
    return name, value


# HTTPS behind a proxy (docs/deployment.md): Django's own settings, by their own names
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
SECURE_PROXY_SSL_HEADER = _proxy_ssl_header()
SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=False)
CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=False)
# messages kept in the session, not in a cookie: the admin shows a new token's value in one, and
# a cookie is only signed, not encrypted, and goes through whatever logs cookies on the way
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=0)

TASKHOSTER_DATA_DIR = Path(env.str("TASKHOSTER_DATA_DIR", default=str(VAR_DIR / "data")))
TASKHOSTER_SWEEP_INTERVAL = env.float("TASKHOSTER_SWEEP_INTERVAL", default=1.0)
TASKHOSTER_FSYNC = env.bool("TASKHOSTER_FSYNC", default=True)
TASKHOSTER_MAX_PAYLOAD_BYTES = env.int("TASKHOSTER_MAX_PAYLOAD_BYTES", default=1 << 20)
TASKHOSTER_MAX_BODY_BYTES = env.int("TASKHOSTER_MAX_BODY_BYTES", default=16 << 20)
# on SIGTERM, how long requests in flight may go on before they are cut (a second signal: none)
_grace = env.str("TASKHOSTER_STOP_GRACE_SECONDS", default="3")
try:
    TASKHOSTER_STOP_GRACE_SECONDS = float(_grace)
except ValueError:
    TASKHOSTER_STOP_GRACE_SECONDS = math.nan
if not TASKHOSTER_STOP_GRACE_SECONDS >= 0:  # NaN too
    raise ImproperlyConfigured(f"Set TASKHOSTER_STOP_GRACE_SECONDS to 0 or more seconds, not {_grace!r}.")
# unset: 64 MiB, but at most 5% of the data directory's file system (queues/store/transitions.py)
TASKHOSTER_MIN_FREE_BYTES = env.int("TASKHOSTER_MIN_FREE_BYTES", default=None)

INSTALLED_APPS = [
    "queues",  # first: its `runserver` (daphne's, with the sweep beside it) wins over daphne's own
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
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
        # inside the package, so an installed wheel has them too; before the apps' own, so
        # admin/base_site.html here brands the admin
        "DIRS": [Path(__file__).resolve().parent / "templates"],
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
    local_files.make_sqlite_file(str(DATABASES["default"]["NAME"]))

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
# take RedisPubSubChannelLayer: it carries more messages a second and has no per-channel
# capacity, where RedisChannelLayer silently drops what is over it (100 by default).
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

TASKHOSTER_LOG_LEVEL = env.str("TASKHOSTER_LOG_LEVEL", default="INFO").upper()
if TASKHOSTER_LOG_LEVEL not in LOG_LEVELS:
    raise ImproperlyConfigured(f"Set TASKHOSTER_LOG_LEVEL to one of {', '.join(LOG_LEVELS)}, not {TASKHOSTER_LOG_LEVEL!r}.")
TASKHOSTER_LOG_FORMAT = env.str("TASKHOSTER_LOG_FORMAT", default="text").lower()
if TASKHOSTER_LOG_FORMAT not in LOG_FORMATS:
    raise ImproperlyConfigured(f"Set TASKHOSTER_LOG_FORMAT to text or json, not {TASKHOSTER_LOG_FORMAT!r}.")
LOGGING = logs.logging_config(TASKHOSTER_LOG_LEVEL, TASKHOSTER_LOG_FORMAT)
