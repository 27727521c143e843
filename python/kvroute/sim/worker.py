"""The HTTP face of ``kvroute sim-worker``: what SGLang and vLLM serve, over ``SimEngine``.

Generation: ``/generate`` (SGLang: ``text`` or ``input_ids``, ``sampling_params``),
``/v1/completions`` and ``/v1/chat/completions`` (OpenAI, streaming SSE or not; cached
prompt tokens in ``usage.prompt_tokens_details.cached_tokens``; usage streamed last when
``stream_options.include_usage``). Prompts become token IDs exactly as the router makes
them (``kvroute.routing.tokenization.PromptTokenizer``): chat template with the generation prompt
when a tokenizer is given, the UTF-8 bytes of the rendered text otherwise (or one token
per character with ``--text-codec codepoints``, see ``sim.textcodec``); token-ID prompts
and ``input_ids`` as given.

Introspection: ``/health``, ``/version`` (vLLM's; says ``kvroute-sim``),
``/get_model_info``, ``/get_server_info``, ``/kv_event_sources`` (vLLM's), ``/v1/models``,
``/get_load``, ``/metrics`` (vLLM names), ``/tokenize``, ``/v1/completions/render`` and
``/v1/chat/completions/render`` (vLLM's shapes: the vLLM router calls them), ``/flush_cache``
and ``/reset_prefix_cache`` (both empty the cache). For benchmarks and tests:
``GET /sim/stats[?log=1]``, ``POST /sim/reset_stats``, ``POST /sim/fault`` with
``{"drop_next_events": n}`` (alias ``drop_next_event_batches``: the next n event batches
are not sent but stay replayable), ``{"reset_seq": true}`` (numbering back to 0) and/or
``{"restart": true}`` (cache emptied silently and numbering back to 0: what a subscriber
sees of an engine restart).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from kvroute.errors import BadRequestError, NotFoundError, RouterError
from kvroute.routing.tokenization import PromptTokenizer
from kvroute.sim import protocol as P
from kvroute.sim.cache import namespace_of
from kvroute.sim.engine import Run, SimConfig, SimEngine
from kvroute.sim.textcodec import CodepointTokenizer, tokens_to_text


def create_app(config: SimConfig) -> FastAPI:
    state: dict[str, Any] = {}
    # Adapters served now (name -> lora_id), changed by the run-time adapter API.
    adapters = {name: i + 1 for i, name in enumerate(config.lora_adapters)}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state["engine"] = SimEngine(config)
        state["tok"] = (
            CodepointTokenizer()
            if config.text_codec == "codepoints"
            else PromptTokenizer(config.tokenizer)
        )
        try:
            yield
        finally:
            state["engine"].close()

    app = FastAPI(title="kvroute sim-worker", lifespan=lifespan)

    def engine() -> SimEngine:
        eng: SimEngine = state["engine"]
        return eng

    def tokenizer() -> PromptTokenizer:
        tok: PromptTokenizer = state["tok"]
        return tok

    @app.exception_handler(RouterError)
    async def _router_error(_request: Request, exc: RouterError) -> Response:
        return exc.response()

    # ------------------------------------------------------------ introspection

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return P.json_response({"version": "kvroute-sim"})

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> Response:
        return P.json_response(P.model_info(config))

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> Response:
        return P.json_response(P.server_info(config))

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> Response:
        return P.json_response(P.kv_event_sources(config))

    @app.get("/v1/models")
    async def models() -> Response:
        return P.json_response(P.models(config, list(adapters)))

    # vLLM's run-time adapter API (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        name = (await P.read_body(request)).get("lora_name")
        if not isinstance(name, str) or not name or name == config.model:
            raise BadRequestError("'lora_name' must name an adapter")
        if name in adapters:
            raise BadRequestError(f"The lora adapter '{name}' has already been loaded.")
        adapters[name] = max(adapters.values(), default=0) + 1
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        name = (await P.read_body(request)).get("lora_name")
        if name not in adapters:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.")
        del adapters[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/get_load")
    async def get_load() -> Response:
        e = engine()
        return P.json_response(
            {
                "load": e.running + e.waiting,
                "num_reqs": e.running,
                "num_waiting_reqs": e.waiting,
                "num_tokens": e.cache.cached_tokens,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(
            engine().metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        n = engine().flush_cache()
        return PlainTextResponse(f"Cache flushed ({n} blocks).\n")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        engine().flush_cache()
        return Response(status_code=200)

    @app.get("/sim/stats")
    async def sim_stats(log: int = 0) -> Response:
        return P.json_response(engine().stats(with_log=bool(log)))

    @app.post("/sim/reset_stats")
    async def sim_reset_stats() -> Response:
        engine().reset_stats()
        return P.json_response({"ok": True})

    @app.post("/sim/fault")
    async def sim_fault(request: Request) -> Response:
        body = await P.read_body(request)
        pub = engine().publisher
        if pub is None:
            raise BadRequestError("KV events are off (no --kv-events-endpoint)")
        for key in ("drop_next_events", "drop_next_event_batches"):
            if body.get(key):
                pub.drop_next(int(body[key]))
        if body.get("reset_seq"):
            pub.reset_seq()
        if body.get("restart"):
            engine().restart()
        return P.json_response({"ok": True, "seq": pub.seq})

    # ------------------------------------------------------------ tokenization

    def _decoded(ids: Sequence[int]) -> str:
        tok = tokenizer()
        if isinstance(tok, CodepointTokenizer):
            return tokens_to_text(ids)
        if tok.uses_bytes:
            return bytes(i for i in ids if i < 256).decode("utf-8", "replace")
        return str(tok._tok.decode(list(ids)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        engine().calls["tokenize"] += 1
        body = await P.read_body(request)
        route = "chat" if "messages" in body else "completions"
        ids = await tokenizer().tokens_for(route, body)
        return P.json_response(
            {
                "count": len(ids),
                "max_model_len": config.max_model_len,
                "tokens": list(ids),
                "token_strs": None,
            }
        )

    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> Response:
        """vLLM: a list with one GenerateRequest per prompt."""
        engine().calls["completions_render"] += 1
        body = await P.read_body(request)
        prompt = body.get("prompt")
        prompts = (
            prompt
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
            else [prompt]
        )
        out = []
        for p in prompts:
            ids = await tokenizer().tokens_for("completions", {"prompt": p})
            text = p if isinstance(p, str) else _decoded(ids)
            out.append(P.rendered(body, ids, "cmpl-", text, config.model))
        return P.json_response(out)

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> Response:
        """vLLM: one GenerateRequest for the templated conversation."""
        engine().calls["chat_render"] += 1
        body = await P.read_body(request)
        ids = await tokenizer().tokens_for("chat", body)
        text = tokenizer().render_chat(body["messages"], body)
        return P.json_response(P.rendered(body, ids, "chatcmpl-", text, config.model))

    # ------------------------------------------------------------ generation

    def _adapter(route: str, body: dict[str, Any]) -> str | None:
        """The request's LoRA adapter (vLLM: its ``model``; SGLang: ``lora_path``); a
        model this worker does not serve is refused with vLLM's 404."""
        if route == "generate":
            lora = body.get("lora_path")
            if lora is not None and lora not in adapters:
                raise NotFoundError(f"The LoRA adapter `{lora}` is not loaded.")
            return lora if isinstance(lora, str) else None
        model = body.get("model")
        if model is None or model == config.model:
            return None
        if model not in adapters:
            raise NotFoundError(f"The model `{model}` does not exist.", code="model_not_found")
        return str(model)

    async def _start(route: str, body: dict[str, Any], out_len: int) -> tuple[Run, Sequence[int]]:
        adapter = _adapter(route, body)
        ids = await tokenizer().tokens_for(route, body)
        if len(ids) > config.max_model_len:
            raise BadRequestError(
                f"prompt of {len(ids)} tokens is longer than max_model_len {config.max_model_len}"
            )
        salt = body.get("cache_salt")
        run = Run(uuid.uuid4().hex, len(ids), out_len)
        run.namespace = namespace_of(adapter, salt if isinstance(salt, str) else None)
        run.lora = (adapters[adapter], adapter) if adapter is not None else None
        return run, ids

    async def _drive(run: Run, ids: Sequence[int]) -> None:
        async with contextlib.aclosing(engine().generate(run, ids, stream=False)) as steps:
            async for _ in steps:
                pass

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await P.read_body(request)
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequestError("'sampling_params' must be an object")
        run, ids = await _start("generate", body, P.max_tokens(params, ["max_new_tokens"], 128))

        if not body.get("stream"):
            await _drive(run, ids)
            return P.json_response(P.sglang_payload(run))

        async def stream() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(engine().generate(run, ids)) as steps:
                async for _ in steps:
                    yield P.sse(P.sglang_payload(run))
            yield P.SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream", headers=P.SSE_HEADERS)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await P.read_body(request)
        return await _openai(body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await P.read_body(request)
        return await _openai(body, chat=True)

    async def _openai(body: dict[str, Any], chat: bool) -> Response:
        keys = ["max_completion_tokens", "max_tokens"] if chat else ["max_tokens"]
        run, ids = await _start(
            "chat" if chat else "completions", body, P.max_tokens(body, keys, 64 if chat else 16)
        )
        model = body.get("model") or config.model
        shape = P.OpenAIShape(run, chat, model, int(time.time()))
        if not body.get("stream"):
            await _drive(run, ids)
            return P.json_response(shape.response())
        opts = body.get("stream_options") or {}
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

        async def stream() -> AsyncIterator[bytes]:
            sent = 0
            async with contextlib.aclosing(engine().generate(run, ids)) as steps:
                async for n in steps:
                    yield shape.chunk(sent, n)
                    sent = n
            if include_usage:
                yield shape.usage_chunk()
            yield P.SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream", headers=P.SSE_HEADERS)

    return app
