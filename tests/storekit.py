"""Short ways for tests to make one store transition at a time (the store's own methods take
batches: one result or one release is a batch of one)."""

from queues.store import FinishOutcome, Item, NewItem, QueueConfig, Release, Store, single


def post_batch(store: Store, queue: str, payloads: list, **settings) -> list[Item]:
    """Post these payloads as one batch to a queue with these settings (the defaults otherwise)."""
    posted = store.post_items(config=QueueConfig(name=queue, **settings), items=[NewItem(p) for p in payloads])
    return [entry.item for entry in posted]


def post(store: Store, queue: str, *payloads) -> list[str]:
    return [item.id for item in post_batch(store, queue, list(payloads) or [{"n": 1}])]


def finish(store: Store, config: QueueConfig, item_id: str, result) -> FinishOutcome:
    return single(store.finish_items(results=[(config, item_id, result)]))


def release(store: Store, queue: str | QueueConfig, item_id: str, claim_token: str | None = None, **options) -> Item:
    config = queue if isinstance(queue, QueueConfig) else QueueConfig(name=queue)
    return single(store.release_items(releases=[Release(config, item_id, claim_token, **options)]))
