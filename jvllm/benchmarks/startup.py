"""Start-up time as a newcomer meets it: each case in a fresh process, on empty caches (cold),
then again on what that process left in them (warm).

    python -m jvllm.benchmarks.startup --dtype bfloat16

Per dtype, three measurements, each in its own fresh set of cache directories (XLA's compiled
executables, JVLLM_COMPILATION_CACHE_DIR, and the default model's GGUF converted to an HF
directory, JVLLM_CACHE_DIR, and the CPU decode kernel, JVLLM_NATIVE_CACHE_DIR), run cold and then
warm:
- first token: `LLM(...)` returns (load; it compiles lazily), then `generate` of one prompt with
  max_tokens=1;
- the README's example: examples/offline_inference.py as written, with the model, dtype and load
  format of the run (and --max-tokens, if given) put into its `LLM()` and `SamplingParams()`;
- `jvllm serve`: until GET /health answers 200, and until a completion, sent as soon as the port
  accepts connections, returns 200.
The first two count from the constructor's start, in the child process; "process" is the child's
whole run, interpreter start and imports (Python, jax, jvllm) included. The server counts from
its launch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from unittest import mock

import httpx
import jax

import jvllm
from jvllm import LLM, SamplingParams
from jvllm.benchmarks.serve import free_port
from jvllm.model_loader.default_model import CACHE_DIR_ENV
from jvllm.model_loader.loader import LOAD_FORMATS
from jvllm.native import NATIVE_CACHE_DIR_ENV
from jvllm.worker.compilation_cache import COMPILATION_CACHE_DIR_ENV

PROMPT = "Hello, my name is"  # the README example's first prompt
_EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "examples",
    "offline_inference.py",
)
_DTYPES = ["float32", "bfloat16"]
_TIMEOUT_S = 900  # a start-up that takes longer has failed
_POLL_S = 0.05
_TAIL_CHARS = 3000  # of a failed process's output, shown with the error
# (column title, figure); "-" where a figure was not measured (--skip-serve).
_COLUMNS = [
    ("load s", "load"),
    ("first token s", "first_token"),
    ("process s", "first_token_process"),
    ("README s", "readme"),
    ("process s", "readme_process"),
    ("/health s", "health"),
    ("completion s", "completion"),
]
# (case, figure, at most seconds, what the goal is called)
_GOALS = [
    ("cold", "first_token", 10.0, "cold first token"),
    ("cold", "readme", 45.0, "cold README example"),
    ("cold", "completion", 30.0, "cold serve first completion"),
    ("warm", "first_token", 5.0, "warm first token"),
]


# A child runs with the parent's options, and one dtype.
def _first_token_child(args) -> dict:
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype[0], load_format=args.load_format)
    load = time.perf_counter() - start
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
    first_token = time.perf_counter() - start
    engine = llm.llm_engine
    return {
        "load": load,
        "first_token": first_token,
        "weights": engine.worker.load_seconds,  # and tokenizer (and converting a GGUF)
        # What the step waited for compiles (the decode bucket compiles beside it, unwaited).
        "compile": engine.model_runner.compiler.compile_wait_seconds,
    }


def _readme_child(args) -> dict:
    llm = functools.partial(LLM, args.model, dtype=args.dtype[0], load_format=args.load_format)
    params = SamplingParams
    if args.max_tokens is not None:
        params = functools.partial(SamplingParams, max_tokens=args.max_tokens)
    # The example's own lines, its `from jvllm import ...` given these; its printed outputs go
    # to stderr, out of the way of the one JSON line on stdout.
    with (
        mock.patch.multiple(jvllm, LLM=llm, SamplingParams=params),
        contextlib.redirect_stdout(sys.stderr),
    ):
        start = time.perf_counter()
        runpy.run_path(_EXAMPLE, run_name="__main__")
        return {"readme": time.perf_counter() - start}


_CHILDREN = {"first_token": _first_token_child, "readme": _readme_child}


def _cache_env(cache_dir: str) -> dict:
    """The environment of a process whose caches are all under cache_dir."""
    env = dict(os.environ)
    # The engine leaves a cache configured for JAX itself alone, so none may be.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env[COMPILATION_CACHE_DIR_ENV] = os.path.join(cache_dir, "xla")
    env[CACHE_DIR_ENV] = os.path.join(cache_dir, "models")
    env[NATIVE_CACHE_DIR_ENV] = os.path.join(cache_dir, "native")
    return env


def _run_child(kind: str, args, dtype: str, env: dict) -> dict:
    """The child's figures, and its whole run's seconds as `<kind>_process`."""
    cmd = [sys.executable, "-m", "jvllm.benchmarks.startup", "--child", kind, "--dtype", dtype]
    cmd += ["--load-format", args.load_format]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_tokens is not None:
        cmd += ["--max-tokens", str(args.max_tokens)]
    start = time.perf_counter()
    result = subprocess.run(
        cmd, check=False, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(
            f"the {kind} child exited with {result.returncode}; its stderr ends:\n"
            + result.stderr[-_TAIL_CHARS:]
        )
    figures = json.loads(result.stdout.splitlines()[-1])
    figures[f"{kind}_process"] = seconds
    return figures


async def _send_when_listening(
    client: httpx.AsyncClient, proc: subprocess.Popen, method: str, url: str, **kwargs
) -> httpx.Response:
    """The request sent again and again until the server's port accepts it."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            return await client.request(method, url, **kwargs)
        except httpx.ConnectError:
            await asyncio.sleep(_POLL_S)


async def _seconds_to_answers(url: str, proc: subprocess.Popen, start: float) -> dict:
    """Seconds from start until /health answers 200 and until the first completion returns."""
    async with httpx.AsyncClient(timeout=None) as client:

        async def health() -> float:
            while True:
                response = await _send_when_listening(client, proc, "GET", url + "/health")
                if response.status_code == 200:
                    return time.perf_counter() - start
                await asyncio.sleep(_POLL_S)  # 503 while the engine is not running

        async def completion() -> float:
            body = {"prompt": PROMPT, "max_tokens": 8}
            response = await _send_when_listening(
                client, proc, "POST", url + "/v1/completions", json=body
            )
            if response.status_code != 200:
                raise RuntimeError(
                    f"POST /v1/completions answered {response.status_code}: {response.text}"
                )
            return time.perf_counter() - start

        seconds = await asyncio.wait_for(asyncio.gather(health(), completion()), _TIMEOUT_S)
    return dict(zip(("health", "completion"), seconds, strict=True))


def _serve_times(args, dtype: str, env: dict, log_path: str) -> dict:
    """`jvllm serve`'s seconds from launch to /health and to the first completion; the server
    is stopped after, and its log's end raised with any failure."""
    port = free_port()
    cmd = [sys.executable, "-m", "jvllm.entrypoints.cli", "serve"]
    cmd += [args.model] if args.model else []
    cmd += ["--port", str(port), "--dtype", dtype, "--load-format", args.load_format]
    cmd += ["--uvicorn-log-level", "warning"]
    with open(log_path, "w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            return asyncio.run(_seconds_to_answers(f"http://127.0.0.1:{port}", proc, start))
        except Exception as e:
            log.seek(0)
            raise RuntimeError(
                f"jvllm serve failed ({e}); its log ends:\n{log.read()[-_TAIL_CHARS:]}"
            ) from e
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _measure(args, root: str) -> dict[tuple[str, str], dict]:
    """{(case, dtype): figures}; each measurement in fresh caches, cold then warm."""
    results = defaultdict(dict)
    kinds = list(_CHILDREN) + ([] if args.skip_serve else ["serve"])
    for dtype in args.dtype:
        for kind in kinds:
            cache_dir = os.path.join(root, f"{dtype}-{kind}")
            os.makedirs(cache_dir)
            env = _cache_env(cache_dir)
            for case in ("cold", "warm"):
                print(f"{case} {dtype} {kind} ...", file=sys.stderr, flush=True)
                if kind == "serve":
                    log_path = os.path.join(cache_dir, f"serve-{case}.log")
                    figures = _serve_times(args, dtype, env, log_path)
                else:
                    figures = _run_child(kind, args, dtype, env)
                results[case, dtype].update(figures)
    return results


def cpu_name() -> str:
    """/proc/cpuinfo's "model name", else what the platform module knows."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _print_report(args, results: dict) -> None:
    print(
        f"start-up of {args.model or 'the default model'} (load format {args.load_format}), "
        f"fresh caches; {cpu_name()}, {os.cpu_count()} cores; jax {jax.__version__}"
    )
    print(f"{'case':<5} {'dtype':<9}" + "".join(f"{title:>14}" for title, _ in _COLUMNS))
    for (case, dtype), figures in results.items():
        cells = [f"{figures[key]:.1f}" if key in figures else "-" for _, key in _COLUMNS]
        print(f"{case:<5} {dtype:<9}" + "".join(f"{cell:>14}" for cell in cells))
    print("where the first-token process's time goes (seconds):")
    for (case, dtype), f in results.items():
        print(
            f"  {case} {dtype}: interpreter, imports and exit "
            f"{f['first_token_process'] - f['first_token']:.1f}, weights and tokenizer "
            f"{f['weights']:.1f}, rest of the constructor {f['load'] - f['weights']:.1f}, "
            f"waiting for compiles {f['compile']:.1f}, rest of generate "
            f"{f['first_token'] - f['load'] - f['compile']:.1f}"
        )
    for case, key, limit, name in _GOALS:
        marks = [
            f"{dtype} {figures[key]:.1f} s {'met' if figures[key] <= limit else 'not met'}"
            for (run_case, dtype), figures in results.items()
            if run_case == case and key in figures
        ]
        if marks:
            print(f"goal {name} <= {limit:.0f} s: {'; '.join(marks)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", choices=_DTYPES, default=_DTYPES)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="the README example's (default: its own)"
    )
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument(
        "--cache-root", default=None, help="where the fresh cache dirs go (default: the temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the cache dirs afterwards")
    parser.add_argument("--child", choices=list(_CHILDREN), help="(internal) one measured child")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_CHILDREN[args.child](args)))
        return

    root = tempfile.mkdtemp(prefix="jvllm-startup-", dir=args.cache_root)
    try:
        results = _measure(args, root)
    finally:
        if args.keep:
            print(f"caches kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    _print_report(args, results)


if __name__ == "__main__":
    main()
