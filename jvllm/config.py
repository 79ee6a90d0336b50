"""Model configuration: a frozen, hashable description of a decoder-only transformer.

Hashable so that it can be a static argument of `jax.jit` (see docs/design.md, model contract).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jvllm.rope_config import RopeScaling

SUPPORTED_DTYPES = ("float32", "bfloat16")
DTYPE_CHOICES = ("auto", *SUPPORTED_DTYPES)  # what a user passes: "auto" follows the checkpoint
# vLLM's: what logprobs and prompt_logprobs hold. Raw: the model's logits; processed: what the
# sampler drew from (after logit processors, penalties, temperature and top-k/top-p/min-p).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# HF's hidden_act names of the activations layers/activation.py computes, one function each.
SUPPORTED_ACTIVATIONS = (
    "silu",
    "gelu_pytorch_tanh",
    "gelu_new",
    "gelu_fast",
    "gelu",
    "relu",
    "swish",
    "gelu_python",
    "gelu_python_tanh",
    "gelu_accurate",
    "gelu_10",
    "quick_gelu",
    "relu2",
    "relu6",
    "mish",
    "sigmoid",
    "tanh",
    "linear",
)
LAYER_TYPES = ("full_attention", "sliding_attention")
# vLLM's all2all_backend: how the MoE layers of data-parallel ranks bring the ranks' tokens to
# their experts' devices. "auto" picks one of the other two by size
# (distributed/data_parallel_moe.py's choose_all2all_backend); a ModelConfig holds the one picked.
ALL2ALL_BACKENDS = ("auto", "allgather_reducescatter", "ragged_all_to_all")
# The window a global layer passes to attention in a model that mixes both kinds: never cuts.
NO_WINDOW = 2**30


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only model. Letters in comments follow docs/design.md.

    The fields are the ones the engine or more than one family reads; what only one family
    reads travels in `options` (see `option`).
    """

    # A registry name (models/registry.py), checked where config.json is read
    # (model_loader/hf_config.py) and where the model is built (registry.model_class).
    architecture: str
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H: a KV-cache row's dims
    rms_norm_eps: float  # the epsilon of the model's norms (LayerNorm's too)
    rope_theta: float
    rope_scaling: RopeScaling | None
    # The longest sequence: config.json's, or YaRN's extended context where longer
    # (rope_config.RopeScaling.context_length).
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on the q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm over H on q and k before RoPE
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    dtype: str = "float32"
    hidden_act: str = "silu"
    sliding_window: int | None = None  # W: a windowed layer's query sees its last W positions
    layer_types: tuple[str, ...] | None = None  # per layer, one of LAYER_TYPES; None: all global
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: on the LM head's logits
    query_pre_attn_scalar: float | None = None  # Gemma: scores scale by its -1/2 power, not H's
    local_rope_theta: float | None = None  # Gemma 3: the windowed layers' rope base
    # HF's partial rotary embedding: the first R = int(H * partial_rotary_factor) dims of each
    # head rotate (rotate-half within those R), the other H - R pass through unchanged
    # (layers/rotary.py; `rotary_dim`). Set only for a family whose HF model honours the key:
    # its normalize_hf_config puts it under rope_config.ROTARY_FRACTION_KEY (Phi-3; HF's Llama,
    # Qwen, Mistral, Mixtral and Gemma ignore partial_rotary_factor, and so does jvllm there).
    partial_rotary_factor: float = 1.0
    # The rotated dims pair as 2i, 2i + 1 (GPT-J's rotate_every_two, Cohere, GLM), not as HF's
    # rotate-half i, i + R/2 (layers/rotary.py); set by a family's normalize_hf_config.
    is_rope_interleaved: bool = False
    num_experts: int = 0  # E; 0: a dense MLP
    num_experts_per_tok: int = 0  # k
    moe_intermediate_size: int = 0  # an expert's F
    norm_topk_prob: bool = True  # renormalise the k routing weights to sum 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: the shared expert's F; 0: none
    # The KV cache's planes [L, kv_planes, K, P, B, H]: 2, a key and a value per token and KV
    # head; or 1, one row that is both (MLA's latent: the values are its first dims;
    # layers/mla.py), which the attention backends read for the values too.
    kv_planes: int = 2
    options: tuple[tuple[str, Any], ...] = ()  # family-specific settings, (name, value) sorted
    # > 1: this config is one device's shard of a tensor-parallel model (its heads, F and V are
    # that device's share; distributed/tensor_parallel.py), and the row-parallel layers sum
    # their partial outputs over the mesh's "model" axis.
    num_shards: int = 1
    # The routed experts are placed whole over the "model" axis's devices (enable_expert_parallel;
    # distributed/expert_parallel.py) rather than each cut on its F: a shard's config then holds
    # E / num_shards of them (`num_local_experts`), and its MoE layers run only their
    # assignments.
    is_expert_parallel: bool = False
    # > 1 (a shard's config, under expert parallelism): the MoE layers run across this many
    # data-parallel ranks, the mesh's "data" axis (distributed/data_parallel_moe.py): each holds
    # E / (num_data_ranks * num_shards) experts and runs them on the ranks' tokens, gathered or
    # sent to it (all2all_backend); attention and the dense layers stay a rank's own.
    num_data_ranks: int = 1
    # How those MoE layers exchange the ranks' tokens (layers/parallel.py's experts_over_ranks):
    # "allgather_reducescatter" or "ragged_all_to_all", ALL2ALL_BACKENDS past "auto", which
    # the engine resolves before it builds the model.
    all2all_backend: str = "allgather_reducescatter"
    # LoRA adapter slots of the projections that take adapters (layers/lora.py), each of up to
    # max_lora_rank; 0: none, and the params hold no adapter weights.
    max_loras: int = 0
    max_lora_rank: int = 0
    # False: the checkpoint is a base model saved without its LM head (an embedding model's;
    # model_loader/base_model.py). It pools and never computes logits; tie_word_embeddings is
    # then set so that no family builds or reads a head.
    has_lm_head: bool = True

    def __post_init__(self) -> None:
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
        if self.kv_planes not in (1, 2):
            raise ValueError(f"kv_planes must be 1 or 2, got {self.kv_planes}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} rotates "
                f"{self.rotary_dim} of head_dim={self.head_dim} dims; it must rotate an even "
                "number of them, at least 2"
            )
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not supported; allowed: {SUPPORTED_ACTIVATIONS}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int, got {self.sliding_window}")
        if self.layer_types is not None and (
            len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {*LAYER_TYPES}
        ):
            raise ValueError(
                f"layer_types must give one of {LAYER_TYPES} for each of the {self.num_layers} "
                f"layers, got {self.layer_types}"
            )
        if self.all2all_backend not in ALL2ALL_BACKENDS[1:]:
            raise ValueError(
                f"all2all_backend={self.all2all_backend!r} is not a form a model runs; allowed: "
                f"{ALL2ALL_BACKENDS[1:]} ('auto' is resolved before the model is built)"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                f"{self.num_experts_per_tok}"
            )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for a global layer."""
        if self.sliding_window is None:
            return (None,) * self.num_layers
        types = self.layer_types or ("sliding_attention",) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)

    @property
    def num_expert_shards(self) -> int:
        """The devices the routed experts are spread over, each whole on one: num_shards (times
        num_data_ranks) under expert parallelism, else 1 (a device holds every expert, or a
        slice of each)."""
        return self.num_shards * self.num_data_ranks if self.is_expert_parallel else 1

    @property
    def num_local_experts(self) -> int:
        """The routed experts this config's MoE layers hold: E, or a device's share of them."""
        return self.num_experts // self.num_expert_shards

    @property
    def rotary_dim(self) -> int:
        """R: the dims of each head that rotary embeddings rotate, its first R (HF's
        `int(head_dim * partial_rotary_factor)`; H unless the family rotates part of a head)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def sm_scale(self) -> float:
        """The factor on q . k before the softmax: H^-1/2 (Gemma: query_pre_attn_scalar^-1/2),
        or Granite's attention_multiplier, which replaces it."""
        multiplier = self.option("attention_multiplier")
        if multiplier is not None:
            return multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def check_can_generate(self) -> None:
        """A ValueError for a generating engine whose model has no LM head."""
        if not self.has_lm_head:
            raise ValueError(
                f"this checkpoint ({self.architecture}) is a base model without an LM head and "
                "with untied embeddings: it cannot generate text. Serve it as an embedding model "
                "with runner='pooling' (--runner pooling)"
            )

    def checked_max_model_len(self, max_model_len: int | None) -> int:
        """The engine's max_model_len: the one asked for (None: max_position_embeddings), or a
        ValueError past the model's context that says how to extend it."""
        if max_model_len is None:
            return self.max_position_embeddings
        if max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's "
                f"max_position_embeddings ({self.max_position_embeddings}); lower max_model_len"
                + _rope_scaling_hint(self)
            )
        return max_model_len

    def for_max_model_len(self, max_model_len: int) -> ModelConfig:
        """This config in an engine of `max_model_len`: LongRoPE picks its factor set by it
        (rope_config.RopeScaling.use_long_factor)."""
        if self.rope_scaling is None:
            return self
        scaling = self.rope_scaling.for_max_model_len(max_model_len)
        return dataclasses.replace(self, rope_scaling=scaling)

    def option(self, name: str, default: Any = None) -> Any:
        """A family-specific setting (models/<family>.py's normalize_hf_config sets them)."""
        return dict(self.options).get(name, default)

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


def _rope_scaling_hint(config: ModelConfig) -> str:
    """How a model reaches a longer context: YaRN, where it has no rope scaling of its own to
    lose (or only dynamic NTK, which a paged cache cannot follow past its context)."""
    if config.rope_scaling is not None and config.rope_scaling.rope_type != "dynamic":
        return ""
    return (
        ", or extend the context with a rope scaling the model's card recommends, e.g. "
        'hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
        f'"original_max_position_embeddings": {config.max_position_embeddings}}}}}'
    )
