"""The speculative decoding benchmark runs end to end on a tiny workload."""

from jvllm.benchmarks import spec_decode


def test_spec_decode_benchmark_compares_speculation_with_plain_decoding(tiny_llama_dir, capsys):
    spec_decode.main(
        ["--model", tiny_llama_dir, "--dtype", "float32", "--max-tokens", "6", "--num-iters", "1"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU: ")
    rows = {tuple(line.split()[:2]): line.split() for line in lines[3:]}
    assert set(rows) == {(name, t) for name in spec_decode.PROMPTS for t in ("0", "0.7")}
    # float32: the same tokens, greedy and seeded sampled
    assert all(row[-1] == "True" for row in rows.values())
