"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, SmolLM3) as flax.nnx
modules.

The contract is in docs/design.md: the model runs over flattened tokens and returns the post-norm
hidden states and the updated KV cache; `compute_logits` applies the LM head to the rows that
sample. Attention itself (cache write + paged attention) is the `attn` callable the caller
passes in, so this file knows nothing about pages. The runner reaches the model through
models/model.py, never this file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.activation import check_activation
from jvllm.layers.attention import Attention, AttentionFn
from jvllm.layers.embedding import Embed
from jvllm.layers.linear import Linear
from jvllm.layers.mlp import GatedMLP
from jvllm.layers.moe import SparseMoE
from jvllm.layers.norm import RMSNorm
from jvllm.layers.rotary_layers import run_rotary_layers
from jvllm.layers.scan import stacked_layers
from jvllm.models.weights import CheckpointWeights
from jvllm.rope_config import ROTARY_FRACTION_KEY, hf_partial_rotary_factor

# Qwen2Config's and Qwen3Config's window where use_sliding_window sets none, and its first layer.
_QWEN_DEFAULT_WINDOW = 4096
_QWEN_DEFAULT_WINDOW_START = 28
# The config classes whose num_key_value_heads defaults to a count of its own, not to the
# query heads' (LlamaConfig's, Phi3Config's and GraniteConfig's), and their architectures.
_KV_HEADS_DEFAULTS = {"mistral": 8, "qwen2": 32, "qwen3": 32}
_ARCHITECTURES = {
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Phi3Config's default context (max_position_embeddings, original_max_position_embeddings),
# where a config.json does not say.
_PHI3_DEFAULT_CONTEXT = 4096


class LlamaDecoderLayer(nnx.Module):
    """A pre-norm block on the float32 residual stream; its MLP is the experts' where the model
    has them (Mixtral, Qwen3-MoE)."""

    moe = SparseMoE  # the experts' block; a family with another router (GLM-4.5) sets its own

    @staticmethod
    def attention(config: ModelConfig) -> Attention:
        """The block's attention; a family with other q/k norms (MiniMax-M2) sets its own."""
        return Attention(config, output_bias=config.option("o_proj_bias", False))

    @staticmethod
    def dense_mlp(config: ModelConfig) -> nnx.Module:
        """The block's MLP where it has no experts; a family with an ungated one (Arcee) sets
        its own."""
        return GatedMLP(config, bias=config.option("mlp_bias", False))

    def __init__(self, config: ModelConfig, is_moe: bool | None = None):
        """is_moe: whether the MLP is the experts' (None: where the config has experts)."""
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = self.attention(config)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.num_experts if is_moe is None else is_moe:
            self.mlp = self.moe(config)
        else:
            self.mlp = self.dense_mlp(config)
        # Granite scales the attention's and the MLP's outputs before each residual add.
        self.residual_multiplier = config.option("residual_multiplier", 1.0)

    def __call__(self, x, layer, cos, sin, window, kv_cache, metadata, attn: AttentionFn):
        """x f32[T, D] -> (x f32[T, D], kv_cache); window: None or this layer's i32[] W."""
        x_normed = self.input_norm(x)
        out, kv_cache = self.attn(x_normed, layer, cos, sin, kv_cache, metadata, attn, window)
        x = x + out * self.residual_multiplier
        return x + self.mlp(self.post_attention_norm(x)) * self.residual_multiplier, kv_cache


class LlamaForCausalLM(nnx.Module):
    decoder_layer = LlamaDecoderLayer  # a family with other blocks (OLMo 2) sets its own

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg["hidden_act"] = check_activation(cfg.get("hidden_act", "silu"), "hidden_act")
        if (cfg.get("num_local_experts") or cfg.get("num_experts")) and cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported for experts; allowed: False")
        if cfg.get("mlp_bias"):  # Llama's: on gate, up and down
            cfg["options"] = {**cfg.get("options", {}), "mlp_bias": True}
        architecture = cfg["architectures"][0] if cfg.get("architectures") else None
        if architecture == "Qwen2ForCausalLM" or cfg.get("model_type") == "qwen2":
            cfg["attention_bias"] = True  # on q/k/v, always; its config has no field for it
        elif cfg.get("attention_bias"):  # Llama's and Qwen3's: on o_proj too
            cfg["options"] = {**cfg.get("options", {}), "o_proj_bias": True}
        if architecture == "Qwen3ForCausalLM" or cfg.get("model_type") == "qwen3":
            cfg["qk_norm"] = True
        for model_type, num_kv_heads in _KV_HEADS_DEFAULTS.items():
            if cfg.get("model_type") == model_type or architecture == _ARCHITECTURES[model_type]:
                cfg.setdefault("num_key_value_heads", num_kv_heads)
        if cfg.get("model_type") in ("llama", "granite"):
            cfg["sliding_window"] = None  # HF's Llama attends globally, whatever its config says
        if cfg.get("model_type") in ("qwen2", "qwen3", "qwen3_moe"):
            # Qwen's window applies only with use_sliding_window, from layer max_window_layers
            # (Qwen3-MoE's to every layer: HF's config has no max_window_layers); HF's configs
            # default to a window of 4096 from layer 28.
            is_windowed = bool(cfg.get("use_sliding_window"))
            if is_windowed:
                cfg.setdefault("sliding_window", _QWEN_DEFAULT_WINDOW)
            else:
                cfg["sliding_window"] = None
            if is_windowed and cfg.get("model_type") == "qwen3_moe":
                cfg.pop("layer_types", None)
            elif is_windowed and not cfg.get("layer_types"):
                start = cfg.get("max_window_layers", _QWEN_DEFAULT_WINDOW_START)
                cfg["layer_types"] = [
                    "sliding_attention" if i >= start else "full_attention"
                    for i in range(cfg["num_hidden_layers"])
                ]
        if architecture == "Phi3ForCausalLM" or cfg.get("model_type") == "phi3":
            cfg = _normalize_phi3(cfg)
        if architecture == "GraniteForCausalLM" or cfg.get("model_type") == "granite":
            cfg = _normalize_granite(cfg)
        if architecture == "SmolLM3ForCausalLM" or cfg.get("model_type") == "smollm3":
            cfg = _normalize_smollm3(cfg)
        return cfg

    def __init__(self, config: ModelConfig):
        dtype = jnp.dtype(config.dtype)
        self.config = config
        self.embed = Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, num_shards=config.num_shards
        )
        # Qwen-MoE's dense layers before its MoE ones: a stack of their own, run first.
        self.num_dense = num_dense = config.option("num_dense_layers", 0)
        if num_dense:
            make_dense = lambda: self.decoder_layer(config, is_moe=False)
            self.dense_layers = stacked_layers(make_dense, num_dense)
        num_layers = config.num_layers - num_dense
        self.layers = stacked_layers(lambda: self.decoder_layer(config), num_layers)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, ("vocab", "embed"), dtype=dtype)
        )

    def __call__(self, kv_cache, token_ids, positions, metadata, attn: AttentionFn, mm=None):
        """token_ids i32[T], positions i32[T] -> (post-norm hidden f32[T, D], kv_cache); `mm`:
        a multimodal family's step image embeddings, in place of its image tokens' (None: a
        step of text).

        Each layer's cache scatter updates the donated cache, carried through the layer scan,
        in place.
        """
        x = self.embed_tokens(token_ids)
        if mm is not None:
            x = mm.merge(x)
        return self.decode(kv_cache, x, positions, metadata, attn)

    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        """token_ids i32[T] -> the first layer's input f32[T, D]."""
        return self.embed(token_ids) * self.config.option("embedding_multiplier", 1.0)

    def decode(
        self, kv_cache, x, positions, metadata, attn: AttentionFn, cos_sin=None, after_layer=None
    ):
        """The layers and the final norm over the first layer's input x f32[T, D] (a
        multimodal family's, with its images' embeddings in place) -> (hidden, kv_cache).
        `cos_sin` and `after_layer`: run_rotary_layers' (Qwen-VL's M-RoPE tables, Qwen3-VL's
        DeepStack)."""
        config = self.config
        attn = query_scaled_attention(attn, positions, config)
        # SmolLM3's layers without rotary embeddings (None: every layer rotates).
        rope_layers = config.option("rope_layers")
        options = {"rope_layers": rope_layers, "cos_sin": cos_sin, "after_layer": after_layer}
        if self.num_dense:
            x, kv_cache = run_rotary_layers(
                self.dense_layers, x, kv_cache, positions, config, metadata, attn, **options
            )
            options["first_layer"] = self.num_dense
        x, kv_cache = run_rotary_layers(
            self.layers, x, kv_cache, positions, config, metadata, attn, **options
        )
        return self.final_norm(x), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden f32[S, D] (already final-normed) -> logits f32[S, V] (Granite's divided by
        its logits_scaling)."""
        if self.lm_head is None:
            logits = self.embed.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return logits / self.config.option("logits_scaling", 1.0)

    @classmethod
    def load_weights(
        cls,
        config: ModelConfig,
        weights: CheckpointWeights,
        prefix: str = "model.",
        lm_head: str = "lm_head.weight",
    ) -> None:
        """The HF checkpoint's tensors into this module's params: the decoder's under `prefix`
        (a multimodal checkpoint nests it), the LM head's named `lm_head`."""
        attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        if config.architecture == "Phi3ForCausalLM":  # saved fused, in our q|k|v order
            attn = ("self_attn.qkv_proj",)
        weights.set_layer_prefix(prefix + "layers.{}.")
        weights.tensor("embed.embedding", prefix + "embed_tokens.weight")
        num_dense = config.option("num_dense_layers", 0)
        if num_dense:  # their own stack (see __init__), with a dense MLP
            weights.set_layers(0, num_dense, stack="dense_layers")
            cls.load_layer_weights(config, weights, attn)
            LlamaForCausalLM.load_mlp_weights(config, weights)
            weights.set_layers(num_dense, config.num_layers - num_dense)
        cls.load_layer_weights(config, weights, attn)
        cls.load_mlp_weights(config, weights)
        weights.tensor("final_norm.weight", prefix + "norm.weight")
        if not config.tie_word_embeddings:
            weights.tensor("lm_head.weight", lm_head)

    # The checkpoint's names of a block's two norms (Apertus names them otherwise), and of its
    # per-head q/k norms (Hunyuan's are query_layernorm, key_layernorm).
    norm_names = ("input_layernorm", "post_attention_layernorm")
    qk_norm_names = ("self_attn.q_norm", "self_attn.k_norm")

    @classmethod
    def load_layer_weights(cls, config: ModelConfig, weights: CheckpointWeights, attn: tuple):
        """A stack's norms and attention (`attn`: the q|k|v tensors' names)."""
        input_norm, post_attention_norm = cls.norm_names
        weights.stacked("layers.input_norm.weight", (input_norm + ".weight",))
        weights.stacked("layers.attn.qkv.weight", tuple(n + ".weight" for n in attn))
        if config.attention_bias:
            weights.stacked("layers.attn.qkv.bias", tuple(n + ".bias" for n in attn))
        if config.qk_norm:
            q_norm, k_norm = cls.qk_norm_names
            weights.stacked("layers.attn.q_norm.weight", (q_norm + ".weight",))
            weights.stacked("layers.attn.k_norm.weight", (k_norm + ".weight",))
        weights.stacked("layers.attn.o.weight", ("self_attn.o_proj.weight",))
        if config.option("o_proj_bias", False):
            weights.stacked("layers.attn.o.bias", ("self_attn.o_proj.bias",))
        weights.stacked("layers.post_attention_norm.weight", (post_attention_norm + ".weight",))

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        gate_up = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
        if config.architecture == "Phi3ForCausalLM":  # saved fused, in our gate|up order
            gate_up = ("mlp.gate_up_proj.weight",)
        weights.stacked("layers.mlp.gate_up.weight", gate_up)
        weights.stacked("layers.mlp.down.weight", ("mlp.down_proj.weight",))
        if config.option("mlp_bias", False):
            bias = tuple(name.replace(".weight", ".bias") for name in gate_up)
            weights.stacked("layers.mlp.gate_up.bias", bias)
            weights.stacked("layers.mlp.down.bias", ("mlp.down_proj.bias",))


def query_scaled_attention(attn: AttentionFn, positions: jax.Array, config: ModelConfig):
    """`attn` with each query scaled by its position where the config has Llama 4's scaling
    (Ministral 3: the option llama4_scaling, (beta, L)): 1 + beta * ln(1 + floor(p / L)),
    after rope, as HF's get_llama_4_attn_scale; `attn` itself otherwise."""
    scaling = config.option("llama4_scaling")
    if scaling is None:
        return attn
    beta, length = scaling
    scale = 1.0 + beta * jnp.log1p(jnp.floor(positions.astype(jnp.float32) / length))  # [T]

    def scaled(layer, q, *args, **kwargs):  # q [T, N, H]
        return attn(layer, q * scale[:, None, None].astype(q.dtype), *args, **kwargs)

    return scaled


# What GraniteConfig and SmolLM3Config assume where a config.json says nothing.
_GRANITE_DEFAULTS = {"bos_token_id": 1, "eos_token_id": 2}
_SMOLLM3_DEFAULTS = {
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
_SMOLLM3_ROPE_THETA = 2_000_000.0
# Granite's scalings: the embeddings by the first, each block's outputs by the second, q . k by
# the third (in place of H^-1/2), and the logits divided by the last.
_GRANITE_SCALINGS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)


def _normalize_granite(cfg: dict) -> dict:
    """Granite's scalings as options, each 1.0 where the config leaves it out (GraniteConfig's
    default: so the scores of such a config are not scaled by H^-1/2 at all)."""
    cfg = {**_GRANITE_DEFAULTS, **cfg}
    scalings = {name: cfg.get(name, 1.0) for name in _GRANITE_SCALINGS}
    for name, value in scalings.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    cfg["options"] = {**cfg.get("options", {}), **{k: float(v) for k, v in scalings.items()}}
    return cfg


def _normalize_smollm3(cfg: dict) -> dict:
    """SmolLM3's config as SmolLM3Config reads it: `no_rope_layers` gives each layer 1 (rotary
    embeddings) or 0 (none), and where absent every `no_rope_layer_interval`-th layer has none;
    with use_sliding_window, the layers without rope are the windowed ones unless layer_types
    says otherwise."""
    cfg = {**_SMOLLM3_DEFAULTS, **cfg}
    if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
        cfg["rope_theta"] = _SMOLLM3_ROPE_THETA
    num_layers = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers or not set(flags) <= {0, 1}:
        raise ValueError(
            f"no_rope_layers must give 1 (rope) or 0 (no rope) for each of the {num_layers} "
            f"layers, got {flags}"
        )
    if not all(flags):
        cfg["options"] = {**cfg.get("options", {}), "rope_layers": tuple(map(bool, flags))}
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if not cfg.get("layer_types"):
        is_windowed = lambda flag: window is not None and not flag
        cfg["layer_types"] = [
            "sliding_attention" if is_windowed(f) else "full_attention" for f in flags
        ]
    elif window is None and "sliding_attention" in cfg["layer_types"]:
        # HF's masks would cut at sliding_window there while its flash attention would not.
        raise ValueError(
            "layer_types has sliding_attention layers but use_sliding_window is false or "
            "sliding_window is null; allowed: both set, or only full_attention layers"
        )
    cfg["sliding_window"] = window
    return cfg


def _normalize_phi3(cfg: dict) -> dict:
    """Phi-3's config.json as HF's Phi3Config reads it: the top-level
    original_max_position_embeddings wins over the rope dict's, "su" and "yarn" are old names of
    "longrope"; partial_rotary_factor (Phi-4-mini's 0.75; the rope dict's, else the top level's)
    rotates the first int(head_dim * factor) dims of each head, and LongRoPE's factor lists
    give one factor per pair of them; and a sliding window that no sequence can fill is dropped
    (Phi-3.5-mini's 262144 in a 131072 context), so that attention takes its unwindowed path."""
    cfg.setdefault("max_position_embeddings", _PHI3_DEFAULT_CONTEXT)
    # The dict rope_config reads the scaling from: rope_scaling where given, as HF reads it.
    rope_key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = dict(cfg.get(rope_key) or {})
    partial = hf_partial_rotary_factor(cfg)
    cfg[ROTARY_FRACTION_KEY] = partial
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su", "yarn"):
        rope["rope_type"] = "longrope"
        rope["original_max_position_embeddings"] = cfg.get(
            "original_max_position_embeddings", _PHI3_DEFAULT_CONTEXT
        )
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        num_pairs = int(head_dim * partial) // 2
        for name in ("short_factor", "long_factor"):
            if len(rope.get(name) or ()) != num_pairs:
                raise ValueError(
                    f"rope_scaling.{name} must give one factor per pair of rotated head dims "
                    f"({num_pairs}), got {rope.get(name)!r}"
                )
        cfg[rope_key] = rope
    window = cfg.get("sliding_window")
    if window is not None and window >= cfg["max_position_embeddings"]:
        cfg["sliding_window"] = None
    return cfg
