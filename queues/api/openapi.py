"""The OpenAPI 3.1 description of the API, served at `/api/schema`. A test checks that every
route of the router is described here and nothing else is."""

from ..models import DAY, MAX_ATTEMPTS, MAX_QUEUE_SECONDS
from ..protocol import (
    MAX_CLAIM,
    MAX_HTTP_WAIT_SECONDS,
    MAX_LEASE_SECONDS,
    MAX_POST_DELAY_SECONDS,
    MAX_RELEASE_DELAY_SECONDS,
)
from ..store import MAX_BATCH
from ..store.keys import MAX_KEY_LENGTH

TIMESTAMP = {"type": ["string", "null"], "format": "date-time", "examples": ["2026-11-30T14:23:53.120Z"]}
QUEUE_PARAM = {
    "name": "queue",
    "in": "path",
    "required": True,
    "description": "A queue name (`^[a-z0-9][a-z0-9_-]{0,63}$`); any other name is answered 404 `unknown_queue`.",
    "schema": {"type": "string"},
}
ID_PARAM = {
    "name": "item_id",
    "in": "path",
    "required": True,
    "description": "An item id (UUIDv7 text); anything else is answered 404 `not_found`.",
    "schema": {"type": "string", "format": "uuid"},
}
ERROR_CODES = [
    "invalid_json", "invalid_request", "unauthorized", "forbidden", "unknown_queue", "not_found",
    "method_not_allowed", "not_held", "not_ended", "key_conflict", "payload_too_large", "storage_unavailable",
    "busy", "internal_error",
]
ERROR_TEXT = {
    400: "`invalid_json`: the body is not JSON; `invalid_request`: a field or parameter has the wrong "
    "type, is missing, unknown or out of range.",
    401: "`unauthorized`: no token, or an unknown one.",
    403: "`forbidden`: the token lacks the right this call needs, or its queue list leaves this queue "
    "out (answered so whether or not the queue exists).",
    404: "`unknown_queue`: no such queue (or a name that breaks the rule); `not_found`: no such item "
    "(or an id that is not one).",
    409: "`not_held`: the item is not processing; `not_ended`: a retry of an item that has not ended.",
    413: "`payload_too_large`: the body is over TASKHOSTER_MAX_BODY_BYTES, or a payload or result over "
    "TASKHOSTER_MAX_PAYLOAD_BYTES.",
    503: "`storage_unavailable`: the data directory cannot be written, the database does not answer, or "
    "(posts only) the disk's free space is below TASKHOSTER_MIN_FREE_BYTES; `busy`: the server is receiving too "
    "many request bodies at once, try again after `Retry-After` seconds.",
    500: "`internal_error`: an unexpected fault of the server, logged with its traceback.",
}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict:
    return {str(status): {"$ref": f"#/components/responses/Error{status}"} for status in statuses}


def _body(schema: dict, *, required: bool = True) -> dict:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


STATES = ("scheduled", "pending", "processing", "finished", "failed")
ITEM = {
    "type": "object",
    "required": ["id", "queue", "status", "attempts", "postedAt", "claimedAt", "leaseExpiresAt", "finishedAt"],
    "properties": {
        "id": {"type": "string", "format": "uuid", "description": "UUIDv7: time-ordered."},
        "queue": {"type": "string"},
        "status": {"type": "string", "enum": ["scheduled", "pending", "processing", "finished", "failed"]},
        "attempts": {"type": "integer", "minimum": 0, "description": "How many times it was claimed."},
        "postedAt": {**TIMESTAMP, "type": "string"},
        "claimedAt": {**TIMESTAMP, "description": "The latest claim; null before the first."},
        "leaseExpiresAt": {**TIMESTAMP, "description": "Set only while processing."},
        "finishedAt": TIMESTAMP,
        "result": {"description": "Present on finished items: any JSON value."},
        "error": {
            "type": "string",
            "enum": ["timeout", "max_attempts", "canceled"],
            "description": "Present on failed items: the failure the server declared.",
        },
        "runAt": {**TIMESTAMP, "type": "string", "description": "Present on an item posted or released for later."},
        "lastError": {"description": "Present once a release gave an `error`: what it said (any JSON)."},
        "retryOf": {"type": "string", "format": "uuid", "description": "Present on a retry: the item it retries."},
        "retriedAs": {"type": "string", "format": "uuid", "description": "Present on a retried item: its retry."},
        "key": {"type": "string", "description": "Present on an item posted with an idempotency key: the key."},
        "duplicate": {
            "type": "boolean",
            "enum": [True],
            "description": "In a batch's answer: this item was made by an earlier post with the same key.",
        },
        "maxAttempts": {
            "type": ["integer", "null"],
            "description": "In claim answers: the queue's limit on claims of an item (null: none).",
        },
        "payload": {"description": "In claim answers, and in a read only with `?payload=1`."},
    },
}
KEY = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_KEY_LENGTH,
    "pattern": "^[ -~]+$",
    "description": (
        "Idempotency key: while an item posted with it exists, a post with it stores nothing and answers "
        "that item (another payload: 409 key_conflict)."
    ),
}
SCHEDULE = {
    "delay": {"type": "number", "minimum": 0, "maximum": MAX_POST_DELAY_SECONDS, "description": "Due this many seconds from now."},
    "runAt": {"type": "string", "format": "date-time", "description": "Due then; an explicit offset is required."},
}
QUEUE = {
    "type": "object",
    "required": [
        "name", "leaseSeconds", "queueSeconds", "retainSeconds", "retainFrom", "paused", "maxAttempts", "counts",
        "oldestPendingAgeSeconds",
    ],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]{0,63}$"},
        "leaseSeconds": {"type": "integer", "minimum": 1, "maximum": DAY},
        "queueSeconds": {"type": "integer", "minimum": 1, "maximum": MAX_QUEUE_SECONDS},
        "retainSeconds": {"type": "integer", "minimum": 0, "maximum": MAX_QUEUE_SECONDS},
        "retainFrom": {"type": "string", "enum": ["finished", "fetched"]},
        "paused": {"type": "boolean"},
        "maxAttempts": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_ATTEMPTS},
        "counts": {
            "type": "object",
            "required": list(STATES),
            "properties": {state: {"type": "integer", "minimum": 0} for state in STATES},
        },
        "oldestPendingAgeSeconds": {"type": ["number", "null"], "minimum": 0},
    },
}
ERROR = {
    "type": "object",
    "required": ["error", "message"],
    "properties": {"error": {"type": "string", "enum": ERROR_CODES}, "message": {"type": "string"}},
}
POST = {
    "oneOf": [
        {
            "type": "object",
            "required": ["payload"],
            "additionalProperties": False,
            "properties": {"payload": {"description": "Any JSON value."}, **SCHEDULE, "key": KEY},
        },
        {
            "type": "object",
            "required": ["items"],
            "additionalProperties": False,
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_BATCH,
                    "items": {
                        "type": "object",
                        "required": ["payload"],
                        "additionalProperties": False,
                        "properties": {"payload": {}, **SCHEDULE, "key": KEY},
                    },
                }
            },
        },
    ]
}
ITEMS = {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": _ref("Item")}}}

DOCUMENT = {
    "openapi": "3.1.0",
    "info": {
        "title": "Taskhoster API",
        "version": "1",
        "description": (
            "Producers post items and read their results; HTTP workers claim items, hand in results "
            "and extend leases. Every call but `/healthz` and `/api/schema` needs "
            "`Authorization: Bearer <token>`. Producer calls need the produce right and worker "
            "calls the work right; the queue stats and the queue list take either right, since "
            "both producers and workers watch queue depth. A token limited to a list of queues "
            "gets 403 `forbidden` for any other queue, whether or not it exists. Errors are always "
            '`{"error": CODE, "message": TEXT}`; a path under `/api/` that matches no call is 404 '
            "`not_found`, and a known path called with another method is 405 `method_not_allowed`. "
            "A JSON body nested deeper than 128 levels is refused with 400."
        ),
    },
    "servers": [{"url": "/"}],
    "security": [{"bearerToken": []}],
    "paths": {
        "/healthz": {
            "get": {
                "operationId": "health",
                "summary": (
                    "Whether the database answers, the data directory is writable and the store's thread takes a call."
                ),
                "security": [],
                "responses": {
                    "200": _json(
                        {"type": "object", "required": ["ok"], "properties": {"ok": {"const": True}}}, "Healthy."
                    ),
                    "503": _json(
                        {
                            "type": "object",
                            "required": ["ok", "database", "dataDirectory", "storeThread"],
                            "properties": {
                                "ok": {"const": False},
                                "database": {"type": "boolean"},
                                "dataDirectory": {"type": "boolean"},
                                "storeThread": {"type": "boolean"},
                            },
                        },
                        "The database, the data directory or the store's thread fails or does not answer in time.",
                    ),
                },
            }
        },
        "/api/schema": {
            "get": {
                "operationId": "schema",
                "summary": "This document.",
                "security": [],
                "responses": {"200": _json({"type": "object"}, "The OpenAPI document.")},
            }
        },
        "/api/queues": {
            "get": {
                "operationId": "listQueues",
                "summary": "Every queue the token may see (produce or work right), with its counts.",
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["queues"],
                            "properties": {"queues": {"type": "array", "items": _ref("Queue")}},
                        },
                        "The queues, by name.",
                    ),
                    **_errors(401),
                },
            }
        },
        "/api/queues/{queue}": {
            "parameters": [QUEUE_PARAM],
            "get": {
                "operationId": "queueStats",
                "summary": "One queue's settings and counts (produce or work right).",
                "responses": {"200": _json(_ref("Queue"), "The queue."), **_errors(401, 403, 404)},
            },
        },
        "/api/queues/{queue}/items": {
            "parameters": [QUEUE_PARAM],
            "post": {
                "operationId": "postItems",
                "summary": (
                    f"Post one item, or a batch of 1 to {MAX_BATCH} (all or nothing). Produce right. An item with `delay` "
                    "or `runAt` (not both) is scheduled: pending once due, which must be before it ages out. "
                    "A single post's idempotency key may come in the `Idempotency-Key` header or its `key`."
                ),
                "parameters": [
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": False,
                        "schema": KEY,
                        "description": "The key of a single post (a batch gives each item its own `key`).",
                    }
                ],
                "requestBody": _body(_ref("Post")),
                "responses": {
                    "201": _json(
                        {"oneOf": [_ref("Item"), _ref("Items")]}, 'The item, or `{"items": [...]}` for a batch.'
                    ),
                    "200": _json(_ref("Item"), "A single post whose key an existing item holds: that item, as it is now."),
                    **_errors(400, 401, 403, 404, 409, 413, 503),
                },
            },
        },
        "/api/queues/{queue}/items/{item_id}": {
            "parameters": [QUEUE_PARAM, ID_PARAM],
            "get": {
                "operationId": "readItem",
                "summary": "Read an item (produce right); the first answer showing it terminal counts as its fetch.",
                "parameters": [
                    {
                        "name": "wait",
                        "in": "query",
                        "description": "Hold the answer up to this many seconds until the item is terminal.",
                        "schema": {"type": "number", "minimum": 0, "maximum": MAX_HTTP_WAIT_SECONDS, "default": 0},
                    },
                    {
                        "name": "payload",
                        "in": "query",
                        "description": "1 to include the payload.",
                        "schema": {"type": "string", "enum": ["0", "1", "true", "false"], "default": "0"},
                    },
                ],
                "responses": {"200": _json(_ref("Item"), "The item."), **_errors(400, 401, 403, 404, 503)},
            },
        },
        "/api/queues/{queue}/claim": {
            "parameters": [QUEUE_PARAM],
            "post": {
                "operationId": "claimItems",
                "summary": "Claim up to `max` items, waiting up to `wait` seconds for at least one. Work right.",
                "requestBody": _body(
                    {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "max": {"type": "integer", "minimum": 1, "maximum": MAX_CLAIM, "default": 1},
                            "wait": {"type": "number", "minimum": 0, "maximum": MAX_HTTP_WAIT_SECONDS, "default": 0},
                        },
                    },
                    required=False,
                ),
                "responses": {
                    "200": _json(_ref("Items"), "The claimed items, with payloads; `[]` if none came in time."),
                    **_errors(400, 401, 403, 404, 413, 503),
                },
            },
        },
        "/api/queues/{queue}/items/{item_id}/result": {
            "parameters": [QUEUE_PARAM, ID_PARAM],
            "post": {
                "operationId": "handInResult",
                "summary": "Hand in a result: the first for an item that is not terminal wins. Work right.",
                "requestBody": _body(
                    {
                        "type": "object",
                        "required": ["result"],
                        "additionalProperties": False,
                        "properties": {"result": {"description": "Any JSON value."}},
                    }
                ),
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["id", "accepted", "status"],
                            "properties": {
                                "id": {"type": "string"},
                                "accepted": {"type": "boolean"},
                                "status": {"type": "string", "enum": ["finished", "failed"]},
                            },
                        },
                        "Whether this result was the one kept.",
                    ),
                    **_errors(400, 401, 403, 404, 413, 503),
                },
            },
        },
        "/api/queues/{queue}/items/{item_id}/extend": {
            "parameters": [QUEUE_PARAM, ID_PARAM],
            "post": {
                "operationId": "extendLease",
                "summary": "Set a processing item's lease to end `seconds` from now. Work right.",
                "requestBody": _body(
                    {
                        "type": "object",
                        "required": ["seconds"],
                        "additionalProperties": False,
                        "properties": {"seconds": {"type": "number", "minimum": 1, "maximum": MAX_LEASE_SECONDS}},
                    }
                ),
                "responses": {
                    "200": _json(_ref("Item"), "The item with its new `leaseExpiresAt`."),
                    **_errors(400, 401, 403, 404, 409, 413, 503),
                },
            },
        },
        "/api/queues/{queue}/items/{item_id}/release": {
            "parameters": [QUEUE_PARAM, ID_PARAM],
            "post": {
                "operationId": "releaseItem",
                "summary": (
                    "Give a processing item back: pending now, or scheduled after `delay` seconds; `error` is kept "
                    "as its `lastError`. At the queue's maxAttempts it ends failed `max_attempts`. Work right."
                ),
                "requestBody": _body(
                    {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "delay": {"type": "number", "minimum": 0, "maximum": MAX_RELEASE_DELAY_SECONDS, "default": 0},
                            "error": {"description": "Any JSON value, at most the payload size limit."},
                        },
                    },
                    required=False,
                ),
                "responses": {
                    "200": _json(_ref("Item"), "The item as it is now."),
                    **_errors(400, 401, 403, 404, 409, 413, 503),
                },
            },
        },
        "/api/queues/{queue}/items/{item_id}/retry": {
            "parameters": [QUEUE_PARAM, ID_PARAM],
            "post": {
                "operationId": "retryItem",
                "summary": "Post a finished or failed item again as a new item (`retryOf`). Produce right.",
                "requestBody": _body({"type": "object", "additionalProperties": False}, required=False),
                "responses": {
                    "201": _json(_ref("Item"), "The new item."),
                    "200": _json(_ref("Item"), "The new item made by an earlier retry, as it is now."),
                    **_errors(400, 401, 403, 404, 409, 503),
                },
            },
        },
        "/api/queues/{queue}/items/{item_id}/cancel": {
            "parameters": [QUEUE_PARAM, ID_PARAM],
            "post": {
                "operationId": "cancelItem",
                "summary": (
                    "End a scheduled, pending or processing item at once, failed `canceled` (a socket holding it "
                    "is told). Produce right."
                ),
                "requestBody": _body({"type": "object", "additionalProperties": False}, required=False),
                "responses": {
                    "200": _json(
                        {"allOf": [_ref("Item"), {"type": "object", "required": ["canceled"],
                                                  "properties": {"canceled": {"type": "boolean"}}}]},
                        "The item; `canceled` false if it had ended already, unchanged.",
                    ),
                    **_errors(400, 401, 403, 404, 503),
                },
            },
        },
    },
    "components": {
        "securitySchemes": {
            "bearerToken": {"type": "http", "scheme": "bearer", "description": "`th_` + 32 characters."}
        },
        "schemas": {"Item": ITEM, "Items": ITEMS, "Queue": QUEUE, "Error": ERROR, "Post": POST},
        "responses": {
            f"Error{status}": _json(_ref("Error"), text) for status, text in ERROR_TEXT.items()
        },
    },
}
