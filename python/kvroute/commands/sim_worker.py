"""``kvroute sim-worker``: a simulated inference server (GPU-free stand-in).

Speaks the SGLang and OpenAI/vLLM APIs, keeps a bounded block prefix cache and answers
after the times of the cost model (``kvroute.sim.cost``, defaults documented there).
``--time-scale S`` makes every sleep S times shorter; reported timings stay in model time.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvroute.commands.simulate import add_cache_model_flags
from kvroute.sim import cost


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="sim", help="model name reported and accepted")
    p.add_argument(
        "--lora-adapters",
        default="",
        metavar="NAME[,NAME...]",
        help="LoRA adapters served besides --model (listed by /v1/models with their "
        "parent, requested by name in 'model'); each adapter's KV is cached apart, as "
        "vLLM keys blocks by adapter",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (transformers); default: UTF-8 bytes of the text",
    )
    p.add_argument(
        "--text-codec",
        choices=("bytes", "codepoints"),
        default="bytes",
        help="without --tokenizer: text is UTF-8 bytes (as the router sees it), or one token "
        "per character with U+10000+id decoded back to id (benchmarks through text-only "
        "routers; see kvroute.sim.textcodec)",
    )
    p.add_argument(
        "--capacity-tokens",
        type=int,
        default=cost.DEFAULT_CAPACITY_TOKENS,
        help="KV cache capacity in tokens (default %(default)s)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=cost.DEFAULT_BLOCK_SIZE,
        help="KV block size in tokens (default %(default)s)",
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=cost.DEFAULT_PREFILL_TOKENS_PER_S,
        help="default %(default)s",
    )
    p.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=cost.DEFAULT_DECODE_S_PER_TOKEN * 1000,
        help="default %(default)s",
    )
    p.add_argument(
        "--overhead-ms",
        type=float,
        default=cost.DEFAULT_OVERHEAD_S * 1000,
        help="fixed per-request time before the first token (default %(default)s)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=cost.DEFAULT_MAX_BATCH,
        help="requests running at once; the rest queue FIFO (default %(default)s)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run S times faster than real time; reports stay in model time",
    )
    p.add_argument("--max-model-len", type=int, default=131_072)
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="output tokens per streamed chunk after the first, like vLLM's (default %(default)s)",
    )
    add_cache_model_flags(p)
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="no prefix caching (as vLLM's --no-enable-prefix-caching or SGLang's "
        "--disable-radix-cache): every prompt is computed in full; for testing "
        "`kvroute doctor` on a worker configured wrong",
    )
    p.add_argument(
        "--hide-max-running",
        action="store_true",
        help="answer /get_server_info without how many requests run at once (SGLang "
        "tells it; vLLM publishes no max_num_seqs): the router learns the worker's "
        "capacity from its queueing instead",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish vLLM KV events on this ZMQ endpoint (tcp://*:5557 binds, "
        "tcp://host:port connects)",
    )
    p.add_argument("--kv-events-topic", default="")
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ ROUTER endpoint serving replays of buffered event batches",
    )
    p.add_argument(
        "--poison-marker",
        default=None,
        help="fault injection: a request whose body contains this text is never answered "
        "(see --poison-action)",
    )
    p.add_argument(
        "--poison-action",
        choices=("crash", "drop"),
        default="crash",
        help="what a poisoned request does: crash exits the process, drop closes only its "
        "connection (default %(default)s)",
    )
    p.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvroute.sim.engine import SimConfig
    from kvroute.sim.worker import create_app

    try:
        config = SimConfig(
            model=args.model,
            lora_adapters=tuple(n.strip() for n in args.lora_adapters.split(",") if n.strip()),
            capacity_tokens=args.capacity_tokens,
            block_size=args.block_size,
            cost=cost.CostModel(
                prefill_tokens_per_s=args.prefill_tokens_per_s,
                overhead_s=args.overhead_ms / 1000,
                decode_s_per_token=args.decode_ms_per_token / 1000,
                max_batch=args.max_batch,
            ),
            time_scale=args.time_scale,
            max_model_len=args.max_model_len,
            tokenizer=args.tokenizer,
            text_codec=args.text_codec,
            kv_events_endpoint=args.kv_events_endpoint,
            kv_events_topic=args.kv_events_topic,
            kv_events_replay_endpoint=args.kv_events_replay_endpoint,
            stream_interval=args.stream_interval,
            output_blocks=args.output_blocks,
            kv_admission=args.kv_admission,
            prefix_caching=not args.no_prefix_cache,
            reports_max_running=not args.hide_max_running,
        ).validate()
    except ValueError as e:
        print(f"kvroute sim-worker: {e}", file=sys.stderr)
        return 2
    app: Any = create_app(config)
    server: uvicorn.Server | None = None
    if args.poison_marker:
        from kvroute.sim.faults import Poisoned

        app = Poisoned(
            app,
            args.poison_marker.encode(),
            args.poison_action,
            lambda: server.server_state.connections if server is not None else (),
        )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=2,
        )
    )
    server.run()
    return 0
