"""A conversation as prompt token ids under the chat template, for the server: the server's
template (--chat-template) or the tokenizer's, a request's own only where the server trusts
those, and what the template cannot take refused as a 400 that names `messages`."""

from __future__ import annotations

from typing import Any

from jvllm.entrypoints.chat import ContentError, has_images, render_conversation
from jvllm.entrypoints.media import MediaError
from jvllm.entrypoints.openai.protocol import OpenAIError


class ChatRendering:
    """How OpenAIServingChat renders its messages; it reads the serving's `tokenizer`,
    `trust_request_chat_template`, `chat_template` and `images` (chat.py's chat_images)."""

    tokenizer: Any
    trust_request_chat_template: bool
    chat_template: str | None
    images: Any

    def render(self, messages: list[dict], *args, **kwargs) -> list[int]:
        """render_prompt's token ids, for endpoints that take text alone (/tokenize, the
        Responses API): image parts are refused, not fetched."""
        if has_images(messages):
            raise OpenAIError(
                "image parts are taken by /v1/chat/completions only", param="messages"
            )
        return self.render_prompt(messages, *args, **kwargs)["prompt_token_ids"]

    def render_prompt(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict | None = None,
        chat_template: str | None = None,
        add_special_tokens: bool = False,
        tools: list[dict] | None = None,
    ) -> dict:
        """The prompt token ids of a conversation under the chat template: the tokenizer's, or
        the request's own when the server trusts those (vLLM's --trust-request-chat-template)."""
        kwargs = dict(kwargs or {})
        chat_template = chat_template or kwargs.pop("chat_template", None)
        if chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError(
                "this server refuses a chat_template sent with the request; start it with "
                "--trust-request-chat-template to allow one",
                param="chat_template",
            )
        chat_template = chat_template or self.chat_template
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(
                "this model's tokenizer has no chat template; start the server with "
                "--chat-template (a Jinja template or a file holding one)",
                param="messages",
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise OpenAIError(
                    f"messages[{i}] must be an object with a 'role'", param="messages"
                )
        try:
            prompt = render_conversation(
                self.tokenizer,
                messages,
                chat_template,
                add_generation_prompt and not continue_final_message,
                continue_final_message,
                kwargs,
                add_special_tokens,
                tools,
                self.images,
            )
        except (MediaError, ContentError) as e:  # a part it cannot take, an image it cannot load
            raise OpenAIError(str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - a template error is the messages' fault
            raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
        return prompt
