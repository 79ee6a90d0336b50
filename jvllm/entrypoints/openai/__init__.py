"""The OpenAI-compatible HTTP server: `jvllm serve`."""
