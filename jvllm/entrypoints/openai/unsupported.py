"""The request fields of vLLM's OpenAI API (and of OpenAI's own) that jvllm does not implement.

A request that sets one to anything but a value meaning "unused" gets a 400 naming it, rather
than an answer that silently ignored it. Fields neither API knows stay ignored: clients send
vendor extensions freely. A field a request model declares is never refused here, so a feature
that gets implemented only has to declare its field.
"""

from typing import Any

# Beside None, which always means unused: each field's other unused values (its defaults).
_COMMON: dict[str, tuple] = {
    "logits_processors": ([],),
    "kv_transfer_params": ({},),
    "vllm_xargs": ({},),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
}

COMPLETION_FIELDS: dict[str, tuple] = {
    **_COMMON,
    "prompt_embeds": (),
    "suffix": ("",),
}

CHAT_FIELDS: dict[str, tuple] = {
    **_COMMON,
    "functions": ([],),
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "documents": ([],),
    "mm_processor_kwargs": ({},),
    "media_io_kwargs": ({},),
    "store": (False,),
    "service_tier": ("auto", "default"),
}

RESPONSES_FIELDS: dict[str, tuple] = {
    **_COMMON,
    "previous_response_id": (),  # jvllm keeps no responses to continue from
    "conversation": (),
    "prompt": (),  # a stored prompt template
    "reasoning": (),
    "background": (False,),
    "max_tool_calls": (),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
}

TOKENIZE_FIELDS: dict[str, tuple] = {"mm_processor_kwargs": ({},)}


def first_unsupported(
    body: dict[str, Any], unsupported: dict[str, tuple], declared: set[str]
) -> str | None:
    """The first field of `body` in `unsupported` (and not in `declared`) set to a used value."""
    for name, unused in unsupported.items():
        if name in declared or name not in body:
            continue
        value = body[name]
        if value is not None and not any(value == u for u in unused):
            return name
    return None
