import threading
import uuid
from datetime import datetime, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queues import ids

NOW = 1_796_000_000.123


def test_ids_are_uuidv7_text_carrying_the_posting_millisecond():
    (item_id,) = ids.IdMaker().new_ids(1, NOW)
    parsed = uuid.UUID(item_id)
    assert str(parsed) == item_id
    assert parsed.version == 7
    assert parsed.variant == uuid.RFC_4122
    assert ids.id_millis(item_id) == int(NOW * 1000)
    assert ids.is_valid_id(item_id)


def test_ids_strictly_increase_within_a_batch_made_in_one_millisecond():
    # 5,000 ids in one millisecond overflow the 12-bit counter: the maker borrows the next one
    batch = ids.IdMaker().new_ids(5000, NOW)
    assert batch == sorted(batch)
    assert len(set(batch)) == len(batch)
    assert all(ids.is_valid_id(i) for i in batch)


def test_ids_strictly_increase_across_calls_within_one_millisecond():
    maker = ids.IdMaker()
    made = [maker.new_ids(1, NOW)[0] for _ in range(3000)]
    assert made == sorted(made)
    assert len(set(made)) == len(made)


def test_ids_never_go_backwards_when_the_clock_does():
    maker = ids.IdMaker()
    first = maker.new_ids(3, NOW)
    later = maker.new_ids(3, NOW - 5)
    assert first + later == sorted(first + later)


def test_ids_from_many_threads_are_unique_and_increase_within_each_thread():
    maker = ids.IdMaker()
    made: dict[int, list[str]] = {}

    def make(n: int) -> None:
        made[n] = [maker.new_ids(1, NOW)[0] for _ in range(500)]

    threads = [threading.Thread(target=make, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [i for sequence in made.values() for i in sequence]
    assert len(set(every)) == 8 * 500
    assert all(sequence == sorted(sequence) for sequence in made.values())


def test_time_prefix_is_the_first_13_characters_of_ids_made_that_millisecond():
    (item_id,) = ids.IdMaker().new_ids(1, NOW)
    millis = int(NOW * 1000)
    assert item_id[:13] == ids.time_prefix(millis)
    assert ids.time_prefix(millis - 1) < item_id < ids.time_prefix(millis + 1)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "not-an-id",
        "../../../etc/passwd",
        str(uuid.uuid4()),  # version 4
        "0193A4B2-7C1E-7D3A-9F00-2B6C1D0E4F55",  # upper case
        "0193a4b2-7c1e-7d3a-7f00-2b6c1d0e4f55",  # wrong variant
        "0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f55\n",
        "0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f5/",
        "0193a4b27c1e7d3a9f002b6c1d0e4f55",
        None,
        42,
    ],
)
def test_anything_but_monotonic_uuidv7_text_is_not_an_id(value):
    assert not ids.is_valid_id(value)


def test_timestamps_are_utc_iso_with_milliseconds_and_z():
    assert ids.iso(0.0) == "1970-01-01T00:00:00.000Z"
    assert ids.iso(1_796_000_000.1239) == "2026-11-30T00:53:20.124Z"
    assert ids.iso(None) is None
    assert ids.parse_iso("2026-11-30T00:53:20.124Z") == pytest.approx(1_796_000_000.124)
    assert ids.parse_iso(None) is None


def _iso_by_datetime(timestamp: float) -> str:
    moment = datetime.fromtimestamp(round(timestamp, 3), tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


@given(st.floats(min_value=0, max_value=4_102_444_800))  # 1970 ... 2100
def test_timestamps_format_exactly_as_datetime_does(timestamp):
    assert ids.iso(timestamp) == _iso_by_datetime(timestamp)
    assert ids.parse_iso(ids.iso(timestamp)) == pytest.approx(round(timestamp, 3), abs=1e-6)


@pytest.mark.parametrize(
    ("timestamp", "text"),
    [
        (1_796_000_000.9995, "2026-11-30T00:53:21.000Z"),  # rounds up into the next second
        (1_796_000_000.9994, "2026-11-30T00:53:20.999Z"),
        (1_796_000_039.9999, "2026-11-30T00:54:00.000Z"),  # ... and the next minute
        (1_798_761_599.9999, "2027-01-01T00:00:00.000Z"),  # ... and the next year
        (951_782_400.5, "2000-02-29T00:00:00.500Z"),
    ],
)
def test_timestamps_round_to_the_millisecond_across_boundaries(timestamp, text):
    assert ids.iso(timestamp) == text
    assert ids.iso(timestamp) == _iso_by_datetime(timestamp)


def test_a_posting_time_survives_formatting_and_parsing_exactly():
    (item_id,) = ids.IdMaker().new_ids(1, NOW)
    posted_at = ids.id_millis(item_id) / 1000
    assert ids.parse_iso(ids.iso(posted_at)) == posted_at
