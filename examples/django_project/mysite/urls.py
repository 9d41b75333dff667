from django.urls import path

from shop import views

urlpatterns = [
    path("welcome/", views.welcome),
    path("tasks/<str:result_id>/", views.task_status),
]
