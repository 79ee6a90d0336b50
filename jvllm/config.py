"""Model configuration: a frozen, hashable description of a decoder-only transformer.

Hashable so that it can be a static argument of `jax.jit` (see docs/design.md, model contract).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# A config object built in code (not read from a checkpoint) may have no `architectures`.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_DTYPES = ("float32", "bfloat16")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (HF `rope_type="llama3"`)."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; "
                f"supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family model. Letters in comments follow docs/design.md."""

    architecture: str
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on the q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm over H on q and k before RoPE
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; allowed: {SUPPORTED_DTYPES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")

    @property
    def num_queries_per_kv(self) -> int:
        """G: query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The EOS ids as a tuple, whatever form the checkpoint gave."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return self.eos_token_id

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any] | Any, dtype: str) -> ModelConfig:
        """Build from an HF `config.json` dict or a `transformers.PretrainedConfig`.

        Reads both the transformers 4 layout (`rope_theta`, `rope_scaling` at the top level) and
        the transformers 5 one (`rope_parameters` holding theta and scaling).
        """
        cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        architectures = cfg.get("architectures") or []
        architecture = (
            architectures[0]
            if architectures
            else _ARCHITECTURE_BY_MODEL_TYPE.get(cfg.get("model_type"))
        )
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported (no model we load has MLP biases)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported; allowed: 'silu'")

        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        rope_scaling = None
        if rope_type == "llama3":
            rope_scaling = RopeScaling(
                rope_type="llama3",
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )

        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and its config has no field for it.
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias")),
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            dtype=dtype,
        )
