"""An item's file read back (queues/store/records.py): the file's directory is its state, and a
claim record beside the file overrides the file's attempts and claim time in every state, its
lease and claim token only while the item is processing; a claim record that does not parse
makes the file unreadable."""

import pytest

from queues import ids
from queues.store.records import Item, Unreadable, decode, encode, encode_claim

NOW = 1_796_000_000.0
ITEM_ID = ids.IdMaker().new_ids(1, NOW)[0]
STATES = ("scheduled", "pending", "processing")  # those a claim record may lie beside


def _file(state: str) -> bytes:
    """What the store writes for an item in `state`/ that was claimed once."""
    processing, done = state == "processing", state == "done"
    return encode(Item(
        id=ITEM_ID, queue="jobs", status="finished" if done else state, attempts=1, claimed_at=NOW + 1,
        lease_expires_at=NOW + 61 if processing else None, finished_at=NOW + 2 if done else None,
        payload={"n": 1}, result="ok" if done else None, claim_token="from-the-file" if processing else None,
        run_at=NOW + 30 if state == "scheduled" else None,
    ))


CLAIM = encode_claim(Item(id=ITEM_ID, queue="jobs", status="processing", attempts=3, claimed_at=NOW + 10,
                          lease_expires_at=NOW + 70, claim_token="from-the-record"))


@pytest.mark.parametrize("state", [*STATES, "done"])
def test_without_a_claim_record_the_file_says_it_all(state):
    item = decode(_file(state), state=state, queue="jobs", item_id=ITEM_ID)
    processing = state == "processing"
    assert (item.status, item.attempts, item.claimed_at) == ("finished" if state == "done" else state, 1, NOW + 1)
    assert (item.lease_expires_at, item.claim_token) == ((NOW + 61, "from-the-file") if processing else (None, None))


@pytest.mark.parametrize("state", STATES)
def test_a_claim_record_overrides_attempts_and_claim_time_and_while_processing_lease_and_token(state):
    item = decode(_file(state), state=state, queue="jobs", item_id=ITEM_ID, claim=CLAIM)
    processing = state == "processing"
    assert (item.status, item.attempts, item.claimed_at, item.payload) == (state, 3, NOW + 10, {"n": 1})
    assert (item.lease_expires_at, item.claim_token) == ((NOW + 70, "from-the-record") if processing else (None, None))


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("record", [b"garbage", b"1 2 3", b"x 1.0 2.0 token", b"1 1.0 later token", b"\xff 1.0 2.0 token"])
def test_a_claim_record_that_does_not_parse_makes_the_file_unreadable(state, record):
    with pytest.raises(Unreadable, match="claim record"):
        decode(_file(state), state=state, queue="jobs", item_id=ITEM_ID, claim=record)
