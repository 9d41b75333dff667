"""The peers' task, imported by their worker processes: a no-op, as our bench worker's handler
is. A warm-up item answers with the process that worked it, so the bench knows every worker is
up. Celery's workers load `app` (`celery -A queues.bench.peer_tasks:app worker`), which reads
the Redis URL from PEER_REDIS_URL; RQ's workers import `noop` by its dotted name.

Needs the bench extra (`pip install -e '.[bench]'`).
"""

import os

from celery import Celery

REDIS_URL_VARIABLE = "PEER_REDIS_URL"
CELERY_TASK = "bench.noop"
WARM_UP = "warm-up"


def noop(payload):
    return os.getpid() if payload == WARM_UP else None


def celery_app(redis_url: str) -> Celery:
    """A Celery app with Redis as broker and result backend, JSON throughout, and the no-op task
    registered as CELERY_TASK."""
    app = Celery("taskhoster-bench", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"],
        broker_connection_retry_on_startup=True,
    )
    app.task(name=CELERY_TASK)(noop)
    return app


app = celery_app(os.environ.get(REDIS_URL_VARIABLE, "redis://127.0.0.1:6379/0"))
