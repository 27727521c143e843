"""The OpenAPI description of the router's routes: what it reads, what it answers.

Request bodies describe exactly the fields the router reads and checks (the prompt in
each of its accepted shapes); every other field is allowed and reaches the worker
unchanged. Fields the router only peeks at (``stream``, ``max_tokens``, ``user``) are
described without a type, because the router does not reject other values: the worker
does. Responses list every status the router itself can answer, with its content
types; an inference route also passes the worker's own answer through unchanged, which
is what ``default`` stands for. ``tests/service/test_openapi.py`` holds the router to
this with schemathesis.
"""

from __future__ import annotations

from typing import Any

from kvroute.routing.prompts import MAX_TOKEN_ID

JSON = "application/json"
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": ["string", "integer", "null"]},
                "param": {"type": ["string", "null"]},
            },
        }
    },
}
TOKENS = {
    "type": "array",
    "minItems": 1,
    "description": "token IDs: integers (no booleans) within the tokenizer's vocabulary",
    "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
}
TEXT = {"type": "string", "minLength": 1}
# A batch: every prompt is checked (all texts or all token lists); the first is routed on.
TEXT_BATCH = {"type": "array", "minItems": 1, "items": TEXT}
TOKENS_BATCH = {"type": "array", "minItems": 1, "items": TOKENS}
PROMPT = {
    "description": "A text, token IDs, or a batch of either (the first item is routed on).",
    "oneOf": [TEXT, TOKENS, TEXT_BATCH, TOKENS_BATCH],
}
PEEKED = {
    "model": {"description": "only workers serving this model are tried (404 if none does)"},
    "cache_salt": {"description": "the request's cache partition (with its LoRA adapter)"},
    "stream": {"description": "true: the answer streams as server-sent events"},
    "max_tokens": {"description": "output length; sets a non-streamed answer's deadline"},
    "user": {"description": "a string here is a session key for consistent_hash"},
}
CONTENT_PART = {"type": "object", "description": "a content part; 'text' parts are routed on"}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string"},
        "content": {
            "oneOf": [
                {"type": "string"},
                {"type": "null"},
                {"type": "array", "items": CONTENT_PART},
            ]
        },
    },
}
BODIES: dict[str, dict[str, Any]] = {
    "responses": {
        "type": "object",
        "required": ["input"],
        "properties": {
            "input": {
                "description": "a text, or input items (messages are routed on)",
                "oneOf": [TEXT, {"type": "array", "minItems": 1}],
            },
            "instructions": {"description": "a string here is routed on as a system prompt"},
            **PEEKED,
        },
    },
    "chat": {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
            "max_completion_tokens": {"description": "as max_tokens"},
            **PEEKED,
        },
    },
    "completions": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": PROMPT, **PEEKED},
    },
    "generate": {
        "type": "object",
        "description": "SGLang's native API: 'input_ids' when given, else 'text'.",
        "anyOf": [
            {
                "required": ["input_ids"],
                "properties": {"input_ids": {"oneOf": [TOKENS, TOKENS_BATCH]}},
            },
            {
                "required": ["text"],
                "properties": {"text": PROMPT, "input_ids": {"type": "null"}},
            },
        ],
        "properties": {
            "stream": PEEKED["stream"],
            "sampling_params": {"description": "max_new_tokens sets the deadline"},
        },
    },
}


def body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {JSON: {"schema": schema}}}}


def error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": ERROR}}}


def ok(description: str, media: str = JSON, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"description": description, "content": {media: {"schema": schema or {}}}}


Responses = dict[int | str, dict[str, Any]]
UNAUTHORIZED: Responses = {401: error("--api-key is set and the request does not carry it")}
ADMIN: Responses = {
    401: error("the admin key (or, without one, the API key) is set and not sent"),
    403: error(
        "admin endpoints are off (no key and not on loopback), or the worker URL is not "
        "allowed by --worker-url-allow"
    ),
}
INFERENCE: Responses = {
    200: {
        "description": "the worker's answer: JSON, or server-sent events when streamed",
        "content": {JSON: {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}},
    },
    400: error("the body is not JSON, or the prompt is missing, empty or malformed"),
    **UNAUTHORIZED,
    404: error("no worker serves the requested model"),
    413: error("the body is over --max-body-bytes"),
    429: error("the admission queue is full or its wait timed out (Retry-After)"),
    502: error("the request broke the connection to two workers, or is quarantined"),
    503: error("no healthy worker, the router is shutting down, or at --max-connections"),
    504: error("the request outlived --request-timeout-secs"),
    "default": {
        "description": "any other status: the worker's own answer, passed through unchanged",
        "content": {JSON: {"schema": {}}, "*/*": {"schema": {}}},
    },
}
ROUTES: dict[str, Responses] = {
    "models": {200: ok("the models the healthy workers serve"), **UNAUTHORIZED},
    "health": {200: ok("the router is up")},
    "readiness": {
        200: ok("at least one worker is healthy"),
        503: error("no healthy worker"),
    },
    "metrics": {200: ok("Prometheus metrics", "text/plain", {"type": "string"})},
    "status": {200: ok("the status page", "text/html", {"type": "string"}), **UNAUTHORIZED},
    "list_workers": {200: ok("every worker and its state"), **UNAUTHORIZED},
    "add_worker": {
        200: ok("the worker was already known"),
        201: ok("the worker was added; it takes traffic once its first check answers"),
        400: error("the body is not a JSON object, or a bad 'kv_events'"),
        **ADMIN,
        413: error("the body is over 64 KiB"),
        422: error("'url' is not http(s)://host[:port][/path], or 'models' is not a list of names"),
    },
    "remove_worker": {200: ok("the worker was removed"), **ADMIN, 404: error("no such worker")},
    "flush_cache": {200: ok("the workers' caches and the index were flushed"), **ADMIN},
}
ADD_WORKER = {
    "type": "object",
    "required": ["url"],
    "properties": {
        "url": {"type": "string", "description": "http(s)://host[:port][/path]"},
        "kv_events": {"type": "string", "description": "precise mode: the worker's events"},
        "models": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "string", "minLength": 1},
            "description": "the models it serves (base model first, then LoRA adapters), "
            "instead of reading its /v1/models",
        },
    },
}
UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        # Passed to the worker untouched: the router reads nothing of it.
        "content": {"multipart/form-data": {"schema": {}}},
    }
}
