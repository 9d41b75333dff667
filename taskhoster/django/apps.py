from django.apps import AppConfig


class TaskhosterDjangoConfig(AppConfig):
    """Add "taskhoster.django" to INSTALLED_APPS for `manage.py taskhoster_worker`."""

    name = "taskhoster.django"
    label = "taskhoster_django"
    verbose_name = "Taskhoster tasks"

    def ready(self):
        # the framework's system checks (a backend's settings among them) and its logging of the
        # signals, which the django-tasks package registers only when "django_tasks" is installed
        from .framework import register_checks

        register_checks()
