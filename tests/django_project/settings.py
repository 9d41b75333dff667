"""The Django project of tests/test_django_tasks.py: tasks in `shop`, run through Taskhoster
(TASKHOSTER_URL and TASKHOSTER_TOKEN name the server). It runs on Django 5.2 with the django-tasks
package and on Django 6 with django.tasks alike."""

import os

SECRET_KEY = "only-for-tests"
USE_TZ = True
INSTALLED_APPS = ["taskhoster.django", "shop"]
# the worker's tasks that use the database find it here (cases.py gives it a file of its own)
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ.get("SHOP_DB", "shop.sqlite3")}}
TASKS = {
    "default": {
        "BACKEND": "taskhoster.django.TaskhosterBackend",
        # the worker of these tests works "default"; nobody works "idle", so its items stay put;
        # the server has no "missing"
        "QUEUES": ["default", "idle", "missing"],
        "OPTIONS": {"max_attempts": 2, "retry_base": 0.05, "retry_cap": 0.1},
    }
}
