import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskhoster_site.settings")
django_application = get_asgi_application()

application = django_application
