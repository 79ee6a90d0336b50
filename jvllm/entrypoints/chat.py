"""Chat conversations -> prompts through the tokenizer's chat template (vLLM's `LLM.chat`)."""

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


def render_conversation(
    tokenizer,
    conversation: Conversation,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> dict:
    """A prompt dict holding the rendered text and its token ids, tokenized as HF's
    `apply_chat_template` does (the template writes the special tokens itself)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model ships none")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: pass chat_template")
    text = tokenizer.apply_chat_template(
        conversation,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
    )
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
