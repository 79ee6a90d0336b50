"""The padded step shapes: which bucket a step lands in."""

from jvllm.sample.plan import SamplerPlan
from jvllm.worker.buckets import Bucket, BucketSpec
from jvllm.worker.step_compiler import StepCompiler, StepLayout


def test_decode_buckets_are_one_row_then_eight_and_up():
    spec = BucketSpec(max_num_batched_tokens=2048, max_num_seqs=64)
    assert spec.seq_sizes() == [1, 8, 16, 32, 64]
    assert spec.select(1, 1) == Bucket(1, 1, 1)
    assert spec.select(2, 2) == Bucket(8, 8, 1)
    assert spec.select(9, 9) == Bucket(16, 16, 1)
    assert Bucket(1, 1, 1) in spec.all_buckets()


def test_single_sequence_bucket_not_doubled_when_one_sequence_is_the_limit():
    spec = BucketSpec(max_num_batched_tokens=2048, max_num_seqs=1)
    assert spec.seq_sizes() == [1]


def test_windows_of_speculative_rounds_compile_only_for_buckets_a_window_can_take():
    # A window of n requests with k drafts a round takes n (k + 1) tokens, and the scheduler
    # runs one only within max_num_batched_tokens (core/decode_window.py).
    k, budget = 3, 64
    spec = BucketSpec(max_num_batched_tokens=budget, max_num_seqs=64)
    compiler = StepCompiler(
        spec,
        None,
        None,
        StepLayout(16, 8, 100, False, num_speculative_tokens=k),
        num_scheduler_steps=4,
    )
    windows = {shape for shape in compiler.all_shapes() if shape[1] == "spec_window"}
    taken = {
        (*spec.window_shape(n, k), SamplerPlan.DYNAMIC)
        for n in range(1, spec.max_num_seqs + 1)
        if n * (k + 1) <= budget
    }
    assert windows == taken
    assert len(windows) == 3  # the decode buckets of 1, 8 and 16 rows; 32 rows need 17 x 4


def test_a_step_queues_only_decode_shapes_the_runner_compiles_up_front():
    # After a step of 32 requests (a prefill of short prompts fits 64 tokens), a window of them
    # would take 32 x 4 tokens: the scheduler never runs one, so its 128-token bucket must not
    # compile in the background either.
    k, budget = 3, 64
    spec = BucketSpec(max_num_batched_tokens=budget, max_num_seqs=64)
    layout = StepLayout(16, 8, 100, False, num_speculative_tokens=k)
    compiler = StepCompiler(spec, None, None, layout, num_scheduler_steps=4)
    queued = []
    compiler.executables.compile_in_background = queued.extend
    for num_seqs in range(1, spec.max_num_seqs + 1):
        compiler.queue_decode_shapes(num_seqs)
    assert set(queued) <= set(compiler.all_shapes())
    assert (*spec.window_shape(16, k), SamplerPlan.DYNAMIC) in queued


def _compiler_with_ready(ready: list[Bucket], background: str, monkeypatch) -> StepCompiler:
    """A compiler whose "step" executables of `ready` count as compiled."""
    monkeypatch.setenv("JVLLM_BACKGROUND_COMPILES", background)
    spec = BucketSpec(max_num_batched_tokens=64, max_num_seqs=8)
    compiler = StepCompiler(spec, None, None, StepLayout(16, 8, 100, False))
    compiler.executables.compile_in_background = lambda shapes: None
    for bucket in ready:
        compiler.executables._store((bucket, "step", SamplerPlan.DYNAMIC), "exe")
    return compiler


def test_without_background_compiles_a_decode_step_is_lent_no_mixed_bucket(monkeypatch):
    mixed, decode = Bucket(64, 8, 16), Bucket(8, 8, 1)
    # Compiles in the background: the mixed bucket runs the decode step while its own compiles.
    compiler = _compiler_with_ready([mixed], "1", monkeypatch)
    assert compiler.select_bucket(4, 4, "step") == (mixed, True)
    # None: the lent bucket would be the step's for good; the decode bucket compiles instead,
    # and a larger decode bucket may still be lent.
    compiler = _compiler_with_ready([mixed], "0", monkeypatch)
    assert compiler.select_bucket(1, 1, "step") == (Bucket(1, 1, 1), False)
    compiler = _compiler_with_ready([mixed, decode], "0", monkeypatch)
    assert compiler.select_bucket(1, 1, "step") == (decode, True)
    assert compiler.select_bucket(20, 3, "step") == (mixed, True)  # mixed steps as before
