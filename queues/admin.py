import json

from django import forms
from django.contrib import admin, messages
from django.db import transaction
from django.http import HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html

from .dashboard.display import STATES, format_duration
from .exceptions import StorageUnavailable
from .models import ApiToken, Queue
from .runtime import get_registry, get_store
from .services import delete_queue, place_directory, save_queue, timeouts_lowered
from .store import Counts


@admin.register(Queue)
class QueueAdmin(admin.ModelAdmin):
    search_fields = ("name",)
    actions = ("pause_queues", "resume_queues")

    def get_list_display(self, request):
        counts = _CountsPerPage()  # each queue's directories are listed once per page
        return (
            "name",
            "state",
            *(counts.column(state) for state in STATES),
            counts.oldest_column(),
            "lease",
            "lifetime",
            "retention",
            "items_link",
        )

    @admin.display(description="state", ordering="paused")
    def state(self, obj):
        return "Paused" if obj.paused else "Running"

    @admin.display(description="lease", ordering="lease_seconds")
    def lease(self, obj):
        return format_duration(obj.lease_seconds)

    @admin.display(description="time-out", ordering="queue_seconds")
    def lifetime(self, obj):
        return format_duration(obj.queue_seconds)

    @admin.display(description="kept", ordering="retain_seconds")
    def retention(self, obj):
        start = "first fetch" if obj.retain_from == "fetched" else "end"
        return f"{format_duration(obj.retain_seconds)} from {start}"

    def get_readonly_fields(self, request, obj=None):
        # the name is the directory: renaming would orphan items
        return ("name", "items_now") if obj else ()

    @admin.display(description="items")
    def items_link(self, obj):
        return format_html('<a href="{}">Items</a>', reverse("dashboard:queue", args=[obj.name]))

    @admin.display(description="items now")
    def items_now(self, obj):
        try:
            counts = get_store().count_items(queue=obj.name)
        except StorageUnavailable as exc:
            return f"not counted: {exc.message}"
        summary = ", ".join(f"{getattr(counts, state)} {state}" for state in STATES)
        return format_html('{} (<a href="{}">see the items</a>)', summary, reverse("dashboard:queue", args=[obj.name]))

    def changeform_view(self, request, *args, **kwargs):
        try:
            return super().changeform_view(request, *args, **kwargs)
        except StorageUnavailable as exc:  # from save_model: the form's transaction saved nothing
            self.message_user(request, f"The queue was not saved: {exc.message}", messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        place_directory(obj, new=not change)
        # once saved for good: the admin's form view is one transaction
        before = form.initial.get("queue_seconds") if change else None
        transaction.on_commit(lambda: timeouts_lowered(obj, before))
        get_registry().invalidate()  # this process sees the change at once; the others within a second

    def delete_model(self, request, obj):
        delete_queue(obj)
        get_registry().invalidate()

    def delete_queryset(self, request, queryset):
        for queue in queryset:
            delete_queue(queue)
        get_registry().invalidate()

    @admin.action(description="Pause the selected queues")
    def pause_queues(self, request, queryset):
        self._set_paused(request, queryset, True)

    @admin.action(description="Resume the selected queues")
    def resume_queues(self, request, queryset):
        self._set_paused(request, queryset, False)

    def _set_paused(self, request, queryset, paused: bool) -> None:
        done = []
        try:
            for queue in queryset:
                try:
                    save_queue(queue.name, existing=True, paused=paused)
                except Queue.DoesNotExist:  # deleted since the list was shown: not made again
                    continue
                done.append(queue.name)
        except StorageUnavailable as exc:
            self.message_user(request, f"Not all were {'paused' if paused else 'resumed'}: {exc.message}", messages.ERROR)
        finally:
            get_registry().invalidate()
        if done:
            self.message_user(request, f"{'Paused' if paused else 'Resumed'}: {', '.join(done)}.", messages.SUCCESS)


class _CountsPerPage:
    """List-display columns for the items in each state, reading each queue's counts once."""

    def __init__(self):
        self._counts: dict[str, Counts] = {}

    def _of(self, queue: Queue) -> Counts | None:
        """None: the disk refused the listing; the page shows all the same."""
        if queue.name not in self._counts:
            try:
                self._counts[queue.name] = get_store().count_items(queue=queue.name)
            except StorageUnavailable:
                self._counts[queue.name] = None
        return self._counts[queue.name]

    def column(self, state: str):
        def count(queue: Queue) -> int | str:
            counts = self._of(queue)
            return "?" if counts is None else getattr(counts, state)

        count.__name__ = count.short_description = state  # the column's CSS class and heading
        return count

    def oldest_column(self):
        def oldest(queue: Queue) -> str:
            counts = self._of(queue)
            if counts is None:
                return "?"
            posted_at = counts.oldest_pending_posted_at
            return format_duration(None if posted_at is None else get_store().clock() - posted_at)

        oldest.__name__, oldest.short_description = "oldest_pending", "oldest pending"
        return oldest


class QueueNamesField(forms.CharField):
    """Queue names typed as `thumbs, emails`; stored as a list (empty: every queue)."""

    def prepare_value(self, value):
        if isinstance(value, str):  # the JSON text the model field renders, or what was typed
            try:
                value = json.loads(value)
            except ValueError:
                return value
        return ", ".join(value) if isinstance(value, list) else value

    def to_python(self, value):
        return [name.strip() for name in (value or "").split(",") if name.strip()]


class ApiTokenForm(forms.ModelForm):
    queues = QueueNamesField(
        required=False,
        help_text="Queue names this token may use, separated by commas; leave empty for every queue.",
    )

    class Meta:
        model = ApiToken
        fields = ("name", "can_produce", "can_work", "can_read_metrics", "queues")


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    form = ApiTokenForm
    list_display = ("name", "can_produce", "can_work", "can_read_metrics", "queue_list", "created_at", "last_used_at")
    readonly_fields = ("created_at", "last_used_at")
    fields = ("name", "can_produce", "can_work", "can_read_metrics", "queues", "created_at", "last_used_at")

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
