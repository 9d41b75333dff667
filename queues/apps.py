from django.apps import AppConfig


class QueuesConfig(AppConfig):
    name = "queues"
    verbose_name = "Taskhoster"

    def ready(self):
        from . import host_hint

        host_hint.install()
