"""Short ways for tests to make one store transition at a time (the store's own methods take
batches: one result or one release is a batch of one)."""

from queues.store import Claim, FinishOutcome, Item, QueueConfig, Store, single


def finish(store: Store, config: QueueConfig, item_id: str, result) -> FinishOutcome:
    return single(store.finish_items(results=[(config, item_id, result)]))


def release(store: Store, queue: str, item_id: str, claim_token: str | None = None) -> Item:
    return single(store.release_items(claims=[Claim(queue, item_id, claim_token)]))


def post(store: Store, queue: str, *payloads) -> list[str]:
    return [item.id for item in store.post_items(queue=queue, payloads=list(payloads) or [{"n": 1}])]
