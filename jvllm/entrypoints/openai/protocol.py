"""Request bodies of the OpenAI API (pydantic), and the OpenAI-shaped error."""

import typing
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jvllm.entrypoints.openai.unsupported import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    RESPONSES_FIELDS,
    TOKENIZE_FIELDS,
    first_unsupported,
)


class OpenAIError(Exception):
    """An error a client caused, sent back as `{"error": {message, type, param, code}}` (with
    `headers`, e.g. a 503's Retry-After)."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.headers = headers
        self.message = message
        self.status_code = status_code
        self.param = param
        self.type = type
        self.code = code if code is not None else status_code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI clients send vendor extensions freely.
    model_config = ConfigDict(extra="ignore")
    # Fields vLLM's API knows and jvllm does not implement (see unsupported.py).
    unsupported_fields: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            # An explicit null where the field takes none means its default, as in vLLM's
            # API, whose such fields are Optional (clients send "stream": null, "n": null).
            data = {
                name: value
                for name, value in data.items()
                if value is not None or name not in cls.model_fields or _takes_none(cls, name)
            }
            path = _lone_surrogate_path(data)
            if path is not None:
                param = ".".join(map(str, path))
                raise OpenAIError(
                    f"{param} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without "
                    "its pair), which is not text; send valid Unicode",
                    param=param,
                )
            name = first_unsupported(data, cls.unsupported_fields, set(cls.model_fields))
            if name is not None:
                raise OpenAIError(
                    f"'{name}' is not supported by jvllm; leave it out (or at its default)",
                    param=name,
                )
        return data


def _lone_surrogate_path(data: Any) -> tuple | None:
    """Where in a parsed JSON body a string holds a lone surrogate (JSON's "\\ud800" decodes to
    one), or None. No tokenizer takes such a string and no UTF-8 reply can carry it back."""
    pending = [((), data)]  # a stack, not recursion: JSON nests as deep as its parser allows
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not _is_unicode(key):
                    return (*path, key)
                pending.append(((*path, key), item))
        elif isinstance(value, list) and not set(map(type, value)) <= {int, float}:
            pending.extend(((*path, i), item) for i, item in enumerate(value))  # not token ids
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _takes_none(model: type[BaseModel], name: str) -> bool:
    annotation = model.model_fields[name].annotation
    return annotation is Any or type(None) in typing.get_args(annotation)


def _check_generation_prompt(request):
    """vLLM's refusal of both continuing the last message and opening a new one: a request
    that sets add_generation_prompt true itself (its default is true) cannot continue."""
    sent = "add_generation_prompt" in request.model_fields_set
    if request.continue_final_message and request.add_generation_prompt and sent:
        raise OpenAIError(
            "continue_final_message and add_generation_prompt cannot both be true: the reply "
            "either continues the last message or starts a new one",
            param="continue_final_message",
        )
    return request


class StreamOptions(_Request):
    include_usage: bool = True  # vLLM's default: `{"continuous_usage_stats": true}` is enough
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    request_id: str | None = None
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt.
    cache_salt: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    priority: int = 0  # vLLM's: lower first, under --scheduling-policy priority
    # Output constraints (structured.py): OpenAI's, vLLM's, and vLLM's older fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    unsupported_fields = COMPLETION_FIELDS
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(_SamplingFields):
    unsupported_fields = CHAT_FIELDS
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    echo: bool = False
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None  # tags, like `user`: they change no answer
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out (--reasoning-parser)

    @model_validator(mode="after")
    def _continue_or_generate(self) -> "ChatCompletionRequest":
        return _check_generation_prompt(self)


class ResponsesRequest(_SamplingFields):
    """OpenAI's Responses API (POST /v1/responses), with vLLM's sampling extras; `text.format`
    is read as `response_format` (structured.py)."""

    unsupported_fields = RESPONSES_FIELDS
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None
    # Function tools, flat ({"type": "function", "name", "parameters"}), as chat's tools.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # Taken as vLLM takes it without a response store: the response is not kept.
    store: bool = True
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the message's logprobs, `top_logprobs` top each, with "message.output_text.logprobs"
    # in `include` (the only value served).
    include: list[str] | None = None
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _text_format_as_response_format(self) -> "ResponsesRequest":
        fmt = (self.text or {}).get("format")
        if fmt is not None and self.response_format is None:
            if not isinstance(fmt, dict):
                raise OpenAIError("text.format must be an object", param="text")
            if fmt.get("type") == "json_schema":  # flat here, nested in chat's response_format
                spec = {k: v for k, v in fmt.items() if k != "type"}
                fmt = {"type": "json_schema", "json_schema": spec}
            self.response_format = fmt
        return self


class TokenizeRequest(_Request):
    unsupported_fields = TOKENIZE_FIELDS
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: messages' tools, written into the prompt as a chat completion's are, so that
    # /tokenize counts what /v1/chat/completions with those tools would send the model.
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _continue_or_generate(self) -> "TokenizeRequest":
        return _check_generation_prompt(self)

    @model_validator(mode="after")
    def _tools_to_the_template(self) -> "TokenizeRequest":
        """The template reads `tools` among its keyword arguments (as render_conversation
        passes a chat completion's); one set in chat_template_kwargs wins, as there."""
        if self.tools is not None:
            self.chat_template_kwargs = {"tools": self.tools, **(self.chat_template_kwargs or {})}
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None
