"""Taskhoster as the backend of Django's tasks framework (django.tasks, or the django-tasks
package before Django 6): `TaskhosterBackend` enqueues, `manage.py taskhoster_worker` (with
"taskhoster.django" in INSTALLED_APPS) runs. See docs/django.md."""

__all__ = ["ArgumentsNotJSON", "TaskhosterBackend"]


def __getattr__(name: str):
    # imported when asked for, not with the app: the framework's modules want settings configured
    if name == "TaskhosterBackend":
        from .backend import TaskhosterBackend

        return TaskhosterBackend
    if name == "ArgumentsNotJSON":
        from .payloads import ArgumentsNotJSON

        return ArgumentsNotJSON
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
