from django.urls import path

from . import views

app_name = "dashboard"

urlpatterns = [
    path("", views.dashboard, name="index"),
    path("new-queue", views.create_queue, name="create_queue"),
    path("queues/<str:name>/", views.queue_items, name="queue"),
    path("queues/<str:name>/pause", views.set_paused, {"paused": True}, name="pause"),
    path("queues/<str:name>/resume", views.set_paused, {"paused": False}, name="resume"),
    path("queues/<str:name>/items/<str:item_id>/", views.item_detail, name="item"),
    path("queues/<str:name>/items/<str:item_id>/requeue", views.requeue_item, name="requeue"),
    path("queues/<str:name>/items/<str:item_id>/retry", views.retry_item, name="retry"),
    path("queues/<str:name>/items/<str:item_id>/cancel", views.cancel_item, name="cancel"),
]
