"""Embedding checkpoints that ship HF's bare base model (`Qwen3Model`, `MistralModel`):
tensors without the causal LM's `model.` prefix and no LM head. They embed like HF's AutoModel;
without a head and with untied embeddings they refuse to generate; with tied ones they
generate like HF's causal LM on the same directory."""

import json

import numpy as np
import pytest
import torch
import transformers
from conftest import hf_greedy
from family_parity import TINY_SHAPES, ragged_prompts, save_random_model
from safetensors import safe_open

from jvllm import LLM, SamplingParams

# The 45-token prompt is pooled over 3 chunks of 16.
PROMPTS = ragged_prompts(TINY_SHAPES["vocab_size"], lengths=(1, 7, 45))
ENGINE = {"dtype": "float32", "max_model_len": 64, "max_num_batched_tokens": 16}
BASE_CONFIGS = {
    "Qwen3Model": lambda: transformers.Qwen3Config(**TINY_SHAPES, head_dim=32),
    "MistralModel": lambda: transformers.MistralConfig(**TINY_SHAPES),
}


def _save_base_model(path, hf_config):
    """A random HF base model (AutoModel) saved as it is: (directory, HF model)."""
    model = save_random_model(str(path), hf_config, auto_class=transformers.AutoModel)
    return str(path), model


@pytest.mark.parametrize("architecture", list(BASE_CONFIGS))
def test_a_base_model_checkpoint_embeds_like_hfs_automodel(architecture, tmp_path):
    path, hf_model = _save_base_model(tmp_path, BASE_CONFIGS[architecture]())
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [architecture]
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert "layers.0.self_attn.q_proj.weight" in names and "norm.weight" in names
    assert not any(n.startswith(("model.", "lm_head")) for n in names)

    llm = LLM(path, runner="pooling", **ENGINE)
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    for output, prompt in zip(outputs, PROMPTS):
        with torch.no_grad():
            last = hf_model(torch.tensor([prompt])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(last, dim=-1).numpy()
        np.testing.assert_allclose(output.outputs.embedding, want, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_without_lm_head_refuses_to_generate(tmp_path):
    """Untied embeddings and no head: a generating engine has nothing to compute logits with.
    Qwen3-Embedding's layout: the causal LM's architecture over base-model tensors."""
    _save_base_model(tmp_path, BASE_CONFIGS["Qwen3Model"]())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]})
    )
    with pytest.raises(ValueError, match="without an LM head.*runner='pooling'"):
        LLM(str(tmp_path), **ENGINE)


def test_a_tied_base_model_generates_like_hfs_causal_lm(tmp_path):
    """Tied embeddings are the head: HF's causal LM loads the base checkpoint the same way."""
    tied = BASE_CONFIGS["Qwen3Model"]()
    tied.tie_word_embeddings = True
    path, _ = _save_base_model(tmp_path, tied)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = LLM(path, **ENGINE).generate(PROMPTS[1], params, use_tqdm=False)
    hf_model.generation_config.eos_token_id = None
    assert outputs[0].outputs[0].token_ids == hf_greedy(hf_model.eval(), PROMPTS[1], 4)
