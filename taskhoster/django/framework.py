"""The tasks framework this Django has: its own `django.tasks` (Django 6 and later), or else the
`django-tasks` package that backports it to Django 4.2 ... 5.2. The rest of taskhoster.django
imports the framework from here only."""

from django.core.exceptions import ImproperlyConfigured

try:
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import DEFAULT_TASK_PRIORITY, Task, TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

    def register_checks() -> None:
        pass  # django.tasks registers its own
except ImportError:
    try:
        from django_tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import DEFAULT_TASK_PRIORITY, Task, TaskError
        from django_tasks.exceptions import InvalidTaskError as InvalidTask
        from django_tasks.exceptions import TaskResultDoesNotExist
        from django_tasks.signals import task_enqueued, task_finished, task_started
        from django_tasks.utils import normalize_json

        def register_checks() -> None:
            from django_tasks import checks, signals  # noqa: F401  (importing them registers them)
    except ImportError as exc:
        raise ImproperlyConfigured(
            "taskhoster.django needs a tasks framework: Django 6 has one (django.tasks); for Django 4.2 ... 5.2 "
            "install the django-tasks package (pip install 'taskhoster[django]')"
        ) from exc

__all__ = [
    "DEFAULT_TASK_PRIORITY",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "normalize_json",
    "register_checks",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
