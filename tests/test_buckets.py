"""The padded step shapes: which bucket a step lands in."""

from jvllm.worker.buckets import Bucket, BucketSpec


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
