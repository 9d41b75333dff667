from django.contrib import admin, messages

from .models import ApiToken, Queue
from .services import delete_queue


@admin.register(Queue)
class QueueAdmin(admin.ModelAdmin):
    list_display = ("name", "lease_seconds", "queue_seconds", "retain_seconds", "retain_from", "paused")
    list_filter = ("paused", "retain_from")
    search_fields = ("name",)

    def get_readonly_fields(self, request, obj=None):
        return ("name",) if obj else ()  # the name is the directory: renaming would orphan items

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        from .runtime import get_store

        get_store().ensure_queue(obj.name)

    def delete_model(self, request, obj):
        delete_queue(obj)

    def delete_queryset(self, request, queryset):
        for queue in queryset:
            delete_queue(queue)


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "can_produce", "can_work", "queue_list", "created_at", "last_used_at")
    readonly_fields = ("created_at", "last_used_at")
    fields = ("name", "can_produce", "can_work", "queues", "created_at", "last_used_at")

    @admin.display(description="queues")
    def queue_list(self, obj):
        return ", ".join(obj.queues) or "all"

    def save_model(self, request, obj, form, change):
        if not change:
            raw = obj.set_new_value()
            messages.warning(
                request,
                f"The token's value is {raw} . Copy it now: it is shown only this once.",
            )
        super().save_model(request, obj, form, change)
