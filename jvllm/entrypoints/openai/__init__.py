"""The OpenAI-compatible HTTP server: `jvllm serve`."""

# Defaults the CLI shows, defined here where importing them needs no server package.
# A body over this is a 413 (admission.py): a prompt of 128k token ids is about 1 MB of JSON.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
