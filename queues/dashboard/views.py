"""The dashboard's pages and actions, for staff only. Views translate: they read the store and
the queue records and hand plain values to the templates."""

import json
import math
from functools import wraps

from django.contrib import admin, messages
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import ValidationError
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST, require_safe

from ..exceptions import ItemNotFound, NotEnded, NotHeld, StorageUnavailable
from ..ids import iso
from ..models import Queue
from ..runtime import get_registry, get_store
from ..services import save_queue, validation_messages
from ..store import ABSENT, Item, Release, single
from ..store.layout import is_valid_queue_name
from .consumers import LIVE_PATH
from ..roster import roster
from .display import (
    STATES,
    bar_segments,
    blank_row,
    error_shape,
    failure_reason,
    format_duration,
    format_time,
    queue_row,
    worker_row,
)
from .snapshot import take_snapshot

PAGE_SIZE = 50
BLANK_WORKER = {"id": "", "name": "", "address": "", "queues": [], "holding": 0, "held": [], "for": "", "since": "",
                "connectedAt": "", "more": 0}  # the markup the page's script copies for a worker connecting later
LIST_STATES = {"scheduled": "Scheduled", "pending": "Pending", "processing": "Processing", "done": "Done"}
DONE_FILTERS = {"": "All", "finished": "Finished", "failed": "Failed"}
PREVIEW_CHARS = 80


def staff_required(view):
    """Anonymous users go to the login page; a logged-in user who is not staff gets a 403 page."""

    @wraps(view)
    def checked(request, *args, **kwargs):
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not request.user.is_staff:
            return _render(request, "dashboard/forbidden.html", {"title": "Staff only"}, status=403)
        return view(request, *args, **kwargs)

    return checked


def _render(request, template: str, context: dict, *, status: int = 200) -> TemplateResponse:
    page = {**admin.site.each_context(request), "is_nav_sidebar_enabled": False, **context}
    return TemplateResponse(request, template, page, status=status)


def _not_found(request, title: str, message: str, queue: Queue | None = None) -> TemplateResponse:
    return _render(request, "dashboard/not_found.html", {"title": title, "message": message, "queue": queue}, status=404)


def _find_queue(name: str) -> Queue | None:
    # a name the rule refuses (a NUL byte, say, which PostgreSQL would refuse) is asked of no one
    return Queue.objects.filter(name=name).first() if is_valid_queue_name(name) else None


@require_safe
@staff_required
def dashboard(request):
    store = get_store()
    snapshot = take_snapshot(store, [queue.config() for queue in Queue.objects.all()], roster.everyone())
    now = store.clock()
    context = {
        "title": "Queues",
        "rows": [queue_row(queue) for queue in snapshot["queues"]],
        "blank_row": blank_row(),
        "workers": [worker_row(worker, now) for worker in snapshot["workers"]],
        "blank_worker": BLANK_WORKER,
        "snapshot_at": snapshot["at"],
        "live_path": LIVE_PATH,
    }
    return _render(request, "dashboard/index.html", context)


@require_safe
@staff_required
def queue_items(request, name: str):
    queue = _find_queue(name)
    if queue is None:
        return _no_queue(request, name)
    state = request.GET.get("state", "pending")
    if state not in LIST_STATES:
        return _not_found(request, "No such list", f"Items are listed as {', '.join(LIST_STATES)}.", queue)
    page = request.GET.get("page", "1")
    # ASCII digits only ("²" is a digit to isdigit(), not to int()), and not so many that int() refuses
    if not (page.isascii() and page.isdigit() and len(page) <= 9) or int(page) < 1:
        return _not_found(request, "No such page", "Pages are numbered from 1.", queue)
    page = int(page)
    status = request.GET.get("status", "") if state == "done" else ""
    if status not in DONE_FILTERS:
        return _not_found(request, "No such list", "Done items are listed as finished or failed.", queue)
    store = get_store()
    total, items = store.list_items(queue=name, state=state, offset=(page - 1) * PAGE_SIZE, limit=PAGE_SIZE,
                                    status=status or None)
    counts = store.count_items(queue=name)
    now = store.clock()
    by_state = {key: getattr(counts, key) for key in STATES}
    by_list = {
        "scheduled": counts.scheduled, "pending": counts.pending, "processing": counts.processing,
        "done": counts.finished + counts.failed,
    }
    return _render(
        request,
        "dashboard/queue.html",
        {
            "title": f"Queue {name}",
            "queue": queue,
            "state": state,
            "tabs": [
                {"state": key, "label": label, "count": by_list[key], "current": key == state}
                for key, label in LIST_STATES.items()
            ],
            "segments": bar_segments(by_state),
            "lease": format_duration(queue.lease_seconds),
            "lifetime": format_duration(queue.queue_seconds),
            "retention": format_duration(queue.retain_seconds),
            "oldest": format_duration(None if counts.oldest_pending_posted_at is None else now - counts.oldest_pending_posted_at),
            "items": [_item_row(item, now, queue) for item in items],
            "status": status,
            "filters": [
                {"status": key, "label": label, "count": {"": by_list["done"], "finished": counts.finished,
                                                          "failed": counts.failed}[key], "current": key == status}
                for key, label in DONE_FILTERS.items()
            ] if state == "done" else [],
            "list_query": f"state={state}" + (f"&status={status}" if status else ""),
            "total": total,
            "page": page,
            "pages": max(1, math.ceil(total / PAGE_SIZE)),
            "first_number": (page - 1) * PAGE_SIZE + 1,
            "last_number": (page - 1) * PAGE_SIZE + len(items),
        },
    )


@require_safe
@staff_required
def item_detail(request, name: str, item_id: str):
    queue = _find_queue(name)
    if queue is None:
        return _no_queue(request, name)
    store = get_store()
    try:
        item = store.read_item(queue=name, item_id=item_id)  # not a fetch: retention does not start
    except ItemNotFound:
        return _gone(request, queue, item_id)
    now = store.clock()
    return _render(
        request,
        "dashboard/item.html",
        {
            "title": f"Item {item.id}",
            "queue": queue,
            "item": _item_row(item, now, queue),
            "payload": _pretty(item.payload),
            "result": _pretty(item.result) if item.status == "finished" else None,
            "result_error": error_shape(item.result) if item.status == "finished" else None,
            "error": item.error,
            "last_error": None if item.last_error is ABSENT else _pretty(item.last_error),
            "last_error_shape": None if item.last_error is ABSENT else error_shape(item.last_error),
        },
    )


@require_POST
@staff_required
def requeue_item(request, name: str, item_id: str):
    queue = _find_queue(name)
    if queue is None:
        return _no_queue(request, name)
    try:
        back = single(get_store().release_items(releases=[Release(queue.config(), item_id, reason="staff")]))
    except ItemNotFound:
        return _gone(request, queue, item_id)
    except NotHeld:
        messages.warning(request, f"Item {item_id} is not processing any more, so it was not re-queued.")
    except StorageUnavailable as exc:
        messages.error(request, f"Item {item_id} was not re-queued: {exc.message}")
    else:
        if back.status == "pending":
            messages.success(request, f"Item {item_id} is pending again; the next claim can take it.")
        else:  # it ended instead: too old for its queue, or at its maxAttempts
            messages.warning(request, f"Item {item_id} was not re-queued: it ended {back.status} ({back.error}).")
    return _back(request, reverse("dashboard:item", args=[name, item_id]))


@require_POST
@staff_required
def retry_item(request, name: str, item_id: str):
    queue = _find_queue(name)
    if queue is None:
        return _no_queue(request, name)
    try:
        new, made = get_store().retry_item(config=queue.config(), item_id=item_id)
    except ItemNotFound:
        return _gone(request, queue, item_id)
    except (NotEnded, StorageUnavailable) as exc:
        messages.error(request, f"Item {item_id} was not retried: {exc.message}")
        return _back(request, reverse("dashboard:item", args=[name, item_id]))
    if made:
        messages.success(request, f"Item {item_id} is posted again as item {new.id}.")
    else:
        messages.info(request, f"Item {item_id} was retried before, as item {new.id}.")
    return HttpResponseRedirect(reverse("dashboard:item", args=[name, new.id]))


@require_POST
@staff_required
def cancel_item(request, name: str, item_id: str):
    queue = _find_queue(name)
    if queue is None:
        return _no_queue(request, name)
    try:
        item, canceled = get_store().cancel_item(config=queue.config(), item_id=item_id)
    except ItemNotFound:
        return _gone(request, queue, item_id)
    except StorageUnavailable as exc:
        messages.error(request, f"Item {item_id} was not canceled: {exc.message}")
    else:
        if canceled:
            messages.success(request, f"Item {item_id} is canceled: it failed, and no result will be taken.")
        else:
            messages.warning(request, f"Item {item_id} had ended already ({item.status}), so it was not canceled.")
    return _back(request, reverse("dashboard:item", args=[name, item_id]))


NEW_QUEUE_LABELS = {"name": "Name", "lease_seconds": "Lease", "queue_seconds": "Item life",
                    "retain_seconds": "Kept for", "max_attempts": "Max attempts"}
NEW_QUEUE_FIELDS = {  # form field -> the queue's setting; a blank field keeps the default
    "lease_seconds": int, "queue_seconds": int, "retain_seconds": int, "max_attempts": int,
}


@require_POST
@staff_required
def create_queue(request):
    """Make a queue with the settings given (the others keep their defaults); a name in use is refused."""
    if not request.user.has_perm("queues.add_queue"):
        messages.error(request, "You may not make queues: that takes the permission to add queues, in the admin.")
        return HttpResponseRedirect(reverse("dashboard:index"))
    name = request.POST.get("name", "").strip()
    if _find_queue(name) is not None:
        messages.error(request, f"There is a queue named {name} already; change its settings in the admin.")
        return HttpResponseRedirect(reverse("dashboard:index"))
    try:
        settings = {field: kind(request.POST[field]) for field, kind in NEW_QUEUE_FIELDS.items()
                    if request.POST.get(field, "").strip()}
    except ValueError:
        messages.error(request, "The queue was not made: its settings must be whole numbers.")
        return HttpResponseRedirect(reverse("dashboard:index"))
    try:
        save_queue(name, existing=False, **settings)
    except ValidationError as exc:
        messages.error(request, f"The queue was not made: {validation_messages(exc, NEW_QUEUE_LABELS)}")
        return HttpResponseRedirect(reverse("dashboard:index"))
    except StorageUnavailable as exc:
        messages.error(request, f"The queue was not made: {exc.message}")
        return HttpResponseRedirect(reverse("dashboard:index"))
    get_registry().invalidate()  # this process sees it at once; the others within a second
    messages.success(request, f"Queue {name} is made: workers can claim from it, producers post to it.")
    return HttpResponseRedirect(reverse("dashboard:queue", args=[name]))


@require_POST
@staff_required
def set_paused(request, name: str, paused: bool):
    try:
        save_queue(name, existing=True, paused=paused)
    except Queue.DoesNotExist:  # deleted meanwhile, or never: pausing it must not make it again
        return _no_queue(request, name)
    except ValidationError:  # a name the rule refuses
        return _no_queue(request, name)
    except StorageUnavailable as exc:
        messages.error(request, f"Queue {name} was not {'paused' if paused else 'resumed'}: {exc.message}")
        return _back(request, reverse("dashboard:queue", args=[name]))
    get_registry().invalidate()  # this process sees it at once; the others within a second
    if paused:
        messages.success(request, f"Queue {name} is paused: it takes posts and results but hands out no claims.")
    else:
        messages.success(request, f"Queue {name} is running again: workers can claim its items.")
    return _back(request, reverse("dashboard:queue", args=[name]))


def _no_queue(request, name: str) -> TemplateResponse:
    return _not_found(request, "No such queue", f"There is no queue named “{name}”.")


def _gone(request, queue: Queue, item_id: str) -> TemplateResponse:
    return _not_found(
        request,
        "Item gone",
        f"Item {item_id} is not in queue {queue.name}: retention deleted it, or it never existed.",
        queue,
    )


def _back(request, default: str) -> HttpResponseRedirect:
    target = request.POST.get("next", "")
    safe = url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}, require_https=request.is_secure())
    return HttpResponseRedirect(target if safe else default)


def _item_row(item: Item, now: float, queue: Queue) -> dict:
    shape = error_shape(item.result) if item.status == "finished" else None
    return {
        "id": item.id,
        "status": item.status,
        # what failed it (the server's error), or that its result is an error the handler raised
        "outcome": item.error if item.status == "failed" else ("error" if shape else None),
        "why": failure_reason(item.error, attempts=item.attempts, queue=queue) if item.status == "failed" else None,
        "error_type": shape.get("type") if shape else None,
        "preview": _preview(item.payload),
        "ended": item.terminal,
        "run_at": _moment(item.run_at),
        "due_in": None if item.run_at is None else format_duration(max(0.0, item.run_at - now)),
        "retry_of": item.retry_of,
        "key": item.key,
        "retried_as": item.retried_as,
        "attempts": item.attempts,
        "posted": _moment(item.posted_at),
        "age": format_duration(now - item.posted_at),
        "claimed": _moment(item.claimed_at),
        "lease_expires": _moment(item.lease_expires_at),
        "lease_left": _lease_left(item, now),
        "finished": _moment(item.finished_at),
        "finished_ago": None if item.finished_at is None else format_duration(now - item.finished_at),
    }


def _moment(timestamp: float | None) -> dict | None:
    return None if timestamp is None else {"iso": iso(timestamp), "text": format_time(timestamp)}


def _lease_left(item: Item, now: float) -> str | None:
    if item.lease_expires_at is None:
        return None
    left = item.lease_expires_at - now
    return format_duration(math.ceil(left)) if left > 0 else "lapsed"


def _preview(value) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def _pretty(value) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)
