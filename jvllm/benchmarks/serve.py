"""Online serving benchmark: N streamed completions at a given concurrency (or request rate)
against a jvllm server, then the same workload through offline `LLM.generate` for the ratio.

    python -m jvllm.benchmarks.serve --num-prompts 64 --input-len 64 --output-len 64 \
        --max-concurrency 32                      # starts `jvllm serve` itself
    python -m jvllm.benchmarks.serve --request-rate 8 --disconnect-fraction 0.25
    jvllm bench serve --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct

Prompts are random token ids, generation is greedy with ignore_eos, so every request that stays
produces exactly output-len tokens; with --disconnect-fraction, that share of the requests leave
after a random number of tokens. TTFT and inter-token latency are measured by the client on the
SSE stream. Aborted and rejected counts and the KV blocks still in use once the server is idle
(0 unless blocks leak) come from the server's /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

from jvllm.benchmarks import images
from jvllm.benchmarks.workload import random_prompts
from jvllm.model_loader.default_model import DEFAULT_MODEL, default_model_dir


def completion_request(model: str, prompt: list[int], output_len: int) -> tuple[str, dict]:
    """(the endpoint, the body) of a streamed greedy completion of `prompt`."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return "/v1/completions", body


async def _one(
    client: httpx.AsyncClient, url: str, request: tuple[str, dict], leave_after: int | None = None
) -> dict:
    """One streamed request (an endpoint and its body); with `leave_after`, the client goes
    away after that many chunks."""
    path, body = request
    start = time.perf_counter()
    token_times = []
    num_tokens = None
    async with client.stream("POST", url + path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"status": response.status_code, "itl": [], "num_tokens": 0}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                token_times.append(time.perf_counter())
                if len(token_times) == leave_after:
                    break  # leaving the block closes the connection mid-stream
    return {
        "status": 200,
        "left": num_tokens is None,
        "ttft": token_times[0] - start if token_times else None,
        "itl": list(np.diff(token_times)),
        "num_tokens": len(token_times) if num_tokens is None else num_tokens,
    }


async def run_load(
    url: str,
    requests: list[tuple[str, dict]],
    output_len: int,
    max_concurrency: int,
    request_rate: float,
    seed: int,
    disconnect_fraction: float = 0.0,
) -> dict:
    semaphore = asyncio.Semaphore(max_concurrency)
    rng = np.random.default_rng(seed)
    # Which requests leave, and after how many chunks (at least one, before the last).
    leaving = rng.permutation(len(requests))[: round(disconnect_fraction * len(requests))]
    leave_after = [None] * len(requests)
    for i in leaving:
        leave_after[i] = int(rng.integers(1, max(output_len, 2)))
    limits = httpx.Limits(max_connections=max_concurrency + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        path, body = requests[0]
        await _one(client, url, (path, {**body, "max_tokens": 2}))  # warm-up: 2 tokens

        async def limited(request, leave):
            async with semaphore:
                return await _one(client, url, request, leave)

        tasks = []
        start = time.perf_counter()
        for request, leave in zip(requests, leave_after):
            tasks.append(asyncio.create_task(limited(request, leave)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    served = [r for r in results if r["status"] == 200]
    ttft = [r["ttft"] for r in served if r["ttft"] is not None]
    itl = [x for r in served for x in r["itl"]]
    num_tokens = sum(r["num_tokens"] for r in served)
    num_completed = sum(not r["left"] for r in served)
    stats = {
        "elapsed": elapsed,
        "num_tokens": num_tokens,
        "tok_s": num_tokens / elapsed,
        "req_s": num_completed / elapsed,
        "num_completed": num_completed,
        "num_left": len(served) - num_completed,
        "num_refused": len(results) - len(served),
    }
    for name, values in (("ttft", ttft), ("itl", itl)):
        for q in (50, 90, 99):
            stats[f"{name}_p{q}"] = np.percentile(values, q) if values else float("nan")
    return stats


def scrape(url: str) -> dict[str, float]:
    """From the server's /metrics, whatever its prefix (jvllm: or vllm:): the requests running
    and waiting, the KV blocks in use, and the requests counted aborted and rejected so far."""
    from prometheus_client.parser import text_string_to_metric_families

    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    values = {"aborted": 0.0, "rejected": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            name = sample.name.split(":", 1)[-1]
            if name in gauges:
                values[name] = sample.value
            elif name == "request_success_total" and sample.labels["finished_reason"] == "abort":
                values["aborted"] += sample.value
            elif name == "num_requests_rejected_total":
                values["rejected"] += sample.value
            elif name == "cache_config_info":
                values["num_gpu_blocks"] = float(sample.labels["num_gpu_blocks"])
    # Block 0 is the null block, never held; usage is over the others (as in vLLM).
    values["kv_blocks_in_use"] = round(
        values["kv_cache_usage_perc"] * (values["num_gpu_blocks"] - 1)
    )
    return values


def scrape_when_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """/metrics once nothing runs or waits (aborts land between steps)."""
    deadline = time.monotonic() + timeout
    while True:
        values = scrape(url)
        busy = values["num_requests_running"] + values["num_requests_waiting"]
        if not busy or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def offline_tok_s(args, prompts) -> float:
    from jvllm import LLM, SamplingParams

    # Compiled up front like the server it is compared with.
    llm = LLM(args.model_path, compile_all_buckets=True, **_engine_kwargs(args))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def _engine_kwargs(args) -> dict:
    kwargs = {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    return kwargs


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a server to start on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "jvllm.entrypoints.cli",
        "serve",
        args.model_path or "",
        "--port",
        str(port),
        "--served-model-name",
        args.model,
        "--uvicorn-log-level",
        "warning",
        "--no-compile-in-background",  # /health then means every shape is compiled
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.load_format != "auto":
        cmd += ["--load-format", args.load_format]
    if not args.model_path:
        cmd.remove("")
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not become healthy in 900 s")


def model_path(model: str, path: str | None) -> str | None:
    """The weights a started server loads: --model-path, else --model unless it is the
    default model's name (None: the default model)."""
    if path is None and model != DEFAULT_MODEL:
        return model
    return path


def main(argv=None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (default: start one)")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="the model (a directory or .gguf file, as vLLM's bench serve takes it) and the "
        "name it is served under",
    )
    parser.add_argument(
        "--model-path",
        default=None,
        help="the model's directory or .gguf file where --model is only a served name",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson arrivals (default: all at once)",
    )
    parser.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.0,
        help="share of the requests whose client leaves after a random number of tokens",
    )
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens a step at most"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--images-per-prompt",
        type=int,
        default=0,
        help="chat requests with this many images each (without --model-path, a LLaVA-1.5 "
        "shape with random weights: jvllm/benchmarks/images.py)",
    )
    parser.add_argument("--unique-images", type=int, default=0, help="0: every image new")
    parser.add_argument("--image-size", type=int, default=336, help="pixels a side")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.model_path = model_path(args.model, args.model_path)
    if not 0 <= args.disconnect_fraction <= 1:
        parser.error(f"--disconnect-fraction must be in [0, 1], got {args.disconnect_fraction}")

    args.load_format = "auto"
    if args.images_per_prompt:
        args.model = args.model if args.model_path else "llava-shape"
        args.model_path, args.load_format = images.model_dir(
            argparse.Namespace(model=args.model_path, load_format="auto")
        )
        args.skip_offline = True  # the offline peer is the same server's text requests
        requests = images.chat_requests(args)
    else:
        with open(os.path.join(args.model_path or default_model_dir(), "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        prompts = random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
        requests = [completion_request(args.model, p, args.output_len) for p in prompts]
    proc = None
    url = args.base_url
    if url is None:
        proc, url = _start_server(args)
    try:
        before = scrape_when_idle(url)
        online = asyncio.run(
            run_load(
                url,
                requests,
                args.output_len,
                args.max_concurrency,
                args.request_rate,
                args.seed,
                args.disconnect_fraction,
            )
        )
        after = scrape_when_idle(url)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(
        f"workload: {args.num_prompts} requests x {args.input_len} in x {args.output_len} out, "
        f"greedy, ignore_eos, concurrency {args.max_concurrency}, rate {args.request_rate}, "
        f"disconnect fraction {args.disconnect_fraction}"
    )
    print(
        f"server: {online['tok_s']:.1f} output tok/s, {online['req_s']:.2f} req/s "
        f"({online['elapsed']:.2f}s, {online['num_tokens']} tokens)"
    )
    for name in ("ttft", "itl"):
        cells = ", ".join(f"p{q} {1000 * online[f'{name}_p{q}']:.1f}" for q in (50, 90, 99))
        print(f"{name.upper()} {cells} ms")
    print(
        f"requests: {online['num_completed']} completed, {online['num_left']} left mid-stream, "
        f"{online['num_refused']} refused; the server counted "
        f"{after['aborted'] - before['aborted']:.0f} aborted, "
        f"{after['rejected'] - before['rejected']:.0f} rejected"
    )
    print(
        f"KV blocks in use at the end: {after['kv_blocks_in_use']} "
        f"of {after['num_gpu_blocks'] - 1:.0f}"
    )
    if args.images_per_prompt:
        print(f"images: {args.images_per_prompt} a request, {args.image_size} px")
    if not args.skip_offline:
        offline = offline_tok_s(args, prompts)
        print(
            f"offline LLM.generate: {offline:.1f} output tok/s; "
            f"server / offline = {online['tok_s'] / offline:.2f}"
        )
    if after["kv_blocks_in_use"]:
        sys.exit("KV blocks are still in use with no request running or waiting: a leak")


if __name__ == "__main__":
    main()
