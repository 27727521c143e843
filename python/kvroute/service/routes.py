"""The one table of proxied routes: which client paths go to the workers, and how.

Two ways through the router:

* **Indexed** (chat, completions, SGLang's generate, the Responses API): the prompt is
  tokenized, the policy picks the worker (cache-aware by default) and the index learns
  the prompt. ``/v1/responses`` is routed like chat: its ``instructions`` and ``input``
  (a string or a list of message items) are read as chat messages for the index, while
  the body goes to the worker untouched.
* **Pass-through** (embeddings, tokenize/detokenize, score/rerank, pooling, classify,
  audio): the work is one forward pass or none, so there is no prefix cache worth
  following; the request goes to the healthy worker with the fewest requests in flight
  (among those serving the body's ``model``, see ``kvroute.fleet.models``), its body and
  content type (multipart for audio) byte for byte.

Paths not listed here are the router's own or answer 404.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from kvroute.errors import BadRequestError


class Route(NamedTuple):
    kind: str  # the request kind in metrics and logs
    worker_path: str  # where the request goes on the worker
    indexed: bool  # tokenized and routed by the policy (else: least load, body untouched)


def _passthrough(path: str, kind: str) -> tuple[str, Route]:
    return path, Route(kind, path, False)


ROUTES: dict[str, Route] = {
    "/v1/chat/completions": Route("chat", "/v1/chat/completions", True),
    "/v1/completions": Route("completions", "/v1/completions", True),
    "/generate": Route("generate", "/generate", True),
    "/v1/responses": Route("responses", "/v1/responses", True),
    **dict(
        (
            _passthrough("/v1/embeddings", "embeddings"),
            _passthrough("/tokenize", "tokenize"),
            _passthrough("/detokenize", "detokenize"),
            _passthrough("/pooling", "pooling"),
            _passthrough("/classify", "classify"),
            _passthrough("/score", "score"),
            _passthrough("/v1/score", "score"),
            _passthrough("/rerank", "rerank"),
            _passthrough("/v1/rerank", "rerank"),
            _passthrough("/v2/rerank", "rerank"),
            _passthrough("/v1/audio/transcriptions", "transcriptions"),
            _passthrough("/v1/audio/translations", "translations"),
        )
    ),
}

PASSTHROUGH_KINDS = frozenset(r.kind for r in ROUTES.values() if not r.indexed)


def _item_message(item: Any) -> dict[str, Any] | None:
    """A Responses ``input`` item as a chat message: messages as they are, a tool's
    output as a tool message, None for the rest (function calls, reasoning)."""
    if not isinstance(item, dict):
        return None
    if item.get("type") == "function_call_output" and isinstance(item.get("output"), str):
        return {"role": "tool", "content": item["output"]}
    if item.get("type", "message") != "message" or not isinstance(item.get("role"), str):
        return None
    content = item.get("content")
    if isinstance(content, list):  # input_text / output_text parts all carry "text"
        content = [p for p in content if isinstance(p, dict)]
    return {"role": item["role"], "content": content}


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The Responses API body as the chat body the index sees: ``instructions`` as a
    system message, then ``input`` (a string is one user message). Other fields (tools,
    chat_template_kwargs) are kept, so the template renders as the engine does. An input
    with no item to render still routes: on its JSON text, the same for the same input."""
    given = body.get("input")
    if not isinstance(given, str | list) or not given:
        raise BadRequestError("'input' must be a non-empty string or list of input items")
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    else:
        items = [m for m in map(_item_message, given) if m is not None]
        messages.extend(items or [{"role": "user", "content": orjson.dumps(given).decode()}])
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    chat["messages"] = messages
    return chat


def for_index(kind: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The kind and body the tokenizer reads for an indexed request."""
    if kind == "responses":
        return "chat", responses_as_chat(body)
    return kind, body
