"""Rotary-embedding settings of a checkpoint: base, frequency scaling, a local base.

Read from both config layouts: transformers 4 (`rope_theta`, `rope_scaling`,
`rope_local_base_freq` at the top level) and transformers 5 (`rope_parameters`, which Gemma 3
splits by layer type). layers/rotary.py turns them into frequencies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope")
_ALIASES = {"su": "longrope"}  # Phi-3's first long-context checkpoints


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A frequency scaling of HF's `rope_type`s:
    - "llama3": Llama 3's remap (factor, low/high_freq_factor, original_max_position_embeddings);
    - "linear": positions divided by `factor`;
    - "longrope" (Phi-3): per-frequency divisors, `short_factor` or `long_factor` (as
      `use_long_factor` says), and cos/sin scaled by `attention_factor`.

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
        if self.rope_type in ("llama3", "longrope") and self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )
        if self.rope_type == "longrope" and len(self.short_factor) != len(self.long_factor):
            raise ValueError("rope_scaling.short_factor and long_factor must have one length")

    def for_max_model_len(self, max_model_len: int) -> RopeScaling:
        """This scaling in an engine whose sequences reach at most `max_model_len` tokens."""
        if self.rope_type != "longrope":
            return self
        use_long = max_model_len > self.original_max_position_embeddings
        return dataclasses.replace(self, use_long_factor=use_long)


class Rope(NamedTuple):
    theta: float
    scaling: RopeScaling | None
    local_theta: float | None  # the sliding-window layers' base, where it differs (Gemma 3)


def _scaling(rope: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(rope["factor"]))
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


def parse_rope(cfg: dict[str, Any]) -> Rope:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local = None
    if "full_attention" in params:  # transformers 5, Gemma 3: one set per layer type
        local = params.get("sliding_attention")
        params = dict(params["full_attention"])
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    local_theta = (local or {}).get("rope_theta", cfg.get("rope_local_base_freq"))
    if local and _scaling(local, cfg) is not None:
        raise ValueError("a rope scaling on the sliding-window layers is not supported")
    if theta <= 0:
        raise ValueError(f"rope_theta must be > 0, got {theta}")
    return Rope(theta, _scaling(params, cfg), None if local_theta is None else float(local_theta))
