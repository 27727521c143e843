"""Request parsing and response shapes of ``kvroute sim-worker`` (SGLang, OpenAI, vLLM).

Pure functions from an engine ``Run`` (``sim.engine``) to the JSON bodies and SSE frames
the real servers send, so ``sim.worker`` only wires routes to the engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from kvroute.errors import BadRequestError
from kvroute.sim.engine import Run, SimConfig, filler_ids, filler_text

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def read_body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise BadRequestError(f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object")
    return body


def max_tokens(body: dict[str, Any], keys: Sequence[str], default: int) -> int:
    """The first of ``keys`` set in ``body`` (at least 1), else ``default``."""
    for k in keys:
        v = body.get(k)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise BadRequestError(f"'{k}' must be a non-negative integer")
            return max(v, 1)
    return default


# ------------------------------------------------------------------ introspection


def model_info(c: SimConfig) -> dict[str, Any]:
    return {"model_path": c.model, "tokenizer_path": c.tokenizer, "is_generation": True}


def server_info(c: SimConfig) -> dict[str, Any]:
    # SGLang's shape: the server arguments (``max_running_requests`` as if set on the
    # command line), then per data-parallel rank the scheduler's state, whose
    # ``effective_max_running_requests_per_dp`` is what it runs at once.
    running = c.cost.max_batch if c.reports_max_running else None
    state: dict[str, Any] = {"last_gen_throughput": 0.0}
    if running is not None:
        state["effective_max_running_requests_per_dp"] = running
    return {
        "model_path": c.model,
        "tokenizer_path": c.tokenizer,
        "page_size": c.block_size,
        "max_total_num_tokens": c.capacity_tokens,
        "max_running_requests": running,
        "dp_size": 1,
        "internal_states": [state],
        "context_length": c.max_model_len,
        "time_scale": c.time_scale,
        "prefill_tokens_per_s": c.cost.prefill_tokens_per_s,
        "decode_s_per_token": c.cost.decode_s_per_token,
        "text_codec": c.text_codec,
        "version": "kvroute-sim",
        # SGLang's ServerArgs names for what `kvroute doctor` checks.
        "disable_radix_cache": not c.prefix_caching,
        "kv_events_config": (
            orjson.dumps(_kv_events_config(c)).decode() if c.kv_events_endpoint else None
        ),
        "enable_metrics": True,
    }


def _kv_events_config(c: SimConfig) -> dict[str, Any]:
    return {
        "publisher": "zmq",
        "endpoint": c.kv_events_endpoint,
        "replay_endpoint": c.kv_events_replay_endpoint,
        "topic": c.kv_events_topic,
    }


def kv_event_sources(c: SimConfig) -> dict[str, Any]:
    """vLLM's ``GET /kv_event_sources``: the publisher's configuration per data-parallel
    rank (one here), ``{}`` with events off."""
    if not c.kv_events_endpoint:
        return {}
    return {"0": {"enable_kv_cache_events": True, **_kv_events_config(c)}}


def models(c: SimConfig, adapters: Sequence[str] = ()) -> dict[str, Any]:
    model = {
        "id": c.model,
        "object": "model",
        "created": 0,
        "owned_by": "kvroute-sim",
        "root": c.model,
        "parent": None,
        "max_model_len": c.max_model_len,
    }
    entries: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "kvroute-sim",
            "root": f"/adapters/{name}",
            "parent": c.model,
            "max_model_len": c.max_model_len,
        }
        for name in adapters
    ]
    return {"object": "list", "data": [model, *entries]}


def rendered(
    body: dict[str, Any], ids: Sequence[int], prefix: str, text: str, model: str
) -> dict[str, Any]:
    """vLLM's GenerateRequest (what ``/render`` returns); ``prompt_token_ids`` and
    ``prompt`` as older vLLM versions named them."""
    return {
        "request_id": prefix + uuid.uuid4().hex,
        "token_ids": list(ids),
        "prompt_token_ids": list(ids),
        "prompt": text,
        "model": body.get("model") or model,
        "sampling_params": {
            k: body[k] for k in ("max_tokens", "temperature", "top_p") if k in body
        },
        "stream": bool(body.get("stream", False)),
        "stream_options": body.get("stream_options"),
        "token_offsets": None,
    }


# ------------------------------------------------------------------ generation


def usage(run: Run) -> dict[str, Any]:
    return {
        "prompt_tokens": run.prompt_tokens,
        "completion_tokens": run.output_tokens,
        "total_tokens": run.prompt_tokens + run.output_tokens,
        "prompt_tokens_details": {"cached_tokens": run.cached_tokens},
    }


def sglang_payload(run: Run) -> dict[str, Any]:
    """SGLang ``/generate``: the text so far (cumulative when streamed) and meta_info."""
    finish = {"type": "length", "length": run.output_tokens} if run.finished else None
    return {
        "text": filler_text(0, run.output_tokens),
        "output_ids": filler_ids(run.output_tokens),
        "meta_info": {
            "id": run.rid,
            "prompt_tokens": run.prompt_tokens,
            "completion_tokens": run.output_tokens,
            "cached_tokens": run.cached_tokens,
            "finish_reason": finish,
            "e2e_latency": run.e2e_s,
            "ttft": run.ttft_s,
        },
    }


class OpenAIShape:
    """Bodies and SSE chunks of one ``/v1/completions`` or ``/v1/chat/completions`` call."""

    def __init__(self, run: Run, chat: bool, model: str, created: int) -> None:
        self.run = run
        self.chat = chat
        self.model = model
        self.created = created
        self.id = ("chatcmpl-" if chat else "cmpl-") + run.rid
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def response(self) -> dict[str, Any]:
        text = filler_text(0, self.run.output_tokens)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(self.run),
        }

    def _frame(self, choices: list[dict[str, Any]], use: dict[str, Any] | None) -> bytes:
        return sse(
            {
                "id": self.id,
                "object": self.chunk_object,
                "created": self.created,
                "model": self.model,
                "choices": choices,
                "usage": use,
            }
        )

    def chunk(self, start: int, stop: int) -> bytes:
        """Output tokens ``start:stop``; the first chunk carries the assistant role."""
        text = filler_text(start, stop)
        finish = "length" if stop >= self.run.output_len else None
        c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            c["delta"] = {"role": "assistant", "content": text} if start == 0 else {"content": text}
        else:
            c["text"] = text
        return self._frame([c], None)

    def usage_chunk(self) -> bytes:
        return self._frame([], usage(self.run))
