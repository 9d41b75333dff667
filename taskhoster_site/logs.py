"""How the log is written: TASKHOSTER_LOG_FORMAT=text (the default) gives a line of text per
record, `json` one JSON object per line (a traceback included, escaped), with the record's
`fields` (an access line's method, status, duration...) as keys of their own."""

import json
import logging
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def logging_config(level: str, form: str) -> dict:
    """The LOGGING setting: everything to standard error, at `level`, as `form`."""
    formatter = {"()": f"{__name__}.JsonFormatter"} if form == "json" else {"format": TEXT_FORMAT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"chosen": formatter},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "chosen"}},
        "root": {"handlers": ["console"], "level": level},
    }
