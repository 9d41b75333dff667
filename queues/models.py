import hashlib
import secrets

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from .store import QUEUE_NAME, QueueConfig

DAY = 86400
MAX_QUEUE_SECONDS = 30 * DAY  # a queue's queueSeconds and retainSeconds
MAX_ATTEMPTS = 1000
TOKEN_PREFIX = "th_"

queue_name_validator = RegexValidator(
    regex=rf"\A{QUEUE_NAME.pattern}\Z",
    message="Use 1 to 64 characters: lowercase letters, digits, '_' and '-', "
    "starting with a letter or a digit.",
)


class Queue(models.Model):
    name = models.CharField(max_length=64, unique=True, validators=[queue_name_validator])
    lease_seconds = models.PositiveIntegerField(
        default=60,
        validators=[MinValueValidator(1), MaxValueValidator(DAY)],
        help_text="How long a claim holds an item (1 to 86400 seconds), fixed at claim time.",
    )
    queue_seconds = models.PositiveIntegerField(
        default=DAY,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_QUEUE_SECONDS)],
        help_text="The whole life of an item from posting (1 second to 30 days); older items fail with 'timeout'.",
    )
    retain_seconds = models.PositiveIntegerField(
        default=3600,
        validators=[MaxValueValidator(MAX_QUEUE_SECONDS)],
        help_text="How long a finished or failed item is kept (0 to 30 days).",
    )
    retain_from = models.CharField(
        max_length=8,
        default="finished",
        choices=[("finished", "finished"), ("fetched", "first fetch")],
        help_text="When the retention clock starts: when the item is done, or when its result is first read.",
    )
    paused = models.BooleanField(default=False, help_text="A paused queue takes posts and results but hands out no claims.")
    max_attempts = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_ATTEMPTS)],
        help_text="How often an item may be handed out (1 to 1000); at the last try it ends failed "
        "'max_attempts' instead of going back. Empty: no limit.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def config(self) -> QueueConfig:
        return QueueConfig(
            name=self.name,
            lease_seconds=self.lease_seconds,
            queue_seconds=self.queue_seconds,
            retain_seconds=self.retain_seconds,
            retain_from=self.retain_from,
            paused=self.paused,
            max_attempts=self.max_attempts,
        )


def hash_token(raw: str) -> str:
    # tokens are 192 random bits, so a fast hash is enough: there is nothing to brute-force
    return hashlib.sha256(raw.encode()).hexdigest()


def make_token_value() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(24)  # 32 URL-safe characters


class ApiToken(models.Model):
    name = models.CharField(max_length=100)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    can_produce = models.BooleanField(default=True, help_text="May post items and read them.")
    can_work = models.BooleanField(default=True, help_text="May claim items and hand in results.")
    can_read_metrics = models.BooleanField(
        default=False, help_text="May read /metrics (alone, it reads nothing else)."
    )
    queues = models.JSONField(
        default=list, blank=True, help_text="Queue names this token may use; empty means every queue."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["name"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        if not isinstance(self.queues, list) or not all(isinstance(q, str) for q in self.queues):
            raise ValidationError({"queues": "Give a list of queue names, or an empty list for every queue."})
        for name in self.queues:
            try:
                queue_name_validator(name)
            except ValidationError:
                raise ValidationError({"queues": f"{name!r} is not a valid queue name."}) from None
        if not (self.can_produce or self.can_work or self.can_read_metrics):
            raise ValidationError("A token needs at least one right: to produce, to work or to read metrics.")

    def set_new_value(self) -> str:
        """Give the token a fresh value; only its hash is kept, so show the value now."""
        raw = make_token_value()
        self.token_hash = hash_token(raw)
        return raw
