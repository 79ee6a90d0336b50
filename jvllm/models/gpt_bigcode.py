"""GPT-BigCode (GPTBigCodeForCausalLM: StarCoder, StarCoderBase, SantaCoder, WizardCoder) as
GPT-2's modules (models/gpt2.py), read as HF's modeling_gpt_bigcode.py runs it: GPT-2's layers
with torch Linear weights (not Conv1D's), and multi-query attention by default (`multi_query`:
one key and value head, c_attn's rows q|k|v already as the fused param wants them); without it,
c_attn's rows go head by head (q, k, v of each head) and are reordered into q|k|v blocks, as
GPT-NeoX's are."""

from __future__ import annotations

import functools

from jvllm.config import ModelConfig
from jvllm.models.gpt2 import GPT2LMHeadModel
from jvllm.models.gpt_neox import qkv_blocks

# What GPTBigCodeConfig assumes where a config.json says nothing.
_DEFAULTS = {"multi_query": True, "activation_function": "gelu_pytorch_tanh"}


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = GPT2LMHeadModel.normalize_hf_config({**_DEFAULTS, **cfg})
        if cfg["multi_query"]:
            cfg["num_key_value_heads"] = 1
        cfg["options"] = {**cfg.get("options", {}), "multi_query": bool(cfg["multi_query"])}
        return cfg

    @staticmethod
    def layer_tensors(config: ModelConfig) -> tuple:
        heads = None if config.option("multi_query") else config.num_heads
        qkv = None if heads is None else functools.partial(qkv_blocks, num_heads=heads)
        return (
            ("attn_norm", "ln_1", None, None),
            ("attn.qkv", "attn.c_attn", qkv, qkv),
            ("attn.o", "attn.c_proj", None, None),
            ("mlp_norm", "ln_2", None, None),
            ("mlp.up", "mlp.c_fc", None, None),
            ("mlp.down", "mlp.c_proj", None, None),
        )
