"""Random add / abort / step sequences over a small pool keep the block accounting exact and
give every request the output it would get with a pool large enough to never preempt."""

from collections import Counter

from hypothesis import event, given, settings
from hypothesis import strategies as st

from jvllm.core.config import SchedulerConfig
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler import Scheduler
from jvllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
EOS = 3
# Shared prefixes make prefix-cache hits (and blocks shared between requests) common.
PREFIXES = [[], list(range(10, 18)), list(range(10, 14)) + [50, 51, 52, 53]]


def fake_next_token(request: Request) -> int:
    return (request.all_token_ids[-1] * 31 + request.num_tokens - 1) % 97


def step(scheduler: Scheduler) -> None:
    output = scheduler.schedule()
    sampled = {r.request_id: fake_next_token(r) for r in output.scheduled_requests}
    scheduler.update_from_output(output, sampled)


def make_scheduler(num_blocks: int, budget: int, threshold: int) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(config, KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE))


def check_block_accounting(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    live_ids = {r.request_id for r in scheduler.running}
    # Only running requests hold blocks; waiting and preempted ones hold none.
    assert set(kv.req_to_blocks) <= live_ids
    refs = Counter()
    for blocks in kv.req_to_blocks.values():
        ids = [b.block_id for b in blocks]
        assert len(set(ids)) == len(ids)
        refs.update(ids)
    assert 0 not in refs
    for block in pool.blocks[1:]:
        assert block.ref_cnt == refs[block.block_id]
    num_used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert num_used + kv.num_free_blocks == kv.num_usable_blocks
    for block_hash, blocks in pool._cached_blocks.items():
        assert blocks
        assert all(block.block_hash == block_hash for block in blocks)


request_specs = st.tuples(
    st.sampled_from(range(len(PREFIXES))),
    st.integers(1, 40),  # prompt tail length; some prompts exceed MAX_MODEL_LEN
    st.integers(1, 20),  # max_tokens
    st.booleans(),  # ignore_eos
)
add_operation = st.tuples(st.just("add"), request_specs)
operations = st.lists(
    st.one_of(
        add_operation,
        add_operation,  # listed twice: adds twice as likely, to build memory pressure
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=60,
)


def make_request(index: int, spec) -> Request:
    prefix_index, tail_len, max_tokens, ignore_eos = spec
    prompt = PREFIXES[prefix_index] + [100 + index + i for i in range(tail_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=[5])
    return Request(f"r{index}", prompt, params, eos_token_id=EOS)


@settings(max_examples=400, deadline=None)
@given(
    ops=operations,
    num_blocks=st.integers(9, 11),
    budget=st.integers(4, 24),
    threshold=st.sampled_from([0, 3, 8]),
)
def test_random_workload_keeps_blocks_exact_and_outputs_deterministic(
    ops, num_blocks, budget, threshold
):
    scheduler = make_scheduler(num_blocks, budget, threshold)
    specs, requests, aborted = [], [], set()
    for op, arg in ops:
        if op == "add":
            requests.append(make_request(len(specs), arg))
            specs.append(arg)
            scheduler.add_request(requests[-1])
        elif op == "abort" and arg < len(requests):
            request_id = requests[arg].request_id
            if scheduler.get_request(request_id) is not None:
                aborted.add(request_id)
            scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        elif op == "step":
            for _ in range(arg):
                step(scheduler)
        check_block_accounting(scheduler)

    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
        check_block_accounting(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert all(r.is_finished for r in requests)
    assert scheduler.kv_cache_manager.num_free_blocks == num_blocks - 1
    event(f"preempted: {scheduler.num_preemptions_total > 0}")
    event(f"prefix hits: {scheduler.kv_cache_manager.prefix_cache_hits > 0}")

    reference = make_scheduler(num_blocks=200, budget=64, threshold=0)
    reference_requests = [make_request(i, spec) for i, spec in enumerate(specs)]
    for request in reference_requests:
        reference.add_request(request)
    while reference.has_unfinished_requests():
        step(reference)
    assert reference.num_preemptions_total == 0
    for request, expected in zip(requests, reference_requests):
        if request.request_id not in aborted:
            assert request.status == expected.status
            assert request.output_token_ids == expected.output_token_ids
