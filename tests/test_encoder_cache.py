"""The scheduler's side of images (pure Python): the encoder budget cuts a step's tokens
before an image it cannot encode, the encoder cache keeps released images until their room is
needed, and the prefix cache's block hashes carry each image's content hash."""

import pytest

from jvllm.core.config import SchedulerConfig
from jvllm.core.encoder_cache_manager import EncoderCacheManager
from jvllm.core.encoder_scheduler import EncoderScheduler
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.multimodal import MultiModalFeature, PlaceholderRange
from jvllm.core.request import Request
from jvllm.core.scheduler import Scheduler
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.engine.arg_utils import EngineArgs
from jvllm.sampling_params import SamplingParams

IMAGE_TOKEN = 7


def image(key: str, offset: int, length: int = 8) -> MultiModalFeature:
    return MultiModalFeature("image", key, PlaceholderRange(offset, length), data={})


def request_with_images(request_id: str, num_tokens: int, images) -> Request:
    prompt = [100 + i for i in range(num_tokens)]
    for f in images:
        prompt[f.placeholder.offset : f.placeholder.end] = [IMAGE_TOKEN] * f.placeholder.length
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(request_id, prompt, params, eos_token_id=None, mm_features=images)


def make_scheduler(encoder_budget: int, cache_size: int, max_num_batched_tokens=32, images=()):
    """A scheduler holding a 12-token request "a", "b", ... for each of `images` (key, offset)."""
    config = SchedulerConfig(
        max_model_len=128,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_encoder_input_tokens=encoder_budget,
        encoder_cache_size=cache_size,
    )
    scheduler = Scheduler(config, KVCacheManager(num_blocks=64, block_size=4))
    for request_id, (key, offset) in zip("abcd", images):
        scheduler.add_request(request_with_images(request_id, 12, [image(key, offset)]))
    return scheduler


def test_an_image_is_encoded_whole_when_its_first_token_is_scheduled():
    scheduler = make_scheduler(encoder_budget=8, cache_size=8, max_num_batched_tokens=6)
    request = request_with_images("a", 20, [image("x", 4)])
    scheduler.add_request(request)
    out = scheduler.schedule()  # tokens 0..5 reach into the image (4..11)
    assert out.num_scheduled_tokens["a"] == 6
    assert out.scheduled_encoder_inputs == {"a": [0]}
    scheduler.update_from_output(out, {})
    out = scheduler.schedule()  # the rest of the image: from the cache, not encoded again
    assert out.num_scheduled_tokens["a"] == 6
    assert out.scheduled_encoder_inputs == {}


def test_a_step_stops_before_an_image_its_encoder_budget_cannot_take():
    scheduler = make_scheduler(8, 16, images=[("x", 2), ("y", 5)])
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 12, "b": 5}  # b stops before its image
    assert out.scheduled_encoder_inputs == {"a": [0]}
    scheduler.update_from_output(out, {})
    out = scheduler.schedule()
    assert out.scheduled_encoder_inputs == {"b": [0]}


def test_a_shared_image_is_encoded_once_and_held_while_any_request_needs_it():
    scheduler = make_scheduler(16, 8, images=[("x", 2), ("x", 2)])
    out = scheduler.schedule()
    assert out.scheduled_encoder_inputs == {"a": [0]}  # b reads a's encoding
    assert set(out.num_scheduled_tokens) == {"a", "b"}


def test_released_images_stay_cached_until_their_room_is_needed():
    cache = EncoderCacheManager(cache_size=16)
    a = request_with_images("a", 20, [image("x", 0), image("y", 8)])
    for f in a.mm_features:
        assert not cache.use(a, f)
        cache.allocate(a, f)
    cache.release_all(a)
    assert cache.take_freed_hashes() == []
    b = request_with_images("b", 20, [image("x", 0), image("z", 8)])
    assert cache.use(b, b.mm_features[0])  # still held
    assert not cache.use(b, b.mm_features[1])
    assert cache.can_allocate(b.mm_features[1])  # by evicting y, unused
    cache.allocate(b, b.mm_features[1])
    assert cache.take_freed_hashes() == ["y"]
    c = request_with_images("c", 20, [image("w", 0)])
    assert not cache.can_allocate(c.mm_features[0])  # x and z are in use


def test_block_hashes_differ_by_image_and_only_from_the_image_s_first_block():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    one = request_with_images("a", 16, [image("x", 6, 4)])
    same = request_with_images("b", 16, [image("x", 6, 4)])
    other = request_with_images("c", 16, [image("y", 6, 4)])
    for r in (one, same, other):
        kv._update_block_hashes(r)
    assert one.block_hashes == same.block_hashes
    assert other.block_hashes[0] == one.block_hashes[0]  # positions 0..3: no image
    assert all(o != p for o, p in zip(other.block_hashes[1:], one.block_hashes[1:]))


def test_an_image_larger_than_the_budget_and_the_cache_is_encoded_alone():
    scheduler = make_scheduler(4, 4, images=[("big", 2), ("small", 2)])
    out = scheduler.schedule()
    assert out.scheduled_encoder_inputs == {"a": [0]}  # 8 rows: over both, alone
    assert out.num_scheduled_tokens == {"a": 12, "b": 2}  # b waits before its image
    scheduler.update_from_output(out, {})
    out = scheduler.schedule()
    assert out.scheduled_encoder_inputs == {"b": [0]}  # a released "big": evicted for b
    assert out.freed_encoder_hashes == ["big"]


def test_an_undone_encoding_passes_to_a_request_of_the_step_that_reads_the_same_image():
    config = SchedulerConfig(
        max_model_len=128, max_num_encoder_input_tokens=16, encoder_cache_size=16
    )
    encoder = EncoderScheduler(config)
    encoder.start_step()
    a = request_with_images("a", 12, [image("x", 2)])
    b = request_with_images("b", 12, [image("x", 2)])
    assert encoder.inputs_for(a, 0, 12) == ([0], 12)
    assert encoder.inputs_for(b, 0, 12) == ([], 12)  # reads a's encoding
    output = SchedulerOutput(scheduled_requests=[b])  # a was preempted after all
    encoder.undo(a, [0], output)
    assert output.scheduled_encoder_inputs == {"b": [0]}
    assert encoder.cache.users(b.mm_features[0]) == {"b"}
    assert encoder.budget == 8  # still spent: b's step encodes it
    encoder.undo(b, output.scheduled_encoder_inputs.pop("b"), SchedulerOutput())
    assert encoder.cache.users(b.mm_features[0]) == set()  # nobody is left to encode it
    assert encoder.budget == 16 and encoder.cache.num_free_rows == 16


def test_images_kept_whole_refuse_a_prefill_threshold_below_an_image():
    config = EngineArgs(long_prefill_token_threshold=8).create_engine_config()
    with pytest.raises(ValueError, match="long_prefill_token_threshold=8 is less than"):
        config.resolved(512, "reference", max_image_tokens=16, keep_images_whole=True)
    config.resolved(512, "reference", max_image_tokens=16, keep_images_whole=False)
