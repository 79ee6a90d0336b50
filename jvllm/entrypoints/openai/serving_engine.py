"""What completions and chat share: model check, sampling params, length checks and logprobs;
running a request's prompts through the engine is prompt_runs.py's."""

from __future__ import annotations

import hashlib
import json
import time
import uuid

from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.input_processor import check_priority, truncate_prompt
from jvllm.entrypoints.beam_search import check_beam_search
from jvllm.entrypoints.openai.engine_errors import param_of
from jvllm.entrypoints.openai.prompt_runs import PromptRuns
from jvllm.entrypoints.openai.protocol import OpenAIError
from jvllm.entrypoints.openai.serving_models import ServedModels
from jvllm.lora.request import LoRARequest
from jvllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

_ENGINE_SEEDS = 2**32  # the engine's seeds are u32 (a PRNG key each)
_INT64 = 2**63
# What a 503 for a full waiting queue tells the client to wait: about a few steps' worth.


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    """OpenAI's `usage` object."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def response_id(prefix: str, request_id: str | None) -> str:
    """`{prefix}-{request_id}` (vLLM's), with a random id when the request sent none."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters one token stands for: its longest vocabulary entry (a byte-level
    entry has one character per byte, at least as many as the text it decodes to). None without
    a tokenizer."""
    if tokenizer is None:
        return None
    return max(map(len, tokenizer.get_vocab()), default=1)


def engine_seed(seed: int | None) -> int | None:
    """An API seed (any int64, as vLLM takes) as an engine seed in [0, 2**32): those already in
    range as they are (the same samples as offline), any other hashed into it."""
    if seed is None or 0 <= seed < _ENGINE_SEEDS:
        return seed
    if not -_INT64 <= seed < _INT64:
        raise OpenAIError(f"seed must be an int64 (in [-2**63, 2**63)), got {seed}", param="seed")
    digest = hashlib.blake2b(seed.to_bytes(8, "little", signed=True), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class OpenAIServing(PromptRuns):
    reads_special_tokens = False  # the replies' parsers read special tokens (serving_chat.py)

    def __init__(self, engine: AsyncLLM, model_names: str | list[str] | ServedModels):
        """`model_names`: the names requests may give the model (vLLM's --served-model-name),
        or the server's ServedModels (its LoRA adapters' names too); responses carry the
        first."""
        self.engine = engine
        is_served = isinstance(model_names, ServedModels)
        self.models = model_names if is_served else ServedModels(model_names)
        self.model_names = self.models.names
        self.model_name = self.model_names[0]
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        chars_per_token = max_chars_per_token(self.tokenizer)
        # A text longer than this has more than max_model_len tokens, whatever they are.
        self.max_prompt_chars = None
        if chars_per_token is not None:
            self.max_prompt_chars = self.max_model_len * chars_per_token
        self.max_logprobs = engine.engine.engine_config.load_config.max_logprobs
        # The model's generation_config.json defaults, for the fields a request leaves out.
        self.defaults = engine.engine.generation_config.sampling_defaults

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names, None for the base model (or a 404)."""
        return self.models.resolve(model)

    def check_request(self, request) -> None:
        """Combinations of fields that vLLM refuses, or that would be silently ignored."""
        try:
            check_priority(
                request.priority, self.engine.engine.engine_config.scheduler_config.policy
            )
        except ValueError as e:
            raise OpenAIError(str(e), param="priority") from None
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(
                "stream_options can only be given with stream=true", param="stream_options"
            )
        if request.prompt_logprobs is not None and request.stream:
            raise OpenAIError(
                "prompt_logprobs are not available with stream=true", param="prompt_logprobs"
            )
        if request.length_penalty != 1.0 and not request.use_beam_search:
            raise OpenAIError(
                "length_penalty applies only with use_beam_search=true", param="length_penalty"
            )
        if request.cache_salt == "":
            raise OpenAIError(
                "cache_salt must be a non-empty string (or left out)", param="cache_salt"
            )
        if request.use_beam_search and request.logprobs not in (None, False):
            raise OpenAIError(
                "logprobs are not supported with use_beam_search=true", param="logprobs"
            )

    def beam_search_params(self, request, max_tokens: int) -> BeamSearchParams | None:
        """vLLM's beam search of `n` beams, when the request asks for it."""
        if not request.use_beam_search:
            return None
        temperature = request.temperature
        if temperature is None:
            temperature = self.defaults.get("temperature", 0.0)
        try:
            check_beam_search(request.n, self.engine.engine.engine_config.load_config)
            return BeamSearchParams(
                beam_width=request.n,
                max_tokens=max_tokens,
                ignore_eos=request.ignore_eos,
                temperature=temperature,
                length_penalty=request.length_penalty,
                include_stop_str_in_output=request.include_stop_str_in_output,
            )
        except ValueError as e:
            raise OpenAIError(f"use_beam_search: {e}", param="n") from None

    def sampling_params(
        self,
        request,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams for a request; out-of-range values become a 400 that
        names the parameter. `constraint`: the output constraint (structured.py, tools)."""
        if constraint is not None and request.use_beam_search:
            raise OpenAIError(
                "use_beam_search cannot be combined with structured outputs or forced tool calls",
                param="use_beam_search",
            )
        values = {
            "n": request.n,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "min_p": request.min_p,
            "seed": engine_seed(request.seed),
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "max_tokens": max_tokens,
            "min_tokens": request.min_tokens,
            "ignore_eos": request.ignore_eos,
            "skip_special_tokens": request.skip_special_tokens and not self.reads_special_tokens,
            "include_stop_str_in_output": request.include_stop_str_in_output,
            "spaces_between_special_tokens": request.spaces_between_special_tokens,
            "allowed_token_ids": request.allowed_token_ids,
            "bad_words": request.bad_words,
            "presence_penalty": request.presence_penalty,
            "frequency_penalty": request.frequency_penalty,
            "repetition_penalty": request.repetition_penalty,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "structured_outputs": constraint,
            "truncate_prompt_tokens": request.truncate_prompt_tokens,
        }
        if request.logit_bias:
            try:
                values["logit_bias"] = {int(k): float(v) for k, v in request.logit_bias.items()}
            except ValueError:
                raise OpenAIError("logit_bias keys must be token ids", param="logit_bias") from None
        if logprobs is not None and not 0 <= logprobs <= self.max_logprobs:
            raise OpenAIError(
                f"logprobs must be in [0, {self.max_logprobs}], got {logprobs}", param="logprobs"
            )
        kwargs = {name: value for name, value in values.items() if value is not None}
        kwargs = {**self.defaults, **kwargs}  # max_tokens is always the request's (check_length)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            fields = {*type(request).model_fields, *values}
            raise OpenAIError(str(e), param=param_of(str(e), fields)) from None

    def truncated(self, prompt_token_ids: list[int], request) -> list[int]:
        """The prompt's last `request.truncate_prompt_tokens` tokens (vLLM's field), cut here so
        that the length checks see what the engine will run."""
        try:
            return truncate_prompt(
                prompt_token_ids, request.truncate_prompt_tokens, self.max_model_len
            )
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens") from None

    def check_prompt_chars(self, num_chars: int, param: str, request) -> None:
        """Refuse a prompt text too long for max_model_len tokens before tokenizing it (a huge
        text would cost the tokenizer time and memory only to be refused), unless the request
        truncates its prompt."""
        if request.truncate_prompt_tokens is not None:
            return
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens; your "
                f"prompt has {num_chars} characters, more than {self.max_model_len} tokens can "
                f"hold ({self.max_prompt_chars} characters at most).",
                param=param,
                code="context_length_exceeded",
            )

    def check_length(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None,
        prompt_param: str,
        max_tokens_param: str = "max_tokens",
    ) -> int:
        """The request's max_tokens, checked against max_model_len (None: all the room left),
        and at most the model's max_new_tokens when its generation_config.json sets one (as
        vLLM does). A refusal names the prompt's field (`prompt_param`) when the prompt leaves
        no room, else the field the request set max_tokens with (`max_tokens_param`)."""
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(
                f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param
            )
        room = self.max_model_len - num_prompt_tokens
        cap = self.defaults.get("max_tokens", room)
        if room < 1:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens; your "
                f"prompt has {num_prompt_tokens} tokens, which leaves no room for output.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return min(room, cap)
        if max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} for the completion). Please reduce the prompt or "
                f"{max_tokens_param}.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        return min(max_tokens, cap)

    # ---- logprobs ----

    def token_text(self, token_id: int, logprob, as_id: bool = False) -> str:
        """A token's text in logprobs, or `token_id:N` (vLLM's return_tokens_as_token_ids)."""
        if as_id:
            return f"token_id:{token_id}"
        decoded = getattr(logprob, "decoded_token", None)
        return decoded if decoded is not None else self.tokenizer.decode([token_id])

    @staticmethod
    def logprob_value(logprob) -> float:
        value = getattr(logprob, "logprob", logprob)
        return max(float(value), -9999.0)  # JSON has no -inf

    def top_entries(self, position: dict, num: int) -> list[tuple[int, object]]:
        """The `num` most likely (token id, Logprob) of one position's dict."""
        ranked = sorted(position.items(), key=lambda kv: -self.logprob_value(kv[1]))
        return ranked[:num]

    @classmethod
    def prompt_logprobs_json(cls, prompt_logprobs: list | None) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt position None (the first) or
        {token_id: {logprob, rank, decoded_token}}."""
        if prompt_logprobs is None:
            return None
        return [
            None
            if position is None
            else {
                token_id: {
                    "logprob": cls.logprob_value(lp),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for token_id, lp in position.items()
            }
            for position in prompt_logprobs
        ]


def now() -> int:
    return int(time.time())


def sse(obj: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
