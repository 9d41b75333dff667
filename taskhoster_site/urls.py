from django.contrib import admin
from django.urls import include, path

from queues.metrics.views import metrics

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics, name="metrics"),
    path("", include("queues.dashboard.urls")),
]
