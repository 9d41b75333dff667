from django.apps import AppConfig


class TaskhosterDjangoConfig(AppConfig):
    """Add "taskhoster.django" to INSTALLED_APPS for `manage.py taskhoster_worker`."""

    name = "taskhoster.django"
    label = "taskhoster_django"
    verbose_name = "Taskhoster tasks"
