import os

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "shop"

    def ready(self):
        # the signals the worker fires, one line each in SIGNAL_LOG, for the tests to read
        if os.environ.get("SIGNAL_LOG"):
            from . import signal_log  # noqa: F401
