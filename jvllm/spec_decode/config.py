"""`speculative_config`, vLLM's option, validated where the engine's arguments are."""

import dataclasses
from collections.abc import Mapping

# The drafting methods served; vLLM's others ("medusa", ...) are not yet.
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# vLLM's older names of a method, accepted as it does (its "deepseek_mtp" and "glm4_moe_mtp"
# are now "mtp").
METHOD_ALIASES = {"deepseek_mtp": "mtp", "glm4_moe_mtp": "mtp"}
# The methods whose drafts a model on the device proposes after each step (`model` its path).
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# Of those, the heads that draft from the target's hidden states (worker/eagle.py).
HEAD_METHODS = ("eagle", "eagle3", "mtp")
# "hf_overrides" is jvllm's, the engine option's for the draft's config (e.g. a draft that is
# the target's first layers: {"num_hidden_layers": 4}).
_FIELDS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "hf_overrides",
)
# vLLM's lookup window when neither bound is given.
_DEFAULT_PROMPT_LOOKUP = 5


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """ "ngram": each decoding request's last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) are looked up earlier in its prompt and output, and the (up to)
    `num_speculative_tokens` tokens that followed them are its drafts.
    "draft_model": a smaller model of the same vocabulary (`model`, loaded as the engine's
    `model` is, with `hf_overrides` on its config) proposes them greedily
    (worker/draft_model.py).
    "eagle" / "eagle3": an EAGLE-1 / EAGLE-3 head (`model`, its HF checkpoint) proposes them
    from the target's hidden states (worker/eagle.py).
    "mtp": the multi-token-prediction layer of the target's checkpoint (DeepSeek-V3's,
    GLM-4.5's; `model` None: the target's own path) proposes them from the target's final
    hidden states (models/deepseek_mtp.py, models/glm4_moe_mtp.py)."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    model: str | None = None
    hf_overrides: Mapping | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an int >= 1, got {value!r}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                "speculative_config prompt_lookup_max must be >= prompt_lookup_min, got "
                f"{self.prompt_lookup_max} < {self.prompt_lookup_min}"
            )
        is_own_checkpoint = self.method == "mtp" and self.model is None  # the target's path
        if self.method in MODEL_METHODS and not isinstance(self.model, str | None):
            raise ValueError(f"speculative_config model must be a path (a str), got {self.model!r}")
        if self.method in MODEL_METHODS and self.model is None and not is_own_checkpoint:
            raise ValueError(
                f"speculative_config method {self.method!r} needs model, the draft's path (a "
                f"directory or a .gguf file), got {self.model!r}"
            )
        if self.method not in MODEL_METHODS and (self.model, self.hf_overrides) != (None, None):
            raise ValueError(
                f"speculative_config model and hf_overrides are for methods {MODEL_METHODS}, "
                f"not {self.method!r}"
            )

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past its scheduled tokens (vLLM's): a draft model (or
        head) writes its KV at the positions of the drafts it proposes after the step."""
        return self.num_speculative_tokens if self.method in MODEL_METHODS else 0


def as_speculative_config(value) -> SpeculativeConfig | None:
    """vLLM's dict (or a SpeculativeConfig, or None: no speculation) -> a SpeculativeConfig.

    As in vLLM, a missing lookup bound takes the other's value, and both missing are 5."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(  # noqa: TRY004 - every bad engine option is a ValueError, as in vLLM
            f"speculative_config must be a dict (e.g. {{'method': 'ngram', "
            f"'num_speculative_tokens': 3}}) or None, got {value!r}"
        )
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise ValueError(
            f"speculative_config keys {unknown} are not supported; the keys allowed are {_FIELDS}"
        )
    if "method" not in value:
        raise ValueError(f"speculative_config needs a method, one of {SPECULATIVE_METHODS}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs num_speculative_tokens (an int >= 1)")
    lookup_max, lookup_min = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
    if lookup_max is None and lookup_min is None:
        lookup_max = lookup_min = _DEFAULT_PROMPT_LOOKUP
    return SpeculativeConfig(
        method=METHOD_ALIASES.get(value["method"], value["method"]),
        num_speculative_tokens=value["num_speculative_tokens"],
        prompt_lookup_max=lookup_min if lookup_max is None else lookup_max,
        prompt_lookup_min=lookup_max if lookup_min is None else lookup_min,
        model=value.get("model"),
        hf_overrides=value.get("hf_overrides"),
    )
