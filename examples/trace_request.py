"""Print a request's lifecycle, one line per engine step (seed 003's lab)."""

import sys

from jvllm.tracing import trace_request

prompt = sys.argv[1] if len(sys.argv) > 1 else "hello"
print(f"{prompt!r}, its whole prompt in one step:")
for event in trace_request(prompt, max_tokens=4, compile_all_buckets=False):
    print(event)
# "hello" is one token of the default model's tokenizer: chunk a longer prompt unless given one.
chunked = sys.argv[1] if len(sys.argv) > 1 else "The quick brown fox jumps over"
print(f"\n{chunked!r} with long_prefill_token_threshold=2 (chunked prefill):")
for event in trace_request(
    chunked, max_tokens=4, long_prefill_token_threshold=2, compile_all_buckets=False
):
    print(event)
