"""Scheduler behaviour, driven by a deterministic fake model."""

import pytest

from jvllm.core.config import SchedulerConfig
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler import Scheduler
from jvllm.sampling_params import SamplingParams

EOS = 7


def make_scheduler(num_blocks=64, block_size=4, max_model_len=64, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    return Scheduler(SchedulerConfig(max_model_len=max_model_len, **config), kv)


def add(scheduler, request_id, num_prompt_tokens=5, first_token=100, **params) -> Request:
    params.setdefault("ignore_eos", True)
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    request = Request(request_id, prompt, SamplingParams(**params), eos_token_id=EOS)
    scheduler.add_request(request)
    return request


def fake_next_token(request: Request) -> int:
    """Depends only on the sequence so far, so outputs do not depend on scheduling."""
    return (request.all_token_ids[-1] * 31 + request.num_tokens - 1) % 1000


def step(scheduler, token_id=None):
    """One engine step. Like a real runner, returns a token for every row, mid-prefill too."""
    output = scheduler.schedule()
    sampled = {
        r.request_id: fake_next_token(r) if token_id is None else token_id
        for r in output.scheduled_requests
    }
    return output, scheduler.update_from_output(output, sampled)


def run_to_completion(scheduler, max_steps=1000):
    finished = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        finished += step(scheduler)[1]
    raise AssertionError("requests did not finish")


def test_lifecycle_trace_of_one_request():
    scheduler = make_scheduler()
    request = add(scheduler, "req-0", num_prompt_tokens=5, max_tokens=4)
    events = []
    while scheduler.has_unfinished_requests():
        _, finished = step(scheduler)
        for r in scheduler.running + finished:
            events.append((r.status.name, r.num_computed_tokens, r.num_tokens))
    assert events == [
        ("RUNNING", 5, 6),
        ("RUNNING", 6, 7),
        ("RUNNING", 7, 8),
        ("FINISHED_LENGTH", 8, 9),
    ]
    assert request.finish_reason == "length"
    assert scheduler.kv_cache_manager.num_free_blocks == 63


def test_long_prefill_threshold_chunks_the_prompt():
    scheduler = make_scheduler(long_prefill_token_threshold=2)
    request = add(scheduler, "a", num_prompt_tokens=10, max_tokens=2)
    trace = []
    for _ in range(5):
        output, _ = step(scheduler)
        assert output.num_scheduled_tokens["a"] == 2
        trace.append((request.num_computed_tokens, request.num_tokens))
    assert trace == [(2, 10), (4, 10), (6, 10), (8, 10), (10, 11)]


def test_token_budget_is_shared_and_running_goes_first():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, "a", num_prompt_tokens=6)
    add(scheduler, "b", num_prompt_tokens=6, first_token=200)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 6, "b": 2}
    output, _ = step(scheduler)
    assert [r.request_id for r in output.scheduled_requests] == ["a", "b"]
    assert output.num_scheduled_tokens == {"a": 1, "b": 4}
    assert output.total_num_scheduled_tokens == 5


def test_prefill_and_decode_share_a_step():
    scheduler = make_scheduler()
    add(scheduler, "a")
    step(scheduler)
    add(scheduler, "b", num_prompt_tokens=9, first_token=200)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 1, "b": 9}
    assert not output.is_decode_only
    assert all(output.will_sample(r) for r in output.scheduled_requests)


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        add(scheduler, f"r{i}", first_token=100 * (i + 1))
    output, _ = step(scheduler)
    assert [r.request_id for r in output.scheduled_requests] == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_without_chunked_prefill_a_prompt_waits_for_budget():
    scheduler = make_scheduler(
        max_model_len=16, max_num_batched_tokens=16, enable_chunked_prefill=False
    )
    add(scheduler, "a", num_prompt_tokens=10)
    add(scheduler, "b", num_prompt_tokens=10, first_token=200)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 10}
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 10}


def test_preempted_request_resumes_with_identical_tokens():
    def start(num_blocks):
        scheduler = make_scheduler(num_blocks=num_blocks)
        requests = [
            add(scheduler, name, first_token=t, max_tokens=12)
            for name, t in (("a", 100), ("b", 200), ("c", 300))
        ]
        return scheduler, requests

    # 8 usable blocks of 4 tokens; each request grows to 17 tokens (5 blocks).
    scheduler, requests = start(num_blocks=9)
    preempted = []
    while scheduler.has_unfinished_requests():
        running_before = {r.request_id for r in scheduler.running}
        output, _ = step(scheduler)
        for victim in output.preempted_requests:
            assert victim.status == RequestStatus.PREEMPTED
            assert victim.num_computed_tokens == 0
            preempted.append(victim.request_id)
        if output.preempted_requests:
            assert scheduler.waiting[0] is output.preempted_requests[-1]
            # No admissions in a step that preempted.
            assert set(output.num_scheduled_tokens) <= running_before
    assert preempted[0] == "c"
    assert scheduler.num_preemptions_total == len(preempted)
    assert scheduler.kv_cache_manager.num_free_blocks == 8

    reference_scheduler, reference = start(num_blocks=64)
    run_to_completion(reference_scheduler)
    assert reference_scheduler.num_preemptions_total == 0
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in reference]
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)


def test_prompt_that_can_never_fit_is_ignored_and_the_next_runs():
    scheduler = make_scheduler(num_blocks=5, max_model_len=64)
    # 16 tokens fill the 4 usable blocks, leaving no room for the first decode step.
    too_long = add(scheduler, "big", num_prompt_tokens=16)
    small = add(scheduler, "small", num_prompt_tokens=3, first_token=200)
    output, finished = step(scheduler)
    assert output.finished_requests == [too_long]
    assert finished[0] is too_long
    assert too_long.status == RequestStatus.FINISHED_IGNORED
    assert too_long.finish_reason == "length"
    assert "KV blocks" in too_long.status_message
    assert output.scheduled_requests == [small]
    assert scheduler.get_request("big") is None


def test_prompt_longer_than_max_model_len_is_ignored():
    scheduler = make_scheduler(max_model_len=8)
    request = add(scheduler, "a", num_prompt_tokens=9)
    output, _ = step(scheduler)
    assert request.status == RequestStatus.FINISHED_IGNORED
    assert "max_model_len" in request.status_message
    assert output.is_empty


def test_eos_stops_the_request():
    scheduler = make_scheduler()
    request = add(scheduler, "a", ignore_eos=False)
    _, finished = step(scheduler, token_id=EOS)
    assert finished == [request]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.finish_reason == "stop"
    assert request.output_token_ids == [EOS]
    assert not scheduler.running


def test_ignore_eos_keeps_generating():
    scheduler = make_scheduler()
    request = add(scheduler, "a", ignore_eos=True, max_tokens=3)
    assert step(scheduler, token_id=EOS)[1] == []
    assert step(scheduler, token_id=EOS)[1] == []
    assert step(scheduler, token_id=EOS)[1] == [request]
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_eos_is_ignored_before_min_tokens():
    scheduler = make_scheduler()
    request = add(scheduler, "a", ignore_eos=False, min_tokens=2)
    assert step(scheduler, token_id=EOS)[1] == []
    assert step(scheduler, token_id=EOS)[1] == [request]
    assert request.num_output_tokens == 2


def test_stop_token_ids_stop_with_a_reason():
    scheduler = make_scheduler()
    request = add(scheduler, "a", stop_token_ids=[9])
    step(scheduler, token_id=3)
    assert step(scheduler, token_id=9)[1] == [request]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 9


def test_max_model_len_ends_the_request():
    scheduler = make_scheduler(max_model_len=8)
    request = add(scheduler, "a", num_prompt_tokens=5, max_tokens=20)
    run_to_completion(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 8


def test_mid_prefill_chunks_sample_nothing():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = add(scheduler, "a", num_prompt_tokens=10)
    output = scheduler.schedule()
    assert not output.will_sample(request)
    scheduler.update_from_output(output, {"a": 5})
    assert request.output_token_ids == []
    assert request.num_computed_tokens == 4


@pytest.mark.parametrize("steps_before_abort", [0, 1])
def test_abort_frees_blocks(steps_before_abort):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = add(scheduler, "a", num_prompt_tokens=12)
    for _ in range(steps_before_abort):
        step(scheduler)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert request.finish_reason == "abort"
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.running and not scheduler.waiting
    assert scheduler.kv_cache_manager.num_free_blocks == 63


def test_prefix_cache_hit_skips_computed_tokens():
    scheduler = make_scheduler()
    add(scheduler, "a", num_prompt_tokens=10)
    step(scheduler)
    second = add(scheduler, "b", num_prompt_tokens=10)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens["b"] == 2
    assert second.num_cached_tokens == 8
    assert output.block_ids["b"][:2] == output.block_ids["a"][:2]


def test_prefix_hit_counters_count_each_admitted_request_once():
    # 5 usable blocks of 4: "b" (19 prompt tokens + 1, 5 blocks) waits until "a" finishes.
    scheduler = make_scheduler(num_blocks=6, max_model_len=24)
    add(scheduler, "a", num_prompt_tokens=10, max_tokens=10)
    step(scheduler)
    add(scheduler, "b", num_prompt_tokens=19, max_tokens=1)
    num_waiting_steps = 0
    while scheduler.waiting:
        step(scheduler)
        num_waiting_steps += bool(scheduler.waiting)
    run_to_completion(scheduler)
    assert num_waiting_steps > 1  # "b" was looked up in several steps before it got blocks
    kv = scheduler.kv_cache_manager
    assert kv.prefix_cache_queries == 10 + 19
    assert kv.prefix_cache_hits == 8  # b's first two blocks are a's, cached after a finished


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler()
    add(scheduler, "a")
    with pytest.raises(ValueError, match="already"):
        add(scheduler, "a")


def _window_step(scheduler):
    """A step whose window rows sample their whole limit of fake tokens (as the device would,
    save for stops, which the scheduler checks itself)."""
    output = scheduler.schedule()
    sampled = {}
    for r in output.scheduled_requests:
        tokens, probe = [], Request("probe", r.all_token_ids, r.sampling_params, EOS)
        for _ in range(output.window_limits.get(r.request_id, 1)):
            tokens.append(fake_next_token(probe))
            probe.append_output_token_ids(tokens[-1])
        sampled[r.request_id] = tokens if output.num_steps > 1 else tokens[0]
    return output, scheduler.update_from_output(output, sampled)


def test_decode_windows_cover_their_tokens_with_blocks_and_stop_at_each_limit():
    scheduler = make_scheduler(num_scheduler_steps=8, max_model_len=40)
    short = add(scheduler, "short", max_tokens=5)
    long = add(scheduler, "long", first_token=200, max_tokens=30)
    held = add(scheduler, "held", first_token=300, max_tokens=20, min_tokens=4)
    output, _ = _window_step(scheduler)  # the prefills: one step, one token each
    assert output.num_steps == 1
    output, finished = _window_step(scheduler)
    assert output.num_steps == 8
    # max_tokens, min_tokens (the window stops where the stop checks change) and the window.
    assert output.window_limits == {"short": 4, "long": 8, "held": 3}
    kv = scheduler.kv_cache_manager
    assert len(kv.get_block_ids("long")) * 4 >= long.num_computed_tokens + 1
    assert finished == [short] and short.num_output_tokens == 5
    assert (long.num_output_tokens, held.num_output_tokens) == (9, 4)
    for request in (long, held):
        assert request.num_computed_tokens == request.num_tokens - 1
    while scheduler.has_unfinished_requests():
        _window_step(scheduler)
    assert long.num_tokens == 35 and held.num_output_tokens == 20
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_waiting_request_that_fits_is_prefilled_before_any_window():
    scheduler = make_scheduler(num_scheduler_steps=4)
    add(scheduler, "a")
    _window_step(scheduler)
    add(scheduler, "b", first_token=200)
    output, _ = _window_step(scheduler)
    assert output.num_steps == 1 and output.num_scheduled_tokens == {"a": 1, "b": 5}
    assert _window_step(scheduler)[0].num_steps == 4


def test_a_window_short_of_blocks_falls_back_to_a_single_step():
    # 8 usable blocks of 4: two prompts of 14 tokens hold 4 each; their next token still fits,
    # a window of 4 would need a fifth block each.
    scheduler = make_scheduler(num_blocks=9, num_scheduler_steps=4)
    add(scheduler, "a", num_prompt_tokens=14, max_tokens=8)
    add(scheduler, "b", num_prompt_tokens=14, first_token=200, max_tokens=8)
    _window_step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    output, _ = _window_step(scheduler)
    assert output.num_steps == 1 and not output.preempted_requests


class _FakeGrammar:
    """A structured-outputs matcher stand-in: compiling until `ready`, then ending after
    `length` tokens."""

    def __init__(self, length=3, error=None):
        self.ready, self.error, self.length, self.accepted = False, error, length, []

    def is_ready(self):
        return self.ready

    def accept(self, token_id):
        self.accepted.append(token_id)
        return True

    @property
    def is_terminated(self):
        return len(self.accepted) >= self.length


def test_request_whose_grammar_compiles_waits_without_holding_back_others():
    scheduler = make_scheduler(num_scheduler_steps=4)
    constrained = add(scheduler, "constrained", max_tokens=10)
    constrained.structured_output = grammar = _FakeGrammar(length=3)
    add(scheduler, "free", max_tokens=10)
    output, _ = step(scheduler)
    assert [r.request_id for r in output.scheduled_requests] == ["free"]
    assert list(scheduler.waiting) == [constrained]
    grammar.ready = True
    finished = run_to_completion(scheduler)
    # The grammar's end stops the request with reason "stop" after exactly its tokens.
    assert constrained.finish_reason == "stop" and constrained.num_output_tokens == 3
    assert grammar.accepted == constrained.output_token_ids
    assert {r.request_id for r in finished} == {"constrained", "free"}


def test_constrained_requests_run_single_steps_and_failed_grammars_abort():
    scheduler = make_scheduler(num_scheduler_steps=4)
    constrained = add(scheduler, "constrained", max_tokens=10)
    constrained.structured_output = _FakeGrammar(length=5)
    constrained.structured_output.ready = True
    broken = add(scheduler, "broken", max_tokens=10)
    broken.structured_output = _FakeGrammar(error="the grammar failed to compile: boom")
    broken.structured_output.ready = True
    _, finished = step(scheduler)
    assert finished == [broken] and broken.finish_reason == "abort"
    assert "boom" in broken.status_message
    while scheduler.has_unfinished_requests():
        assert step(scheduler)[0].num_steps == 1  # never a decode window
    assert scheduler.kv_cache_manager.num_free_blocks == 63


def _request(request_id, priority, arrival_time, num_prompt_tokens=5, first_token=100):
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    return Request(request_id, prompt, params, EOS, arrival_time, priority=priority)


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, priority, arrival in (("a", 2, 1.0), ("b", 0, 2.0), ("c", 1, 3.0), ("d", 0, 4.0)):
        scheduler.add_request(_request(rid, priority, arrival, first_token=ord(rid) * 10))
    order = []
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        order += [r.request_id for r in output.scheduled_requests if r.request_id not in order]
    assert order == ["b", "d", "c", "a"]


def test_priority_policy_preempts_the_lowest_priority_even_if_already_scheduled():
    def start(num_blocks):
        scheduler = make_scheduler(num_blocks=num_blocks, policy="priority")
        low = _request("low", 9, 1.0, num_prompt_tokens=1)
        scheduler.add_request(low)
        step(scheduler)  # "low" runs first, so it is scheduled before "high" in each step
        high = _request("high", 0, 2.0, num_prompt_tokens=8, first_token=200)
        scheduler.add_request(high)
        return scheduler, low, high

    # 5 usable blocks of 4 tokens, of the 9 both need: "high" soon needs one "low" holds.
    scheduler, low, high = start(num_blocks=6)
    preempted_while_scheduled = False
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        assert high not in output.preempted_requests
        if low in output.preempted_requests and high in output.scheduled_requests:
            # "low" was scheduled in this step before "high" ran short: the step drops it.
            assert low not in output.scheduled_requests
            assert set(output.num_scheduled_tokens) == {"high"}
            preempted_while_scheduled = True
    assert preempted_while_scheduled
    reference, ref_low, ref_high = start(num_blocks=64)
    run_to_completion(reference)
    assert reference.num_preemptions_total == 0
    assert low.output_token_ids == ref_low.output_token_ids
    assert high.output_token_ids == ref_high.output_token_ids
    assert scheduler.kv_cache_manager.num_free_blocks == 5


def test_scheduling_policy_is_checked():
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        make_scheduler(policy="lifo")


def test_a_victim_skipped_this_step_leaves_the_requests_after_it_scheduled():
    scheduler = make_scheduler(num_blocks=5, policy="priority")
    low = _request("low", 9, 1.0, num_prompt_tokens=1)
    scheduler.add_request(low)
    step(scheduler)
    scheduler.add_request(_request("b", 0, 2.0, num_prompt_tokens=1, first_token=200))
    scheduler.add_request(_request("c", 0, 3.0, num_prompt_tokens=3, first_token=300))
    for i in range(30):
        running = [r.request_id for r in scheduler.running]
        output = scheduler.schedule()
        if low in output.preempted_requests:
            # "low" came first and caught up with no token (so was not scheduled); "b" ran
            # short of blocks: "low" gives its blocks back and "c", after it, still runs.
            assert running == ["low", "b", "c"] and "low" not in output.num_scheduled_tokens
            assert set(output.num_scheduled_tokens) == {"b", "c"}
            return
        sampled = {r.request_id: fake_next_token(r) for r in output.scheduled_requests}
        if i % 2 == 0:
            sampled.pop("low", None)  # its token lost: caught up, with none to decode, next step
        scheduler.update_from_output(output, sampled)
    raise AssertionError("no preemption")


def test_an_undone_victims_unwritten_blocks_leave_the_prefix_cache():
    # 8 usable blocks of 4 tokens; prompts prefilled 8 tokens a step.
    scheduler = make_scheduler(num_blocks=9, policy="priority", long_prefill_token_threshold=8)
    low = _request("low", 9, 1.0, num_prompt_tokens=24)
    scheduler.add_request(low)
    step(scheduler)
    scheduler.add_request(_request("high", 0, 2.0, num_prompt_tokens=8, first_token=500))
    while low not in step(scheduler)[0].preempted_requests:
        pass
    # "low" had computed 16 tokens when its third chunk was scheduled and then undone.
    _, num_hit_tokens = scheduler.kv_cache_manager.get_computed_blocks(low)
    assert num_hit_tokens == 16
