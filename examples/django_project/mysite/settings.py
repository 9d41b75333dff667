"""A small Django project whose tasks run through Taskhoster (see docs/django.md)."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "change-me")
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
ROOT_URLCONF = "mysite.urls"
USE_TZ = True

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "taskhoster.django",  # brings `manage.py taskhoster_worker`
    "shop",
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3"}}

TASKS = {
    "default": {
        "BACKEND": "taskhoster.django.TaskhosterBackend",
        # the Taskhoster queues the tasks go to (a task's queue_name; "default" unless it says)
        "QUEUES": ["default"],
        "OPTIONS": {
            # where the server is and a token that may produce and work on these queues
            "url": os.environ.get("TASKHOSTER_URL", "http://127.0.0.1:8000"),
            "token": os.environ.get("TASKHOSTER_TOKEN"),
            # a task that raises runs up to 3 times, 1 s, 2 s, ... apart (with jitter)
            "max_attempts": 3,
            "retry_base": 1.0,
        },
    }
}
