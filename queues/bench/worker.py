"""One bench worker process: our client's Worker with a no-op handler, claiming up to
`claim_batch` items at once. It reads TASKHOSTER_URL and TASKHOSTER_TOKEN, prints `warm` each
time it works a warm-up item (so the bench knows it is connected and claiming), and stops on
SIGTERM.

    python -m queues.bench.worker QUEUE CLAIM_BATCH
"""

import sys

from taskhoster import Worker

WARM_UP = "warm-up"  # the payload of a warm-up item
WARM_LINE = "warm"


async def no_op(payload, job):
    if payload == WARM_UP:
        print(WARM_LINE, flush=True)
    return None


def main(argv: list[str]) -> None:
    queue, claim_batch = argv
    Worker(queues=[queue], concurrency=int(claim_batch), grace=5.0).run(no_op)


if __name__ == "__main__":
    main(sys.argv[1:])
