"""Rotary-embedding settings of a checkpoint: base, frequency scaling, a local base, and the
fraction of each head that rotates.

Read from both config layouts: transformers 4 (`rope_theta`, `rope_scaling`,
`rope_local_base_freq` at the top level) and transformers 5 (`rope_parameters`, which Gemma 3
splits by layer type). layers/rotary.py turns them into frequencies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn", "dynamic")
_ALIASES = {"su": "longrope"}  # Phi-3's first long-context checkpoints
# The key of a normalized config (models/<family>.py's normalize_hf_config) that gives the
# fraction of each head's dims that rotates. Only a family whose HF model honours
# `partial_rotary_factor` sets it (from `hf_partial_rotary_factor`): HF's Llama, Qwen, Mistral,
# Mixtral and Gemma models ignore that key and rotate whole heads, and so do they here.
ROTARY_FRACTION_KEY = "rotary_fraction"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A frequency scaling of HF's `rope_type`s:
    - "llama3": Llama 3's remap (factor, low/high_freq_factor, original_max_position_embeddings);
    - "linear": positions divided by `factor`;
    - "longrope" (Phi-3): per-frequency divisors, `short_factor` or `long_factor` (as
      `use_long_factor` says), and cos/sin scaled by `attention_factor`;
    - "yarn": HF's `_compute_yarn_parameters`: each frequency blends its original value
      (extrapolation) and its value divided by `factor` (interpolation) by a linear ramp over
      the frequency index between the dims that turn `beta_fast` and `beta_slow` times within
      `original_max_position_embeddings` (the ends floored/ceiled where `truncate`), and cos/sin
      scaled by `attention_factor`. Static, for every position, as both HF and vLLM apply it;
    - "dynamic" (dynamic NTK): HF raises the base only once a sequence passes
      max_position_embeddings, recomputing the frequencies of every position, cached keys
      included, by the sequence's current length, which keys already in a paged KV cache cannot
      follow. Within max_position_embeddings its frequencies are exactly the unscaled ones, and
      the engine's max_model_len never passes max_position_embeddings, so every sequence here
      rotates as HF rotates it. vLLM instead applies, at every position, the frequencies HF
      reaches only at max_position_embeddings * factor tokens (and allows that length), so its
      outputs differ from HF's at every shorter length. For a context past
      max_position_embeddings, use "yarn" (which HF and vLLM apply alike).

    `attention_factor`: the scale of cos and sin (longrope and yarn; 1 otherwise).

    `use_long_factor`: one factor set for every position of every sequence, as vLLM chooses it:
    the long one when the engine's max_model_len passes `original_max_position_embeddings`
    (`for_max_model_len`; max_position_embeddings stands in until an engine sets it). A cached
    key is then rotated as every later query expects, and a prefix-cache hit stays exact. HF
    transformers instead picks by the sequence's length at each call and recomputes its cache
    when a sequence crosses the boundary: the two agree wherever max_model_len is within
    `original_max_position_embeddings` (short) or the prompt is past it (long), and differ for
    a shorter sequence in a longer engine (HF short, here and in vLLM long).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    use_long_factor: bool = False
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES[1:]:
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; "
                f"supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        needs_original = ("llama3", "longrope", "yarn")
        if self.rope_type in needs_original and self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )
        if self.rope_type == "longrope" and len(self.short_factor) != len(self.long_factor):
            raise ValueError("rope_scaling.short_factor and long_factor must have one length")
        if self.rope_type == "yarn" and not (self.beta_fast > 0 and self.beta_slow > 0):
            raise ValueError(
                "rope_scaling.beta_fast and beta_slow must be > 0, got "
                f"{self.beta_fast} and {self.beta_slow}"
            )
        if self.attention_factor <= 0:
            raise ValueError(
                f"rope_scaling.attention_factor must be > 0, got {self.attention_factor}"
            )

    def for_max_model_len(self, max_model_len: int) -> RopeScaling:
        """This scaling in an engine whose sequences reach at most `max_model_len` tokens."""
        if self.rope_type != "longrope":
            return self
        use_long = max_model_len > self.original_max_position_embeddings
        return dataclasses.replace(self, use_long_factor=use_long)

    def context_length(self, max_position_embeddings: int) -> int:
        """The longest sequence a model of this scaling runs: YaRN extends the original context
        `factor` times (vLLM's default max_model_len for it, e.g. Qwen2.5's 32768 * 4), never
        below the config's own max_position_embeddings (vLLM takes original * factor alone);
        the other types keep max_position_embeddings."""
        if self.rope_type != "yarn":
            return max_position_embeddings
        extended = int(self.original_max_position_embeddings * self.factor)
        return max(max_position_embeddings, extended)


class Rope(NamedTuple):
    theta: float
    scaling: RopeScaling | None
    local_theta: float | None  # the sliding-window layers' base, where it differs (Gemma 3)
    rotary_fraction: float  # of each head's dims, the first this fraction rotate (1: all)


def _yarn_attention_factor(rope: dict[str, Any], factor: float) -> float:
    """HF's: the rope dict's attention_factor, else DeepSeek's mscale ratio where both mscale and
    mscale_all_dim are set, else 0.1 * ln(factor) + 1 (1 for factor <= 1)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def _yarn(rope: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """HF's reading (transformers 5 `standardize_rope_params` + `_compute_yarn_parameters`): the
    rope dict's original_max_position_embeddings, else max_position_embeddings; a null factor is
    their ratio; beta_fast / beta_slow default (also where 0 or null) to 32 / 1."""
    if "factor" not in rope:
        raise ValueError("rope_scaling.factor is required for rope_type 'yarn'")
    max_len = cfg.get("max_position_embeddings", 2048)
    original = int(rope.get("original_max_position_embeddings") or max_len)
    factor = rope["factor"]
    factor = max_len / original if factor is None else float(factor)
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=_yarn_attention_factor(rope, factor),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)),
    )


def _longrope(rope: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    original = int(
        rope.get("original_max_position_embeddings")
        or cfg.get("original_max_position_embeddings")
        or 0
    )
    # As HF: the context growth sets the factor (unless given), and the cos/sin scale grows
    # with its log.
    max_len = cfg.get("max_position_embeddings", original)
    factor = rope.get("factor") or (max_len / original if original else 1.0)
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeScaling(
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in rope["short_factor"]),
        long_factor=tuple(float(f) for f in rope["long_factor"]),
        attention_factor=float(attention_factor),
    ).for_max_model_len(max_len)


def _scaling(rope: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return None
    need = lambda key: _required(rope, key, rope_type)
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(need("factor")),
            low_freq_factor=float(need("low_freq_factor")),
            high_freq_factor=float(need("high_freq_factor")),
            original_max_position_embeddings=int(need("original_max_position_embeddings")),
        )
    if rope_type in ("linear", "dynamic"):
        return RopeScaling(rope_type=rope_type, factor=float(need("factor")))
    if rope_type == "yarn":
        return _yarn(rope, cfg)
    return _longrope(rope, cfg)


def _required(rope: dict[str, Any], key: str, rope_type: str) -> Any:
    """rope[key], or a ValueError naming the field a `rope_type` scaling needs."""
    if rope.get(key) is None:
        raise ValueError(f"rope_scaling.{key} is required for rope_type {rope_type!r}, got {rope}")
    return rope[key]


def _rope_dicts(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the global rope dict, the sliding-window layers' or None). A `rope_scaling` beside
    `rope_parameters` (an hf_overrides of a transformers 5 config, as vLLM's users write it)
    replaces its scaling, as HF's config reads it, over the base `rope_parameters` gives (HF
    would fall back to its default base there; the checkpoint's base is the one it was trained
    with)."""
    params = dict(cfg.get("rope_parameters") or {})
    local = None
    if "full_attention" in params:  # transformers 5, Gemma 3: one set per layer type
        local = params.get("sliding_attention")
        params = dict(params["full_attention"] or {})
    scaling = cfg.get("rope_scaling")
    if scaling:
        base = {k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params}
        params = {**base, **scaling}
    return params, local


def hf_partial_rotary_factor(cfg: dict[str, Any], default: float = 1.0) -> float:
    """HF's `partial_rotary_factor` of a config.json dict: the rope dict's (transformers 5 moves
    it there), else the top-level key, else the config class's `default` (Phi's 0.5, StableLM's
    0.25). For a family's normalize_hf_config to put under ROTARY_FRACTION_KEY where its HF
    model honours it."""
    factor = _rope_dicts(cfg)[0].get("partial_rotary_factor")
    if factor is None:
        factor = cfg.get("partial_rotary_factor")
    return default if factor is None else float(factor)


def parse_rope(cfg: dict[str, Any]) -> Rope:
    """The rope settings of a normalized config (see ROTARY_FRACTION_KEY for the fraction)."""
    params, local = _rope_dicts(cfg)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    local_theta = (local or {}).get("rope_theta", cfg.get("rope_local_base_freq"))
    if local and _scaling(local, cfg) is not None:
        raise ValueError("a rope scaling on the sliding-window layers is not supported")
    if theta <= 0:
        raise ValueError(f"rope_theta must be > 0, got {theta}")
    return Rope(
        theta,
        _scaling(params, cfg),
        None if local_theta is None else float(local_theta),
        float(cfg.get(ROTARY_FRACTION_KEY, 1.0)),
    )
