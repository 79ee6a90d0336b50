"""Chat conversations -> prompts through the tokenizer's chat template (vLLM's `LLM.chat`)."""

import json
from collections.abc import Callable
from typing import NamedTuple

from jvllm.engine.data_parallel import replicas
from jvllm.entrypoints.media import MediaConnector

Conversation = list[dict]


class ContentError(ValueError):
    """A message content that jvllm cannot take (a part of a type it does not serve, one without
    its fields); the HTTP layer answers it with a 400 naming the part."""


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


# The content parts that carry an image: OpenAI's image_url ({"url": ...} or the URL itself)
# and vLLM's image_pil (a PIL image, offline only).
IMAGE_PART_TYPES = ("image_url", "image_pil")


def has_images(conversation: Conversation) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
        for message in conversation
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


class ChatImages(NamedTuple):
    """How chat messages' images reach a model that takes them: the placeholder its template
    writes for each (its image token), the loader of image_url parts, the most a prompt may
    hold (None: any number), and whether image_pil parts are taken (offline only)."""

    placeholder: str
    load: Callable
    limit: int | None = None
    takes_pil: bool = True


def image_content(conversation: Conversation, images: ChatImages) -> tuple[Conversation, list]:
    """(the conversation with each image part as {"type": "image"} and each text part as is,
    the images in order, each loaded by `images.load(url)` or given as a PIL image), as vLLM
    gives content to the chat templates of models that take images. Too many image parts are
    refused before any is loaded."""
    num_parts = sum(
        isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
        for message in conversation
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )
    if images.limit is not None and num_parts > images.limit:
        raise ContentError(
            f"the messages hold {num_parts} images, more than limit_mm_per_prompt allows "
            f"({images.limit})"
        )
    load_image, loaded = images.load, []
    out = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            out.append({**message, "content": content or ""})
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "text":
                parts.append(
                    {"type": "text", "text": part_text(part, f"messages[{i}].content[{j}]")}
                )
                continue
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ContentError(
                        f'messages[{i}].content[{j}].image_url must be {{"url": "..."}}'
                    )
                loaded.append(load_image(url))
            elif kind == "image_pil" and not images.takes_pil:
                raise ContentError(
                    f"messages[{i}].content[{j}] is an image_pil part, which only the offline "
                    "LLM.chat takes; send the image as an image_url (a data: URL)"
                )
            elif kind == "image_pil" and part.get("image_pil") is not None:
                loaded.append(part["image_pil"])
            else:
                raise ContentError(
                    f"messages[{i}].content[{j}] is a {kind!r} part; jvllm takes text, "
                    "image_url and image_pil parts (video and audio are not supported yet)"
                )
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, loaded


def _placeholder_strings(conversation: Conversation, placeholder: str) -> Conversation:
    """Content lists as strings for a template that takes only strings: each message's image
    placeholders first, then its texts, one a line (vLLM's "string" content format)."""
    out = []
    for message in conversation:
        content = message["content"]
        if isinstance(content, list):
            pieces = [placeholder for p in content if p["type"] == "image"]
            pieces += [p["text"] for p in content if p["type"] == "text"]
            message = {**message, "content": "\n".join(pieces)}
        out.append(message)
    return out


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
                if kind in IMAGE_PART_TYPES:
                    raise ContentError(
                        f"messages[{i}].content[{j}] is an {kind!r} part, and this model "
                        "takes no images: serve one that does (e.g. LLaVA-1.5)"
                    )
                if kind != "text":
                    raise ContentError(
                        f"messages[{i}].content[{j}] is a {kind!r} part; jvllm takes "
                        'text parts ({"type": "text", "text": ...}) and, for a model that '
                        "takes images, image parts (video and audio are not supported yet)"
                    )
                texts.append(part_text(part, f"messages[{i}].content[{j}]"))
            message = {**message, "content": "\n".join(texts)}
        flat.append(message)
    return flat


def part_text(part: dict, where: str) -> str:
    """A text part's text, or a ContentError naming the field (`where`.text): OpenAI's API
    requires it."""
    if "text" not in part:
        kind = part.get("type")
        raise ContentError(
            f'{where}.text is missing: a {kind} part needs it ({{"type": "{kind}", "text": ...}})'
        )
    if not isinstance(part["text"], str):
        raise ContentError(f"{where}.text must be a string, got {part['text']!r}"[:200])
    return part["text"]


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
    images: ChatImages | None = None,
) -> dict:
    """A prompt dict holding the rendered text and its token ids, tokenized as HF's
    `apply_chat_template` does (the template writes the special tokens itself, so
    `add_special_tokens` adds any only on request). `tools` (OpenAI's function definitions) go
    to the template, which writes them into the prompt. For a model that takes images
    (`images`), image parts become placeholders in the prompt and its `multi_modal_data`."""
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
    render = lambda c: tokenizer.apply_chat_template(
        _tool_call_arguments_as_objects(c), **{**options, "tokenize": False}
    )
    loaded = []
    if images is not None and has_images(conversation):
        conversation, loaded = image_content(conversation, images)
        try:
            text = render(conversation)
        except Exception:  # noqa: BLE001 - a template of strings may fail on a list
            text = None
        if text is None or text.count(images.placeholder) != len(loaded):  # strings, then
            text = render(_placeholder_strings(conversation, images.placeholder))
    else:
        text = render(text_content(conversation))
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    prompt = {"prompt": text, "prompt_token_ids": ids}
    if loaded:
        prompt["multi_modal_data"] = {"image": loaded}
    return prompt


def chat_images(engine, takes_pil: bool = True) -> ChatImages | None:
    """How chat messages' images reach `engine` (an LLMEngine or its data-parallel front);
    None for a model that takes none. The loader reads only what allowed_local_media_path and
    allowed_media_domains let; `takes_pil`: image_pil parts are taken (offline)."""
    engine = replicas(engine)[0]
    if engine.mm_processor is None:
        return None
    mm = engine.engine_config.multimodal_config
    domains = list(mm.allowed_media_domains) if mm.allowed_media_domains else None
    media = MediaConnector(mm.allowed_local_media_path, domains)
    limit = (mm.limit_mm_per_prompt or {}).get("image")
    return ChatImages(engine.mm_processor.image_token, media.fetch_image, limit, takes_pil)
