"""Chat conversations -> prompts through the tokenizer's chat template (vLLM's `LLM.chat`)."""

import json

Conversation = list[dict]


def as_conversations(messages) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them -> a list of them."""
    messages = list(messages)
    if not messages:
        raise ValueError("messages must not be empty")
    if all(isinstance(m, dict) for m in messages):
        return [messages]
    if all(isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c) for c in messages):
        return [list(c) for c in messages]
    raise ValueError("messages must be a list of message dicts or a list of such conversations")


def text_content(conversation: Conversation) -> Conversation:
    """The conversation with each list of content parts (OpenAI's multi-part input) joined into
    one string, its text parts separated by newlines, as vLLM does for templates that take a
    string; a part of any other type (image_url, input_audio, ...) is a ValueError naming it.
    No content, or null (an assistant turn that only calls tools, as OpenAI returns it), is
    the empty string, as vLLM gives it to templates."""
    flat = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if content is None:
            message = {**message, "content": ""}
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(
                        f"messages[{i}].content[{j}] is a {kind!r} part; jvllm takes only "
                        'text parts ({"type": "text", "text": ...})'
                    )
                texts.append(part["text"])
            message = {**message, "content": "\n".join(texts)}
        flat.append(message)
    return flat


def _tool_call_arguments_as_objects(conversation: Conversation) -> Conversation:
    """Assistant `tool_calls` whose arguments are JSON text (OpenAI's form) with the arguments
    parsed, as chat templates expect a mapping there (vLLM does the same)."""
    out = []
    for message in conversation:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            parsed = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    try:
                        arguments = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        arguments = function["arguments"]
                    call = {**call, "function": {**function, "arguments": arguments}}
                parsed.append(call)
            message = {**message, "tool_calls": parsed}
        out.append(message)
    return out


def render_conversation(
    tokenizer,
    conversation: Conversation,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None,
    add_special_tokens: bool = False,
    tools: list[dict] | None = None,
) -> dict:
    """A prompt dict holding the rendered text and its token ids, tokenized as HF's
    `apply_chat_template` does (the template writes the special tokens itself, so
    `add_special_tokens` adds any only on request). `tools` (OpenAI's function definitions) go
    to the template, which writes them into the prompt."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model ships none")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: pass chat_template")
    options = {
        "tools": tools,
        "chat_template": chat_template,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    options.update(chat_template_kwargs or {})  # they override the named ones, as in vLLM
    text = tokenizer.apply_chat_template(
        _tool_call_arguments_as_objects(text_content(conversation)),
        **{**options, "tokenize": False},
    )
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return {"prompt": text, "prompt_token_ids": ids}
