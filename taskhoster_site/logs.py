"""How the log is written: TASKHOSTER_LOG_FORMAT=text (the default) gives a line of text per
record, `json` one JSON object per line (a traceback included, escaped), with the record's
`fields` (an access line's method, status, duration...) as keys of their own."""

import json
import logging
import time

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Stamps:
    """UTC timestamps with milliseconds. Formatting the date and time is most of what writing a
    log line costs, and a busy server writes many lines a second: the part up to the second is
    made once a second."""

    def __init__(self, pattern: str, millis: str):
        self.pattern, self.millis = pattern, millis
        self._second, self._text = -1, ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self._second:  # a race only makes the same text twice
            self._text, self._second = time.strftime(self.pattern, time.gmtime(second)), second
        return self._text + self.millis % int((created - second) * 1000)


# control characters in a message (a request's path, decoded from %0A, say) written escaped: a
# message is one line, and nobody can add lines of their own making to the log
_ESCAPES = ({code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))}
            | {0x2028: "\\u2028", 0x2029: "\\u2029", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"})


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__(TEXT_FORMAT)
        self._stamps = _Stamps("%Y-%m-%d %H:%M:%S", ".%03dZ")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return self._stamps(record.created)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_ESCAPES)  # a traceback, added after, keeps its lines
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def __init__(self):
        super().__init__()
        self._stamps = _Stamps("%Y-%m-%dT%H:%M:%S", ".%03dZ")

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self._stamps(record.created),
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
    formatter = {"()": f"{__name__}.{'JsonFormatter' if form == 'json' else 'TextFormatter'}"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"chosen": formatter},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "chosen"}},
        "root": {"handlers": ["console"], "level": level},
    }
