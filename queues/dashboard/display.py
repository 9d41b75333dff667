"""Turns snapshot figures into what the templates draw. `static/queues/dashboard.js` draws the
same from each live snapshot, so the two must agree: change both together."""

from datetime import datetime, timezone

STATES = ("scheduled", "pending", "processing", "finished", "failed")


def format_duration(seconds: float | None) -> str:
    """A short human duration: "42 s", "3 min 5 s", "2 h 10 min", "4 d 3 h"; "–" for none."""
    if seconds is None:
        return "–"
    whole = max(0, int(seconds))
    for unit, size, smaller, smaller_size in (("d", 86400, "h", 3600), ("h", 3600, "min", 60), ("min", 60, "s", 1)):
        if whole >= size:
            rest = (whole % size) // smaller_size
            return f"{whole // size} {unit}" + (f" {rest} {smaller}" if rest else "")
    return f"{whole} s"


def format_time(timestamp: float) -> str:
    """A moment as people read it: "2026-11-30 14:23:53 UTC"."""
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def bar_segments(counts: dict) -> list[dict]:
    """The stacked bar of a queue's items by state, each state's share in percent."""
    total = sum(counts[state] for state in STATES)
    return [
        {"state": state, "count": counts[state], "percent": _percent(counts[state], total)} for state in STATES
    ]


def error_shape(value) -> dict | None:
    """The error a result or a lastError holds, when it has the clients' error shape
    (`{"error": {"type", "message", "traceback"}}`): drawn as an error, its traceback readable."""
    if not (isinstance(value, dict) and set(value) == {"error"} and isinstance(value["error"], dict)):
        return None
    error = value["error"]
    text = {key: error[key] for key in ("type", "message", "traceback") if isinstance(error.get(key), str)}
    return text if "type" in text or "message" in text else None


def failure_reason(error: str | None, *, attempts: int, queue) -> str:
    """Which of the queue's limits failed an item (or that it was canceled), in words."""
    if error == "timeout":
        life = format_duration(queue.queue_seconds)
        return f"it grew older than the queue's item life (queueSeconds, {life}) before it ended"
    if error == "max_attempts":
        limit = queue.max_attempts if queue.max_attempts is not None else "now none"
        return f"it was handed out {attempts} times, the queue's limit (maxAttempts, {limit}), and was due back again"
    if error == "canceled":
        return "a producer or staff canceled it"
    return ""


def chart_columns(throughput: list[dict]) -> list[dict]:
    """One column per minute, heights in percent of the busiest minute."""
    peak = max((minute["finished"] + minute["failed"] for minute in throughput), default=0)
    return [
        {
            "label": f"{minute['minute'][11:16]} UTC: {minute['finished']} finished, {minute['failed']} failed",
            "finished": _percent(minute["finished"], peak),
            "failed": _percent(minute["failed"], peak),
        }
        for minute in throughput
    ]


def queue_row(queue: dict) -> dict:
    """Everything one dashboard row shows, from one queue of a snapshot."""
    counts = queue["counts"]
    last = queue["lastMinute"]
    return {
        "name": queue["name"],
        "paused": queue["paused"],
        "segments": bar_segments(counts),
        "bar_label": ", ".join(f"{counts[state]} {state}" for state in STATES),
        "oldest": format_duration(queue["oldestPendingAgeSeconds"]),
        "chart": chart_columns(queue["throughput"]),
        "rate": f"{last['finished']} finished, {last['failed']} failed",
        "workers": workers_text(queue["workers"]),
        "errors": queue.get("errorResults", 0),
    }


def workers_text(count: int) -> str:
    return f"{count} worker{'' if count == 1 else 's'}"


def worker_row(worker: dict, now: float) -> dict:
    """One connected worker as the dashboard lists it."""
    connected = datetime.fromisoformat(worker["connectedAt"]).timestamp()
    return {**worker, "since": format_time(connected), "for": format_duration(now - connected),
            "more": worker["holding"] - len(worker["held"])}


def blank_row() -> dict:
    """A row with nothing in it: the markup the page's script copies for a queue made later."""
    return queue_row(
        {
            "name": "",
            "paused": False,
            "counts": dict.fromkeys(STATES, 0),
            "oldestPendingAgeSeconds": None,
            "throughput": [],
            "lastMinute": {"finished": 0, "failed": 0},
            "workers": 0,
        }
    )


def _percent(part: int, whole: int) -> float:
    return round(100 * part / whole, 2) if whole else 0.0
