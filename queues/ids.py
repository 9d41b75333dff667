"""Item ids: monotonic UUIDv7 text, and the timestamps the API shows.

An id's first 48 bits are its posting time in milliseconds, so `postedAt` and the age of a pending
item can be read from the file name alone, and sorting names sorts items by posting time.
"""

import os
import re
import threading
import time
from datetime import datetime
from functools import lru_cache

ID_PATTERN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
_COUNTER_MAX = 0xFFF


def is_valid_id(value: object) -> bool:
    return isinstance(value, str) and len(value) == 36 and ID_PATTERN.fullmatch(value) is not None


def id_millis(item_id: str) -> int:
    return int(item_id[:8] + item_id[9:13], 16)


def time_prefix(millis: int) -> str:
    """The first 13 characters of every id made at `millis`: names below it are older."""
    digits = f"{millis:012x}"
    return f"{digits[:8]}-{digits[8:]}"


class IdMaker:
    """Makes ids that strictly increase within this process, even within one millisecond.

    The 12-bit `rand_a` field is a counter (RFC 9562, method 1); when it overflows, the id borrows
    the next millisecond, so ids never repeat and never go backwards even if the clock does.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._last_millis = -1
        self._counter = 0

    def new_ids(self, count: int, now: float) -> list[str]:
        with self._lock:
            ids = []
            for _ in range(count):
                millis = int(now * 1000)
                if millis > self._last_millis:
                    self._last_millis = millis
                    self._counter = int.from_bytes(os.urandom(2), "big") & 0x3FF
                else:
                    self._counter += 1
                    if self._counter > _COUNTER_MAX:
                        self._last_millis += 1
                        self._counter = 0
                ids.append(_format(self._last_millis, self._counter))
            return ids


def _format(millis: int, counter: int) -> str:
    rand_b = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (millis << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | rand_b
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def iso(timestamp: float | None) -> str | None:
    """UTC ISO-8601 with milliseconds and `Z`, as every timestamp in the API."""
    if timestamp is None:
        return None
    # round to the millisecond first, as datetime would: .9996 s shows as the next second
    seconds, millis = divmod(round(round(timestamp, 3) * 1000), 1000)
    return f"{_second_text(seconds)}.{millis:03d}Z"


@lru_cache(maxsize=4096)
def _second_text(seconds: int) -> str:
    """`2026-11-30T14:23:53`: a handful of seconds cover most of what one process formats, so
    remembering them saves building a datetime per timestamp."""
    t = time.gmtime(seconds)
    return f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}T{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"


def parse_iso(text: str | None) -> float | None:
    if text is None:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
