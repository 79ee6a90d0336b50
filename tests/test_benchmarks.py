"""Every benchmark's `main` on a tiny workload, so that none breaks unnoticed. HF's side runs too:
on a 2-layer model of width 64 it costs a second."""

import dataclasses
import os
import re

import pytest

from jvllm.benchmarks import (
    dense_bound,
    layer_stack,
    ngram_lookup,
    prefix_hash,
    serve,
    startup,
    throughput,
    weight_read,
    workload,
)
from jvllm.model_loader.hf import read_hf_config
from jvllm.models.model import param_shapes

_CONFIGS = os.path.join(os.path.dirname(throughput.__file__), "model_configs")
_TINY_2L = os.path.join(_CONFIGS, "tiny-2l")
# Random weights of tiny-2l's shapes, in both engines; a 16-token step budget keeps the
# engine's buckets to three.
_TINY_WORKLOAD = [
    *("--model", _TINY_2L, "--load-format", "dummy"),
    *("--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--num-iters", "1"),
    *("--max-num-batched-tokens", "16"),
]


def test_throughput_benchmark_runs_jvllm_and_hf(capsys):
    throughput.main(_TINY_WORKLOAD)
    out = capsys.readouterr().out
    assert "jvllm batch-1 decode:" in out
    assert "HF transformers generate:" in out
    assert "ratio jvllm / HF:" in out


def test_throughput_benchmark_runs_prompts_as_text_and_with_images(tiny_llava_dir, capsys):
    throughput.main(
        [
            *("--model", tiny_llava_dir, "--images-per-prompt", "1", "--unique-images", "1"),
            *("--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--num-iters", "1"),
            *("--max-num-batched-tokens", "64"),
        ]
    )
    out = capsys.readouterr().out
    assert re.search(r"images: 1 a prompt of 16 tokens in all, 1 distinct; 0 encoded", out)
    assert re.search(r"output tok/s: text alone [\d.]+, with images [\d.]+ \(ratio", out)
    # The warm-up encoded the one image, and its blocks then served every later prompt.
    assert "encoder cache: no lookups (the prefix cache held every image's tokens)" in out


@pytest.mark.slow
def test_serve_benchmark_sends_images_in_chat_requests(tiny_llava_dir, capsys):
    serve.main(
        [
            *("--model", "tiny-llava", "--model-path", tiny_llava_dir, "--images-per-prompt", "1"),
            *("--num-prompts", "4", "--input-len", "8", "--output-len", "4"),
            *("--max-concurrency", "4", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"),
        ]
    )
    out = capsys.readouterr().out
    assert "4 completed, 0 left mid-stream, 0 refused" in out
    assert "images: 1 a request" in out


def test_throughput_benchmark_compares_a_scheduling_setting_with_k1(capsys):
    throughput.main(
        [*_TINY_WORKLOAD, "--skip-hf", "--num-scheduler-steps", "2", "--async-scheduling"]
    )
    out = capsys.readouterr().out
    assert "jvllm [k=1]:" in out and "jvllm [k=2, async]:" in out
    assert "jvllm [k=2, async] / jvllm [k=1]: throughput" in out


def test_throughput_benchmark_compares_quantized_weights_with_the_models_own(capsys):
    throughput.main([*_TINY_WORKLOAD, "--skip-hf", "--compare-quantization", "int8"])
    out = capsys.readouterr().out
    assert "jvllm [k=1, float32 weights]:" in out and "jvllm [k=1, int8 weights]:" in out
    assert "jvllm [k=1, int8 weights] / jvllm [k=1, float32 weights]: throughput" in out


@pytest.mark.parametrize(
    "flags",
    [
        ["--quantization", "fp8", "--compare-quantization", "fp8"],  # itself
        ["--compare-quantization", "int8", "--num-scheduler-steps", "2"],  # two changes at once
        ["--compare-quantization", "gguf"],  # random weights have no GGUF blocks
    ],
)
def test_throughput_benchmark_refuses_a_comparison_before_running_anything(flags, monkeypatch):
    monkeypatch.setattr(throughput, "bench_jvllm", _must_not_run)
    with pytest.raises(SystemExit):
        throughput.main([*_TINY_WORKLOAD, "--skip-hf", *flags])


def test_throughput_benchmark_compares_a_json_schema_with_none(tiny_llama_dir, capsys):
    # The grammar needs the tokenizer; random weights rarely close the JSON in 4 tokens.
    throughput.main([*_TINY_WORKLOAD, "--model", tiny_llama_dir, "--structured", "json"])
    out = capsys.readouterr().out
    assert "jvllm [unconstrained]:" in out and "jvllm [constrained]:" in out
    assert "jvllm [constrained] valid JSON for the schema: " in out
    assert "jvllm [constrained] / jvllm [unconstrained]: throughput" in out
    assert "ms a step" in out
    assert "HF transformers" not in out


def test_dense_bound_benchmark_runs_against_hf(capsys):
    dense_bound.main(_TINY_WORKLOAD)
    out = capsys.readouterr().out
    assert "dense floor:" in out
    assert "most jvllm / HF could reach here:" in out


def test_weight_read_benchmark_puts_the_weights_over_the_read_bandwidth(capsys):
    weight_read.main(["--model", _TINY_2L, "--read-mib", "8", "--num-iters", "3"])
    out = capsys.readouterr().out
    found = re.search(r"reads: ([\d.]+) MB .* read bandwidth ([\d.]+) GB/s", out)
    mb, bandwidth = map(float, found.groups())
    floor_ms = float(re.search(r"floor: ([\d.]+) ms a step", out).group(1))
    assert floor_ms == pytest.approx(mb / bandwidth, rel=0.05)  # the printed roundings


def test_layer_stack_benchmark_times_every_layout_against_the_scan(capsys):
    layer_stack.main(
        [
            "--model",
            _TINY_2L,
            "--tokens",
            "1",
            "3",
            "--repeats",
            "2",
            "--layouts",
            *layer_stack.LAYOUTS,
        ]
    )
    out = capsys.readouterr().out
    for layout in layer_stack.LAYOUTS:
        assert (
            len(re.findall(rf"^{layout} +T=[13] .* floor, [\d.]+x scan\)", out, re.MULTILINE)) == 2
        )
    difference = float(re.search(r"scan vs list: relative difference (\S+)", out).group(1))
    assert difference < 1e-2  # the same products, in bfloat16


def test_a_decode_step_reads_one_vocabulary_matrix_tied_or_not():
    # Untied, the LM head is read whole and the embedding table one row a token; tied, the
    # table is the head.
    untied = read_hf_config(_TINY_2L, "bfloat16")
    tied = dataclasses.replace(untied, tie_word_embeddings=True)
    row_bytes = untied.hidden_size * 2
    assert (
        weight_read.decode_weight_bytes(untied) == weight_read.decode_weight_bytes(tied) + row_bytes
    )


def test_a_decode_step_reads_the_experts_a_token_is_routed_to():
    config = read_hf_config(os.path.join(_CONFIGS, "qwen3-30b-a3b"), "bfloat16")
    mlp = param_shapes(config)["layers"]["mlp"]
    expert_bytes = (mlp["gate_up"].size + mlp["down"].size) * 2  # every expert's, bfloat16
    more = dataclasses.replace(config, num_experts_per_tok=2 * config.num_experts_per_tok)
    added = weight_read.decode_weight_bytes(more) - weight_read.decode_weight_bytes(config)
    share = config.num_experts_per_tok / config.num_experts
    assert added == pytest.approx(share * expert_bytes, abs=1)


def test_serve_benchmark_streams_from_its_own_server(tiny_llama_weights_dir, capsys):
    # Its own `jvllm serve` process, as a user's run starts; token-id prompts need no tokenizer.
    # Poisson arrivals; 2 of the 4 clients leave after 1 to 3 of their 4 tokens. The model as
    # vLLM's bench serve takes it: --model, its path and served name at once.
    serve.main(
        [
            *("--model", tiny_llama_weights_dir),
            *("--num-prompts", "4", "--input-len", "8", "--output-len", "4"),
            *("--max-concurrency", "4", "--max-num-seqs", "2", "--max-num-batched-tokens", "16"),
            *("--max-model-len", "64", "--request-rate", "50", "--disconnect-fraction", "0.5"),
        ]
    )
    out = capsys.readouterr().out
    num_tokens = int(re.search(r"s, (\d+) tokens\)", out).group(1))
    assert 2 * 4 + 2 <= num_tokens <= 2 * 4 + 2 * 3  # 2 requests x 4 tokens, 2 left early
    assert re.search(r"TTFT p50 [\d.]+, p90 [\d.]+, p99 [\d.]+ ms", out)
    assert re.search(r"ITL p50 [\d.]+, p90 [\d.]+, p99 [\d.]+ ms", out)
    # The tiny model may finish all 4 tokens before a client's leaving reaches the server.
    counts = re.search(
        r"2 completed, 2 left mid-stream, 0 refused; .* (\d) aborted, 0 rejected", out
    )
    assert counts and int(counts.group(1)) <= 2
    assert "KV blocks in use at the end: 0 of " in out
    assert "server / offline" in out


def test_ngram_lookup_benchmark_times_both_sides(capsys):
    ngram_lookup.main(["--rows", "2", "--lengths", "40,200", "--max-model-len", "128"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[3:]]
    assert [row[:2] for row in rows] == [["2", "40"]]  # 200 does not fit the table
    assert float(rows[0][2]) > 0 and float(rows[0][3]) > 0


def test_prefix_hash_benchmark_times_every_algo(capsys):
    prefix_hash.main(["--num-tokens", "64", "--num-iters", "3", "--cache-salt", "s"])
    out = capsys.readouterr().out
    assert "CPU: " in out and "64-token prompts (4 blocks of 16)" in out
    rows = [line.split() for line in out.splitlines()[3:]]
    assert [row[0] for row in rows] == ["sha256", "sha256_cbor", "builtin"]
    for _, per_prompt, per_block in rows:
        assert float(per_prompt) > 0
        assert float(per_block) == pytest.approx(float(per_prompt) / 4, abs=0.05)  # rounding


def _startup_rows(out: str) -> dict[str, list[str]]:
    """The startup benchmark's table: {case: its cells after the dtype}."""
    rows = [line.split() for line in out.splitlines() if line.startswith(("cold ", "warm "))]
    return {row[0]: row[2:] for row in rows}


@pytest.mark.slow  # four processes, each importing jax and compiling: half a minute on 2 cores
def test_startup_benchmark_times_cold_and_warm_processes(tiny_llama_dir, capsys):
    # Four processes (first token and the README example, cold and warm), each importing jax
    # and compiling; one token keeps the README example to one bucket.
    startup.main(
        [*("--model", tiny_llama_dir, "--dtype", "float32", "--max-tokens", "1", "--skip-serve")]
    )
    out = capsys.readouterr().out
    rows = _startup_rows(out)
    assert set(rows) == {"cold", "warm"}
    for cells in rows.values():
        load, first_token, process, readme, readme_process = map(float, cells[:5])
        assert 0 < load <= first_token < process
        assert 0 < readme < readme_process
        assert cells[5:] == ["-", "-"]  # no server
    assert "goal cold first token <= 10 s: float32" in out
    assert "goal warm first token <= 5 s: float32" in out
    assert "serve" not in out


@pytest.mark.slow  # a server compiles all its buckets: minutes cold, even for a tiny model
def test_startup_benchmark_times_the_server(tiny_llama_dir, capsys):
    startup.main([*("--model", tiny_llama_dir, "--dtype", "float32", "--max-tokens", "1")])
    out = capsys.readouterr().out
    for cells in _startup_rows(out).values():
        health, completion = map(float, cells[5:])
        assert 0 < health <= completion
    assert "goal cold serve first completion <= 30 s: float32" in out


def _must_not_run(*_):
    pytest.fail("jvllm's side ran before the check for HF's packages")


@pytest.mark.parametrize("bench_main", [throughput.main, dense_bound.main])
def test_benchmarks_without_torch_stop_before_jvllm_runs(bench_main, monkeypatch):
    monkeypatch.setattr(workload, "hf_available", lambda: False)
    monkeypatch.setattr(throughput, "bench_jvllm", _must_not_run)
    monkeypatch.setattr(dense_bound, "load_model", _must_not_run)
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[test\]'.*--skip-hf"):
        bench_main(_TINY_WORKLOAD)


def test_serve_benchmark_loads_what_model_names_unless_a_path_is_given():
    assert serve.model_path("/my/model", None) == "/my/model"
    assert serve.model_path("served-name", "/my/model") == "/my/model"
    assert serve.model_path(serve.DEFAULT_MODEL, None) is None  # the default model


def test_lora_benchmark_times_adapters_against_the_base_model(tiny_llama_dir, capsys):
    from jvllm.benchmarks import lora

    lora.main(["--model", tiny_llama_dir, "--num-prompts", "2", "--input-len", "8",
               "--output-len", "4", "--num-iters", "1", "--lora-rank", "2"])  # fmt: skip
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[-2:] for line in out.splitlines()[3:5]}
    assert list(rows) == ["base", "LoRA"] and all(float(v) > 0 for r in rows.values() for v in r)
    assert "LoRA / base: batch-1 " in out
