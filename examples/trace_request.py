"""Print a request's lifecycle, one line per engine step (seed 003's lab)."""

import sys

from jvllm.tracing import trace_request

prompt = sys.argv[1] if len(sys.argv) > 1 else "hello"
for event in trace_request(prompt, max_tokens=4, compile_all_buckets=False):
    print(event)
print("\nwith long_prefill_token_threshold=2 (chunked prefill):")
for event in trace_request(
    prompt, max_tokens=4, long_prefill_token_threshold=2, compile_all_buckets=False
):
    print(event)
