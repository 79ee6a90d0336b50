"""The `jvllm` command: `jvllm serve [MODEL] ...` and `jvllm bench serve ...`."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jvllm.engine.arg_utils import EngineArgs
from jvllm.model_loader.loader import LOAD_FORMATS

# EngineArgs fields exposed as flags (vLLM's flag names).
_ENGINE_FLAGS = {
    "dtype": {"choices": ["auto", "float32", "bfloat16"]},
    "load_format": {"choices": list(LOAD_FORMATS)},
    "max_model_len": {"type": int},
    "max_num_seqs": {"type": int},
    "max_num_batched_tokens": {"type": int},
    "block_size": {"type": int},
    "kv_cache_memory_bytes": {"type": int},
    "num_gpu_blocks_override": {"type": int},
    "gpu_memory_utilization": {"type": float},
    "long_prefill_token_threshold": {"type": int},
    "attention_backend": {},
    "seed": {"type": int},
    "generation_config": {},
    "enable_prefix_caching": {"action": argparse.BooleanOptionalAction},
    "enable_chunked_prefill": {"action": argparse.BooleanOptionalAction},
    "num_scheduler_steps": {"type": int},
    "async_scheduling": {"action": argparse.BooleanOptionalAction},
    "tensor_parallel_size": {"type": int},
    "data_parallel_size": {"type": int},
    "distributed_coordinator_address": {},
    "distributed_num_processes": {"type": int},
    "distributed_process_id": {"type": int},
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineArgs()
    group = parser.add_argument_group("engine")
    for name, kwargs in _ENGINE_FLAGS.items():
        default = getattr(defaults, name)
        group.add_argument(
            f"--{name.replace('_', '-')}", default=default, help=f"(default: {default})", **kwargs
        )


def engine_kwargs(args: argparse.Namespace) -> dict:
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    return {name: getattr(args, name) for name in _ENGINE_FLAGS if name in fields}


def _serve(args: argparse.Namespace) -> None:
    from jvllm.entrypoints.openai.api_server import run_server

    run_server(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        log_level=args.uvicorn_log_level,
        log_stats=not args.disable_log_stats,
        compile_in_background=args.compile_in_background,
        **engine_kwargs(args),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jvllm", description="jvllm: vLLM's engine in JAX")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the OpenAI-compatible server")
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1")
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients pass (default: MODEL, or the default model's)",
    )
    serve.add_argument("--uvicorn-log-level", default="info")
    serve.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic throughput / load line (JVLLM_LOG_STATS_INTERVAL sets its seconds)",
    )
    serve.add_argument(
        "--compile-in-background",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="listen at once and compile the step shapes in the background (default); with "
        "--no-compile-in-background every shape compiles before the port opens",
    )
    add_engine_args(serve)
    serve.set_defaults(func=_serve)
    bench = commands.add_parser("bench", help="benchmarks")
    bench.add_argument("which", choices=["serve", "throughput"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    return parser


def _bench(args: argparse.Namespace) -> None:
    if args.which == "serve":
        from jvllm.benchmarks.serve import main as bench_main
    else:
        from jvllm.benchmarks.throughput import main as bench_main
    bench_main(args.rest)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.func(args)


if __name__ == "__main__":
    main()
