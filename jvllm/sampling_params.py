"""Per-request sampling and stopping parameters, with vLLM's field names and defaults."""

import enum
import json
import math
from dataclasses import dataclass

# Below this temperature sampling is greedy (argmax): dividing logits by ~0 only overflows.
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (argmax)
# OpenAI's ranges for the additive penalties, as vLLM enforces them.
_MAX_ABS_PENALTY = 2.0
_MAX_ABS_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request holds while it runs."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but True as a token count is a caller's bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else value


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names): a JSON schema (`json`, a dict or
    its JSON text), a `regex`, one of the strings in `choice`, a Lark (or GBNF) `grammar`, or
    `json_object=True` for any JSON object. JSON may hold up to 32 whitespace characters
    between its tokens; `disable_any_whitespace` makes it compact."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(CONSTRAINT_KINDS)}; got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a dict or a str, got {self.json!r}")
        if isinstance(self.json, dict):
            try:  # a schema is JSON: no sets, no NaN or infinity
                json.dumps(self.json, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json must be JSON data: {e}") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty str")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of str, got {self.choice!r}"
            )
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a bool")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(  # noqa: TRY004 - a bad field value, as the others
                "structured_outputs.disable_any_whitespace must be a bool"
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of CONSTRAINT_KINDS."""
        return next(n for n in CONSTRAINT_KINDS if getattr(self, n) not in (None, False))


# The constraints a request may set, one at a time.
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    """How to sample a request's tokens and when to stop it.

    `top_k` 0 or -1 and `top_p` 1 turn those filters off; `temperature` 0 is greedy.
    `stop`, `stop_token_ids` and `bad_words` are normalised to lists. Logprobs are those of the
    model's raw logits (vLLM's default `raw_logprobs`), before penalties and temperature.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until max_model_len (vLLM's)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len of them).
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else _as_list(self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        self.bad_words = _as_list(self.bad_words)
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            # JSON object keys arrive as strings (the OpenAI server): accept "123".
            self.logit_bias = {
                int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v
                for k, v in self.logit_bias.items()
            }
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or abs(value) > _MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be None or an int in [0, 2**32), got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an int >= 1, got {k!r}")
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")  # noqa: TRY004
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty str or a list of them, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are found in the text)")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}"
            )
        if not isinstance(self.bad_words, list) or not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise ValueError(f"bad_words must be a list of non-blank strs, got {self.bad_words!r}")
        self._validate_token_maps()
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                f"got {type(self.structured_outputs).__name__}"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(
                    f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), "
                    f"got {self.output_kind!r}"
                ) from None

    def _validate_token_maps(self) -> None:
        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, dict)
            or not all(
                _is_int(k) and k >= 0 and _is_number(v) and abs(v) <= _MAX_ABS_LOGIT_BIAS
                for k, v in self.logit_bias.items()
            )
        ):
            raise ValueError(
                "logit_bias must map token ids >= 0 to biases in [-100, 100], "
                f"got {self.logit_bias!r}"
            )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of ints >= 0, got {ids!r}"
                )

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids inside the vocabulary, logprobs within the limit."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(
                    f"{name} must be in [0, max_logprobs={max_logprobs}], got {value} "
                    "(raise the engine's max_logprobs to ask for more)"
                )
        for name, ids in (
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab_size}), got {bad[:5]}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def stop_buffer_length(self) -> int:
        """Characters held back from running outputs: the start of a stop string may be there."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (`LLM.beam_search`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an int >= 1, got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_number(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
