"""Draft heads of random weights in their published checkpoint layout, for a given target:
what the speculative decoding benchmark drafts with when no trained head is at hand (its drafts
are then almost never accepted, which measures a round's cost), and the tests' checkpoints."""

import json
import os

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
    d, f, vocab = target.hidden_size, target.intermediate_size, target.vocab_size
    n, k, h = target.num_heads, target.num_kv_heads, target.head_dim
    normal = lambda *shape: rng.normal(0.0, 0.15, shape).astype(np.float32)
    norm = lambda: rng.uniform(0.5, 1.5, d).astype(np.float32)
    target_ids = np.sort(rng.choice(vocab, draft_vocab_size, replace=False))
    t2d = np.zeros(vocab, bool)
    t2d[target_ids] = True
    tensors = {
        "fc.weight": normal(d, 3 * d),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": normal(n * h, 2 * d),
        "midlayer.self_attn.k_proj.weight": normal(k * h, 2 * d),
        "midlayer.self_attn.v_proj.weight": normal(k * h, 2 * d),
        "midlayer.self_attn.o_proj.weight": normal(d, n * h),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": normal(f, d),
        "midlayer.mlp.up_proj.weight": normal(f, d),
        "midlayer.mlp.down_proj.weight": normal(d, f),
        "norm.weight": norm(),
        "lm_head.weight": rng.normal(0.0, 0.5, (draft_vocab_size, d)).astype(np.float32),
        "d2t": (target_ids - np.arange(draft_vocab_size)).astype(np.int64),
        "t2d": t2d,
    }
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": d,
        "intermediate_size": f,
        "vocab_size": vocab,
        "num_attention_heads": n,
        "num_key_value_heads": k,
        "head_dim": h,
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab_size,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "torch_dtype": "float32",
    }
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors
