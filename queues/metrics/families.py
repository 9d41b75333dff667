"""Every metric this process exports, in one registry of its own (so a test or a second
application in the process never meets them twice), with the process's own CPU and memory.

The counters and histograms count what this process did: Prometheus sums them over processes.
The queue gauges are read from the shared data directory, so every process gives the same."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics

# `_created` series double every counter's lines and tell a scraper nothing it needs here
disable_created_metrics()

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)

# from a fraction of a second (a worker waiting on the socket) to the longest lease, a day
ITEM_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 21600, 86400)
# a request answered at once, up to a long poll's wait (60 s)
REQUEST_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

POSTED = Counter("taskhoster_items_posted", "Items posted (retries not included).", registry=REGISTRY)
FINISHED = Counter("taskhoster_items_finished", "Items ended by an accepted result.", registry=REGISTRY)
FAILED = Counter(
    "taskhoster_items_failed",
    "Items ended failed by the server: timeout, max_attempts or canceled.",
    ["reason"],
    registry=REGISTRY,
)
REQUEUED = Counter(
    "taskhoster_items_requeued",
    "Processing items given back for another try: lease (lapsed), socket (closed), release (by the "
    "worker), staff, shutdown (the server stopped).",
    ["reason"],
    registry=REGISTRY,
)
RETRIED = Counter("taskhoster_items_retried", "Ended items posted again by a retry.", registry=REGISTRY)
CANCELED = Counter("taskhoster_items_canceled", "Items ended by a cancel.", registry=REGISTRY)
ITEM_WAIT = Histogram(
    "taskhoster_item_wait_seconds",
    "From an item's post (or its runAt, if scheduled) to its first claim.",
    buckets=ITEM_SECONDS,
    registry=REGISTRY,
)
ITEM_RUN = Histogram(
    "taskhoster_item_run_seconds",
    "From an item's latest claim to the result that finished it.",
    buckets=ITEM_SECONDS,
    registry=REGISTRY,
)
HTTP_REQUESTS = Histogram(
    "taskhoster_http_request_duration_seconds",
    "HTTP requests by method, route (the API call's pattern, or admin, dashboard, static, metrics) "
    "and status, from the request's start to its answer's last byte.",
    ["method", "route", "status"],
    buckets=REQUEST_SECONDS,
    registry=REGISTRY,
)
HTTP_IN_FLIGHT = Gauge(
    "taskhoster_http_requests_in_flight", "HTTP requests this process is answering now (long polls included).",
    registry=REGISTRY,
)

# shown at 0 before the first one, so a rate over them starts at once
for reason in ("timeout", "max_attempts", "canceled"):
    FAILED.labels(reason)
for reason in ("lease", "socket", "release", "staff", "shutdown", "unsent"):
    REQUEUED.labels(reason)
