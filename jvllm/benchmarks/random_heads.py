"""Draft heads of random weights in their published checkpoint layout, for a given target:
what the speculative decoding benchmark drafts with when no trained head is at hand (its drafts
are then almost never accepted, which measures a round's cost), and the tests' checkpoints.
DeepSeek-V3's head (its MTP layer) lives in its target's checkpoint, so its is a whole small
random V3 that keeps one (`save_random_deepseek_v3_with_mtp`)."""

import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file

from jvllm.config import ModelConfig


def save_random_eagle3_head(
    path: str,
    target: ModelConfig,
    *,
    draft_vocab_size: int,
    layer_ids: tuple[int, ...] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """An EAGLE-3 checkpoint (LlamaForCausalLMEagle3: midlayer.*, fc, norm, lm_head over a
    draft vocabulary of `draft_vocab_size` of the target's ids, d2t and t2d) of the target's
    width, heads and MLP, float32, in `path` -> its tensors. `layer_ids`: the target layers it
    reads (None: EAGLE-3's default, written nowhere)."""
    rng = np.random.default_rng(seed)
    d, vocab = target.hidden_size, target.vocab_size
    target_ids = np.sort(rng.choice(vocab, draft_vocab_size, replace=False))
    t2d = np.zeros(vocab, bool)
    t2d[target_ids] = True
    tensors = {
        "fc.weight": _normal(rng, d, 3 * d),
        "midlayer.input_layernorm.weight": _norm(rng, d),
        "midlayer.hidden_norm.weight": _norm(rng, d),
        **_decoder_layer(rng, target, "midlayer.", attention_input=2 * d),
        "norm.weight": _norm(rng, d),
        "lm_head.weight": rng.normal(0.0, 0.5, (draft_vocab_size, d)).astype(np.float32),
        "d2t": (target_ids - np.arange(draft_vocab_size)).astype(np.int64),
        "t2d": t2d,
    }
    config = {"draft_vocab_size": draft_vocab_size}
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    _save_head(path, tensors, target, "LlamaForCausalLMEagle3", config)
    return tensors


def save_random_eagle1_head(path: str, target: ModelConfig, *, seed: int = 0) -> dict:
    """An EAGLE-1 checkpoint (a LlamaForCausalLM config of one layer: fc with its bias and
    layers.0.* without an input norm; no norm, no LM head) of the target's width, heads and MLP,
    float32, in `path` -> its tensors."""
    rng = np.random.default_rng(seed)
    d = target.hidden_size
    tensors = {
        "fc.weight": _normal(rng, d, 2 * d),
        "fc.bias": _normal(rng, d),
        **_decoder_layer(rng, target, "layers.0.", attention_input=d),
    }
    _save_head(path, tensors, target, "LlamaForCausalLM", {})
    return tensors


def _normal(rng, *shape: int) -> np.ndarray:
    return rng.normal(0.0, 0.15, shape).astype(np.float32)


def _norm(rng, size: int) -> np.ndarray:
    return rng.uniform(0.5, 1.5, size).astype(np.float32)


def _decoder_layer(rng, target: ModelConfig, prefix: str, attention_input: int) -> dict:
    """A head's one Llama decoder layer of the target's heads and MLP, its q/k/v reading
    `attention_input` features, without an input norm (the heads norm their inputs their own
    way)."""
    d, f = target.hidden_size, target.intermediate_size
    n, k, h = target.num_heads, target.num_kv_heads, target.head_dim
    return {
        prefix + "self_attn.q_proj.weight": _normal(rng, n * h, attention_input),
        prefix + "self_attn.k_proj.weight": _normal(rng, k * h, attention_input),
        prefix + "self_attn.v_proj.weight": _normal(rng, k * h, attention_input),
        prefix + "self_attn.o_proj.weight": _normal(rng, d, n * h),
        prefix + "post_attention_layernorm.weight": _norm(rng, d),
        prefix + "mlp.gate_proj.weight": _normal(rng, f, d),
        prefix + "mlp.up_proj.weight": _normal(rng, f, d),
        prefix + "mlp.down_proj.weight": _normal(rng, d, f),
    }


def _save_head(path: str, tensors: dict, target: ModelConfig, architecture: str, extra: dict):
    """`tensors` and a config.json of one layer of the target's shapes, `extra` added."""
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "vocab_size": target.vocab_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "torch_dtype": "float32",
        **extra,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


# A small DeepSeek-V3 (MLA with a q latent, sigmoid-routed experts in groups, a shared expert,
# one dense layer first), of the default model's width and vocabulary.
_V3_SHAPES = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 192,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "moe_intermediate_size": 256,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}


def save_random_deepseek_v3_with_mtp(path: str, tokenizer_dir: str, seed: int = 0) -> None:
    """A DeepseekV3ForCausalLM of `_V3_SHAPES`, float32, random weights, whose checkpoint keeps
    an MTP layer (model.layers.{L}.*, speculative decoding's "mtp" method), with the tokenizer
    of `tokenizer_dir` (its vocabulary size and special tokens), in `path`."""
    rng = np.random.default_rng(seed)
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    c = _V3_SHAPES
    d, n, num_layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    normal = lambda *shape: rng.normal(0.0, shape[-1] ** -0.5, shape).astype(np.float32)
    norm = lambda width=d: rng.uniform(0.5, 1.5, width).astype(np.float32)
    tensors = {
        "model.embed_tokens.weight": rng.normal(0.0, 1.0, (vocab, d)).astype(np.float32),
        "model.norm.weight": norm(),
        "lm_head.weight": normal(vocab, d),
    }

    def gated(prefix: str, width: int) -> None:
        tensors[prefix + "gate_proj.weight"] = normal(width, d)
        tensors[prefix + "up_proj.weight"] = normal(width, d)
        tensors[prefix + "down_proj.weight"] = normal(d, width)

    for i in range(num_layers + 1):  # the last is the MTP layer's decoder layer
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": norm(),
                p + "post_attention_layernorm.weight": norm(),
                p + "self_attn.q_a_proj.weight": normal(c["q_lora_rank"], d),
                p + "self_attn.q_a_layernorm.weight": norm(c["q_lora_rank"]),
                p + "self_attn.q_b_proj.weight": normal(n * (nope + rope), c["q_lora_rank"]),
                p + "self_attn.kv_a_proj_with_mqa.weight": normal(c["kv_lora_rank"] + rope, d),
                p + "self_attn.kv_a_layernorm.weight": norm(c["kv_lora_rank"]),
                p + "self_attn.kv_b_proj.weight": normal(n * (nope + v), c["kv_lora_rank"]),
                p + "self_attn.o_proj.weight": normal(d, n * v),
            }
        )
        if i < c["first_k_dense_replace"]:
            gated(p + "mlp.", c["intermediate_size"])
            continue
        tensors[p + "mlp.gate.weight"] = normal(c["n_routed_experts"], d)
        tensors[p + "mlp.gate.e_score_correction_bias"] = np.zeros(
            c["n_routed_experts"], np.float32
        )
        for j in range(c["n_routed_experts"]):
            gated(p + f"mlp.experts.{j}.", c["moe_intermediate_size"])
        gated(p + "mlp.shared_experts.", c["moe_intermediate_size"] * c["n_shared_experts"])
    p = f"model.layers.{num_layers}."
    tensors.update(
        {
            p + "enorm.weight": norm(),
            p + "hnorm.weight": norm(),
            p + "eh_proj.weight": normal(d, 2 * d),
            p + "shared_head.norm.weight": norm(),
            p + "shared_head.head.weight": normal(vocab, d),
        }
    )
    save_file(tensors, os.path.join(path, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        special = {k: v for k, v in json.load(f).items() if k.endswith("_token_id")}
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **c,
        **special,
        "vocab_size": vocab,
        "num_nextn_predict_layers": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
