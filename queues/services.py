"""Queue records and their directories, kept in step."""

import logging

from django.core.exceptions import ValidationError
from django.db import transaction

from .exceptions import StorageUnavailable
from .models import Queue, queue_name_validator
from .runtime import get_store
from .store import Counts, QueueConfig
from .store.layout import is_valid_queue_name

log = logging.getLogger(__name__)

SETTING_FIELDS = ("lease_seconds", "queue_seconds", "retain_seconds", "retain_from", "paused", "max_attempts")


def save_queue(name: str, *, existing: bool | None = None, **changes) -> Queue:
    """Create the queue, or change only the given settings of an existing one; `existing` True
    only changes one (Queue.DoesNotExist if there is none: deleted meanwhile), False only creates.
    Raises ValidationError with a message per bad field (the name too: one a name check would
    refuse never reaches the database), or StorageUnavailable when the queue's directory cannot
    be made; nothing is saved then."""
    unknown = set(changes) - set(SETTING_FIELDS)
    if unknown:
        raise ValueError(f"unknown queue settings: {sorted(unknown)}")
    if not is_valid_queue_name(name):
        raise ValidationError({"name": queue_name_validator.message})
    with transaction.atomic():
        queue = Queue.objects.select_for_update().filter(name=name).first()
        if queue is None and existing:
            raise Queue.DoesNotExist(f"no queue named {name}")
        if queue is not None and existing is False:
            raise ValidationError({"name": f"There is a queue named {name} already."})
        queue = queue or Queue(name=name)
        new = queue.pk is None
        before = None if new else queue.queue_seconds
        for field, value in changes.items():
            setattr(queue, field, value)
        queue.full_clean()
        queue.save()
        place_directory(queue, new=new)  # inside: a queue whose directory cannot be made is not saved
    timeouts_lowered(queue, before)
    return queue


def place_directory(queue: Queue, *, new: bool) -> None:
    """The queue's directory on disk: a new queue's made afresh (what a deletion of its name left
    behind is cleared first), an existing one's made again where it is missing."""
    store = get_store()
    (store.create_queue if new else store.ensure_queue)(queue.name)


def timeouts_lowered(queue: Queue, before: int | None) -> None:
    """Once a queue's queueSeconds was lowered from `before` (and saved: an item failed for it is
    not taken back), its scheduled items age out by the new one too (see Store.mark_timeouts). A
    disk that refuses it is logged: each server's sweep tries again when it sees the change."""
    if before is None or queue.queue_seconds >= before:
        return
    try:
        get_store().mark_timeouts(config=queue.config())
    except StorageUnavailable:
        log.warning("could not mark the scheduled items of %s for its lower queueSeconds", queue.name,
                    exc_info=True)


def delete_queue(queue: Queue) -> None:
    """Delete the queue and every item in it. One the disk refuses (StorageUnavailable) keeps the
    queue: a directory left without its deletion mark would give its items to a queue made again
    under the name."""
    with transaction.atomic():
        queue.delete()
        get_store().delete_queue(queue.name)


def describe_queue(config: QueueConfig, counts: Counts, now: float) -> dict:
    """A queue as the API shows it."""
    oldest = counts.oldest_pending_posted_at
    return {
        "name": config.name,
        "leaseSeconds": config.lease_seconds,
        "queueSeconds": config.queue_seconds,
        "retainSeconds": config.retain_seconds,
        "retainFrom": config.retain_from,
        "paused": config.paused,
        "maxAttempts": config.max_attempts,
        "counts": {
            "scheduled": counts.scheduled,
            "pending": counts.pending,
            "processing": counts.processing,
            "finished": counts.finished,
            "failed": counts.failed,
        },
        "oldestPendingAgeSeconds": None if oldest is None else round(max(0.0, now - oldest), 3),
    }


def validation_messages(error: ValidationError, labels: dict[str, str] | None = None) -> str:
    """One line for the user; `labels` names fields as the user knows them (a command's options)."""
    labels = labels or {}
    if hasattr(error, "message_dict"):
        return "; ".join(f"{labels.get(field, field)}: {' '.join(msgs)}" for field, msgs in error.message_dict.items())
    return " ".join(error.messages)
