"""A tiny recording worker for router tests: ``python tests/fake_worker.py --port P``.

It records every inference body it receives (GET /records), answers OpenAI/SGLang
shapes (and, for the routes the router passes through untouched: embeddings, tokenize,
score, rerank, audio..., a small JSON answer naming the worker, the path and the body's
SHA-256), streams SSE chunk by chunk, and can be told to misbehave through
``POST /control`` {"mode": "ok" | "error" | "hang" | "garbage" | "truncate" | "die_mid_stream",
"status": int, "delay_s": float}.

``--kv-blocks N`` makes ``/metrics`` report a KV capacity the way vLLM does (the labels
of ``vllm:cache_config_info``, block size 16); ``--max-total-tokens N`` makes
``/get_server_info`` report one the way SGLang does. Without them both answer 404.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

STATE: dict[str, Any] = {
    "mode": "ok",
    "status": 500,
    "delay_s": 0.0,
    "records": [],
    "name": "",
    "chunks": 5,
}


def sse_chunks(n: int, final: dict[str, Any]) -> list[bytes]:
    out = [
        b"data: "
        + orjson.dumps(
            {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
        )
        + b"\n\n"
        for i in range(n)
    ]
    out.append(b"data: " + orjson.dumps(final) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


PASSTHROUGH_PATHS = (
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
)


async def infer(request: Request) -> Response:
    body = await request.body()
    sha = hashlib.sha256(body).hexdigest()
    STATE["records"].append(
        {
            "path": request.url.path,
            "body": body.decode(errors="replace"),
            "sha256": sha,
            "headers": dict(request.headers),
        }
    )
    mode = STATE["mode"]
    if STATE["delay_s"]:
        await asyncio.sleep(STATE["delay_s"])
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "error":
        return JSONResponse(
            {
                "error": {
                    "message": "worker says no",
                    "type": "server_error",
                    "code": STATE["status"],
                }
            },
            status_code=STATE["status"],
        )
    if mode == "garbage":
        return Response(b"\x00not json at all", media_type="application/json")
    if mode == "die":
        os._exit(1)
    if request.url.path in PASSTHROUGH_PATHS:
        return JSONResponse({"worker": STATE["name"], "path": request.url.path, "sha256": sha})
    obj = orjson.loads(body)
    usage = {
        "prompt_tokens": 3,
        "completion_tokens": STATE["chunks"],
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    final = {
        "id": "x",
        "object": "text_completion",
        "choices": [],
        "usage": usage,
        "worker": STATE["name"],
    }
    if obj.get("stream"):
        chunks = sse_chunks(STATE["chunks"], final)

        async def gen() -> Any:
            for i, c in enumerate(chunks):
                if mode == "die_mid_stream" and i == 2:
                    os._exit(1)
                if mode == "truncate" and i == 2:
                    yield b'data: {"trunc'
                    return
                yield c
                await asyncio.sleep(float(STATE.get("chunk_delay_s", 0.01)))

        return StreamingResponse(gen(), media_type="text/event-stream")
    return JSONResponse(
        {
            "id": "x",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}],
            "usage": usage,
            "worker": STATE["name"],
        }
    )


async def records(request: Request) -> Response:
    return JSONResponse(STATE["records"])


async def control(request: Request) -> Response:
    STATE.update(orjson.loads(await request.body()))
    if STATE.pop("clear", False):
        STATE["records"] = []
    return JSONResponse({"ok": True})


async def health(request: Request) -> Response:
    if STATE["mode"] in ("hang_health",):
        await asyncio.sleep(3600)
    return JSONResponse({"status": "ok"})


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


# Recorded shape of vLLM's cache config gauge (v0.11, CPU backend), blocks filled in.
VLLM_CACHE_CONFIG = (
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",'
    'cpu_offload_gb="0",enable_prefix_caching="True",gpu_memory_utilization="0.9",'
    'is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="%d",'
    'num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",'
    'swap_space="4",swap_space_bytes="4294967296"} 1.0\n'
)


async def metrics(request: Request) -> Response:
    if not STATE.get("kv_blocks"):
        return Response(status_code=404)
    text = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    text += "# TYPE vllm:cache_config_info gauge\n" + VLLM_CACHE_CONFIG % STATE["kv_blocks"]
    return Response(text, media_type="text/plain; version=0.0.4")


async def server_info(request: Request) -> Response:
    if not STATE.get("max_total_tokens"):
        return Response(status_code=404)
    return JSONResponse({"max_total_num_tokens": STATE["max_total_tokens"], "page_size": 1})


async def flush(request: Request) -> Response:
    STATE["flushed"] = STATE.get("flushed", 0) + 1
    return JSONResponse({"ok": True})


app = Starlette(
    routes=[
        Route("/v1/completions", infer, methods=["POST"]),
        Route("/v1/chat/completions", infer, methods=["POST"]),
        Route("/generate", infer, methods=["POST"]),
        Route("/v1/responses", infer, methods=["POST"]),
        *(Route(p, infer, methods=["POST"]) for p in PASSTHROUGH_PATHS),
        Route("/records", records),
        Route("/control", control, methods=["POST"]),
        Route("/health", health),
        Route("/v1/models", models),
        Route("/flush_cache", flush, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/get_server_info", server_info),
    ]
)

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--kv-blocks", type=int, default=0)
    ap.add_argument("--max-total-tokens", type=int, default=0)
    args = ap.parse_args()
    STATE["kv_blocks"], STATE["max_total_tokens"] = args.kv_blocks, args.max_total_tokens
    STATE["name"] = f"127.0.0.1:{args.port}"
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, log_level="warning", loop="uvloop", http="httptools"
    )
