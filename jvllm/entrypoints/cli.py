"""The `jvllm` command: `jvllm serve [MODEL] ...` and `jvllm bench serve ...`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from jvllm.entrypoints.engine_flags import add_engine_args, engine_kwargs
from jvllm.entrypoints.openai import DEFAULT_MAX_REQUEST_BODY_BYTES
from jvllm.entrypoints.openai.reasoning import REASONING_PARSERS
from jvllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from jvllm.lora.request import LoRARequest, parse_lora_module

# What `jvllm serve` imports beyond the engine's own dependencies (the `serve` extra).
_SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "pydantic", "starlette")


def _lora_module(value: str) -> LoRARequest:
    try:
        return parse_lora_module(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_list(value: str) -> list[str]:
    """--allowed-origins and its kin: a JSON list of strings, as vLLM takes them."""
    try:
        items = json.loads(value)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a JSON list of strings, such as '[\"http://localhost:3000\"]'"
        )
    return items


def _load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's path, or the template itself with its escapes (\\n) decoded,
    as vLLM reads it; a value with no Jinja in it that names no file is a mistyped path."""
    if value is None:
        return None
    try:
        with open(value) as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            sys.exit(
                f"--chat-template {value!r} looks like a file path, but it cannot be read: {e}"
            )
    # Characters past Latin-1 go through as escapes themselves, so that only escapes change.
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def _serve(args: argparse.Namespace) -> None:
    if args.model_option is not None:
        if args.model is not None and args.model != args.model_option:
            sys.exit(f"the model is given twice: {args.model} and --model {args.model_option}")
        args.model = args.model_option
    chat_template = _load_chat_template(args.chat_template)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        sys.exit(
            "--enable-auto-tool-choice needs --tool-call-parser NAME "
            f"({', '.join(sorted(TOOL_PARSERS))})"
        )
    if args.lora_modules and not args.enable_lora:
        sys.exit("--lora-modules needs --enable-lora")
    if args.tool_call_parser == "openai" and args.reasoning_parser != "openai_gptoss":
        sys.exit(  # else a reply without tools would be harmony markup, channels and all
            "--tool-call-parser openai reads gpt-oss's harmony format: pass "
            "--reasoning-parser openai_gptoss too, which splits its channels"
        )
    try:
        from jvllm.entrypoints.openai.api_server import run_server
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in _SERVER_PACKAGES:
            raise
        sys.exit(f"jvllm serve needs {e.name}, which is not installed: pip install 'jvllm[serve]'")
    run_server(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
        served_model_name=args.served_model_name,
        log_level=args.uvicorn_log_level,
        log_stats=not args.disable_log_stats,
        compile_in_background=args.compile_in_background,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        metrics_prefix=args.metrics_prefix,
        chat_template=chat_template,
        response_role=args.response_role,
        reasoning_parser=args.reasoning_parser,
        lora_modules=args.lora_modules,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        **engine_kwargs(args),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jvllm", description="jvllm: vLLM's engine in JAX")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory or .gguf file; None: the default model, SmolLM2-135M-Instruct",
    )
    serve.add_argument(
        "--model",
        dest="model_option",
        default=None,
        help="the model, as MODEL above (vLLM's older form)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 and /invocations (None: the "
        "VLLM_API_KEY environment variable's, if set)",
    )
    serve.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help="origins whose web pages may call the server from a browser (CORS), a JSON list "
        """such as '["https://app.example"]'; ["*"]: any""",
    )
    serve.add_argument(
        "--allowed-methods",
        type=_json_list,
        default=["*"],
        help='HTTP methods those pages may use, a JSON list; ["*"]: any',
    )
    serve.add_argument(
        "--allowed-headers",
        type=_json_list,
        default=["*"],
        help='request headers those pages may send, a JSON list; ["*"]: any',
    )
    serve.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let cross-origin requests carry cookies and HTTP authentication (CORS)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model names clients may pass, the first in responses and metrics; None: "
        "MODEL, or the default model's",
    )
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="the chat template (a Jinja template, or a file holding one) instead of the "
        "tokenizer's",
    )
    serve.add_argument(
        "--response-role",
        default="assistant",
        help="the role of a chat reply after a generation prompt",
    )
    serve.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for vLLM's launch scripts: jvllm logs no requests",
    )
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own chat_template (a Jinja template runs on the server)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='answer tool_choice "auto" by reading the calls out of the reply with '
        '--tool-call-parser (without it, "auto" is a 400)',
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls: hermes (Qwen2.5/3, <tool_call> JSON), "
        "llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS]), pythonic (Llama 3.2/4 "
        "[f(x=1)]), granite (Granite 3.x JSON list), qwen3_coder (Qwen3-Coder XML), openai "
        "(gpt-oss harmony)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split a thinking model's <think> reasoning into the reply's reasoning_content: "
        "deepseek_r1 (R1 and its distills: always thinks), qwen3 (Qwen3, thinking switchable), "
        "openai_gptoss (gpt-oss: harmony's analysis channel)",
    )
    serve.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic throughput / load line (JVLLM_LOG_STATS_INTERVAL sets its seconds)",
    )
    serve.add_argument(
        "--metrics-prefix",
        default="jvllm",
        help="namespace of every /metrics series; vllm exports vLLM's names "
        "(vllm:num_requests_running, ...) so that dashboards and alerts written for vLLM work",
    )
    serve.add_argument(
        "--compile-in-background",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="listen at once and compile the step shapes in the background; with "
        "--no-compile-in-background every shape compiles before the port opens",
    )
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="requests that may wait beyond the --max-num-seqs running; more get a 503 with "
        "Retry-After (None: no bound)",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="a larger request body is a 413, refused before it is read",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="on SIGTERM, seconds the requests in flight get to finish before they are aborted",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        help="LoRA adapters to serve (with --enable-lora), each name=path or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\': a request\'s "model" picks one',
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
    bench_main(args.rest, prog=f"jvllm bench {args.which}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.func(args)


if __name__ == "__main__":
    main()
