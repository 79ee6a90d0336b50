"""Speculative decoding with DeepSeek-V3's and GLM-4.5's multi-token-prediction layer
(speculative_config method "mtp"), read from the target's own checkpoint: a tiny random V3 or
GLM-4.5 saved with one more layer, which becomes the MTP layer's decoder layer
(model.layers.{L}.*) beside its random enorm, hnorm, eh_proj and shared_head. Its drafts equal a
torch reference (HF's own decoder layer over the whole sequence, no cache), greedy and seeded
requests get the tokens of no speculation, and the targets that have no MTP layer are refused.
"""

import json
import os

import pytest
import test_family_deepseek as deepseek_tests
import test_family_glm4_moe as glm4_moe_tests
import test_spec_decode as ngram_tests
import test_spec_decode_eagle as eagle_tests
import torch
import transformers
from family_parity import save_with_correction_biases
from safetensors.torch import load_file, save_file

from jvllm import LLM, SamplingParams
from jvllm.spec_decode.config import as_speculative_config

ENGINE_KWARGS, PROMPTS = ngram_tests.ENGINE_KWARGS, ngram_tests.PROMPTS
looping_model_dir = ngram_tests.looping_model_dir
proposals_after_each_step = eagle_tests.proposals_after_each_step
NUM_LAYERS = 2  # the target's; the MTP layer is layer 2 (MoE: first_k_dense_replace is 1)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class ReferenceMTP:
    """The MTP layer in torch over whole sequences: HF's decoder layer (the saved model's last
    layer) between the MTP's own tensors, the target HF's model of NUM_LAYERS."""

    def __init__(self, target_dir: str, decoder_layer, tensors: dict):
        self.target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).float().eval()
        self.layer = decoder_layer
        self.w = tensors
        self.eps = self.target.config.rms_norm_eps

    @torch.no_grad()
    def drafts(self, sequence: list[int], next_token: int, num_drafts: int) -> list[int]:
        """The drafts after `sequence` (all computed) whose next token is `next_token`: the
        target's post-norm rows at each position beside the token after it, then each draft
        beside the MTP's own pre-norm row at the position before it."""
        model, w, p = self.target.model, self.w, f"model.layers.{NUM_LAYERS}."
        rows = list(model(torch.tensor([sequence])).last_hidden_state[0])
        tokens, drafts = [*sequence[1:], next_token], []
        for _ in range(num_drafts):
            n = len(tokens)
            x = torch.cat(
                [
                    _rms(model.embed_tokens(torch.tensor(tokens)), w[p + "enorm.weight"], self.eps),
                    _rms(torch.stack(rows), w[p + "hnorm.weight"], self.eps),
                ],
                dim=-1,
            )
            x = (x @ w[p + "eh_proj.weight"].T)[None]  # [1, n, D]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
            out = self.layer(
                x,
                attention_mask=mask,
                position_ids=positions,
                position_embeddings=model.rotary_emb(x, positions),
            )[0]
            normed = _rms(out[-1], w[p + "shared_head.norm.weight"], self.eps)
            drafts.append(int((normed @ w[p + "shared_head.head.weight"].T).argmax()))
            tokens.append(drafts[-1])
            rows.append(out[-1])
        return drafts


# The tiny targets of each family, with one more layer (the MTP layer's): MoE layers after one
# dense one, with correction biases.
TARGETS = {
    "deepseek_v3": lambda: deepseek_tests.v3_like(num_hidden_layers=NUM_LAYERS + 1),
    "glm4_moe": lambda: glm4_moe_tests.glm4_moe_config(
        num_hidden_layers=NUM_LAYERS + 1, attention_bias=True
    ),
}


def save_with_mtp(path: str, family: str = "deepseek_v3") -> ReferenceMTP:
    """A tiny random target of `family` (TARGETS) of NUM_LAYERS layers whose checkpoint keeps
    an MTP layer, at `path`."""
    config = TARGETS[family]()
    config._attn_implementation = "eager"  # the reference layer reads the explicit mask
    full = save_with_correction_biases(path, config)
    with torch.no_grad():  # each layer's outputs small: the target is nearly a bigram model
        for name, param in full.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                param.mul_(0.03)
    full.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    torch.manual_seed(3)
    d, p = config.hidden_size, f"model.layers.{NUM_LAYERS}."
    # The MTP layer nearly reads the next token alone through the target's LM head: it drafts
    # the bigram model's next token, which the target mostly (not always) agrees with.
    eh_proj = torch.cat([torch.eye(d), torch.randn(d, d) * 0.05], dim=1)
    extra = {
        p + "enorm.weight": torch.ones(d),
        p + "hnorm.weight": torch.empty(d).uniform_(0.5, 1.5),
        p + "eh_proj.weight": eh_proj + torch.randn(d, 2 * d) * 0.03,
        p + "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
        p + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
    }
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    hf_config.update(num_hidden_layers=NUM_LAYERS, num_nextn_predict_layers=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return ReferenceMTP(path, full.model.layers[NUM_LAYERS], extra)


@pytest.fixture(
    scope="module", params=[pytest.param("deepseek_v3", marks=pytest.mark.slow), "glm4_moe"]
)
def mtp_target(request, tmp_path_factory) -> tuple[str, ReferenceMTP]:
    """(the checkpoint's path, its reference): DeepSeek-V3's in the slow run only (its MoE
    target and MLA reference take 20-50 s a test)."""
    path = str(tmp_path_factory.mktemp(f"{request.param}_mtp"))
    return path, save_with_mtp(path, request.param)


def mtp(k: int = 3) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def test_mtp_drafts_equal_a_reference_over_hf_hidden_states(mtp_target):
    """After a prefill, and after each step that verified drafts, the drafts proposed for the
    next step are the reference's over the whole sequence so far: the target's final rows, the
    tokens shifted by one, the MTP layer's KV (MLA's latent, its rows at rejected drafts'
    positions recomputed), and its pre-norm row carried through k - 1 more steps."""
    path, reference = mtp_target
    llm = LLM(path, speculative_config=mtp(k=3), **ENGINE_KWARGS)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate([PROMPTS[0], PROMPTS[3]]):
        num_checked = 0
        for sequence, next_token, drafts in proposals_after_each_step(
            engine, f"r{i}", prompt, params
        ):
            assert drafts == reference.drafts(sequence, next_token, 3)
            num_checked += 1
        assert num_checked >= 2


@pytest.mark.slow  # 10 s to 35 s: two engines of a MoE target
def test_mtp_gives_the_tokens_of_no_speculation(mtp_target):
    """Greedy requests (chunked prefill: the 45-token prompt takes two steps beside others),
    then a seeded sampled one beside them; the method's vLLM alias "deepseek_mtp" too; in
    single steps and in windows of speculative rounds."""
    path = mtp_target[0]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.2, top_k=50, seed=11, max_tokens=12, ignore_eos=True)
    prompts, params = [*PROMPTS, PROMPTS[1]], [greedy] * len(PROMPTS) + [seeded]
    tokens = lambda llm: [
        list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)
    ]
    expected = tokens(LLM(path, **ENGINE_KWARGS))
    spec = {**mtp(), "method": "deepseek_mtp"}
    llm = LLM(path, speculative_config=spec, **ENGINE_KWARGS)
    assert tokens(llm) == expected
    stats = llm.llm_engine.spec_decoding_stats
    assert stats.num_draft_tokens > 20 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # Windows of 3 rounds a call: MLA's latent cache read by one-query tiles of k + 1 a row.
    assert tokens(LLM(path, speculative_config=spec, num_scheduler_steps=3, **ENGINE_KWARGS)) == (
        expected
    )


def test_mtp_is_refused_for_a_target_without_mtp_layers(looping_model_dir, tmp_path):
    """A Llama, a V3 whose config.json says no MTP layers, and one that says one (HF's
    default) but whose checkpoint was saved without it (as HF saves)."""
    with pytest.raises(
        ValueError, match="supported targets: DeepseekV3ForCausalLM, Glm4MoeForCausalLM, got Llama"
    ):
        LLM(looping_model_dir, speculative_config=mtp(), **ENGINE_KWARGS)
    deepseek_tests._save(tmp_path, deepseek_tests.v3_like(num_hidden_layers=1))
    with pytest.raises(ValueError, match="has no MTP layer tensors"):
        LLM(str(tmp_path), speculative_config=mtp(), **ENGINE_KWARGS)
    overrides = {"num_nextn_predict_layers": 0}
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        LLM(str(tmp_path), speculative_config={**mtp(), "hf_overrides": overrides})


def test_mtp_reads_the_targets_checkpoint_unless_told_and_takes_vllms_alias():
    assert as_speculative_config(mtp()).model is None
    assert as_speculative_config({**mtp(), "method": "deepseek_mtp"}).method == "mtp"
    assert as_speculative_config({**mtp(), "method": "glm4_moe_mtp"}).method == "mtp"
    assert as_speculative_config({**mtp(), "model": "/elsewhere"}).model == "/elsewhere"
    with pytest.raises(ValueError, match="model must be a path"):
        as_speculative_config({**mtp(), "model": 3})
