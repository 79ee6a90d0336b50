"""The model's generation_config.json: extra EOS ids and sampling defaults, as vLLM reads them."""

import json
import shutil
import types

import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.arg_utils import EngineArgs
from jvllm.entrypoints.openai.protocol import CompletionRequest
from jvllm.entrypoints.openai.serving_engine import OpenAIServing
from jvllm.model_loader.generation_config import GenerationConfig, load_generation_config

PROMPT = "The capital of France is"


def _write(path, **fields):
    with open(path / "generation_config.json", "w") as f:
        json.dump(fields, f)


def test_fields_map_to_sampling_params_and_eos_ids_become_a_tuple(tmp_path):
    _write(tmp_path, eos_token_id=[7, 9], temperature=0.6, top_p=0.9, max_new_tokens=64, top_k=None)
    config = load_generation_config("auto", str(tmp_path))
    assert config.eos_token_ids == (7, 9)
    assert config.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    _write(tmp_path, eos_token_id=3)
    assert load_generation_config(str(tmp_path), None) == GenerationConfig((3,), {})


def test_vllm_option_and_sources_without_a_file_give_no_defaults(tmp_path):
    _write(tmp_path, eos_token_id=5, temperature=0.3)
    assert load_generation_config("vllm", str(tmp_path)) == GenerationConfig()
    assert load_generation_config("auto", None) == GenerationConfig()
    assert load_generation_config("auto", str(tmp_path / "model.gguf")) == GenerationConfig()


def test_override_generation_config_sets_fields_over_the_models(tmp_path):
    _write(tmp_path, eos_token_id=5, temperature=0.3, top_p=0.9)
    overrides = {"temperature": 0.7, "max_new_tokens": 12}
    merged = load_generation_config("auto", str(tmp_path), overrides)
    assert merged == GenerationConfig((5,), {"temperature": 0.7, "top_p": 0.9, "max_tokens": 12})
    alone = load_generation_config("vllm", str(tmp_path), overrides)
    assert alone == GenerationConfig((), {"temperature": 0.7, "max_tokens": 12})
    for bad, match in (({"seed": 1}, "allowed: .*'temperature'"), ({"top_p": 2.0}, "top_p")):
        with pytest.raises(ValueError, match=f"override_generation_config.*{match}"):
            EngineArgs(override_generation_config=bad)


def test_bad_generation_config_is_rejected_with_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="generation_config=.*'auto'.*'vllm'"):
        load_generation_config(str(tmp_path), None)
    _write(tmp_path, temperature=-1.0)
    with pytest.raises(ValueError, match="generation_config.json.*temperature"):
        load_generation_config("auto", str(tmp_path))
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(str(tmp_path), generation_config=None)


def test_engine_stops_at_its_eos_and_generates_with_its_defaults(tiny_llama_dir, tmp_path):
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    kwargs = {"max_model_len": 128, "max_num_seqs": 4, "compile_all_buckets": False}
    plain = LLM(str(model), generation_config="vllm", **kwargs)
    assert plain.get_default_sampling_params() == SamplingParams()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = plain.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    eos = tokens[3]
    expected = tokens[: tokens.index(eos) + 1]
    assert eos != 2 and len(expected) < 8  # the run would go on without the extra EOS id

    _write(model, eos_token_id=[2, eos], temperature=0.0, max_new_tokens=8)
    llm = LLM(str(model), **kwargs)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=8)
    out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]  # the model's defaults: greedy, 8
    assert out.token_ids == expected and out.finish_reason == "stop"
    assert llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_server_fills_left_out_fields_and_caps_max_tokens():
    engine = types.SimpleNamespace(
        get_tokenizer=lambda: None,
        max_model_len=100,
        engine=types.SimpleNamespace(
            engine_config=types.SimpleNamespace(load_config=types.SimpleNamespace(max_logprobs=5)),
            generation_config=GenerationConfig((), {"temperature": 0.25, "max_tokens": 20}),
        ),
    )
    serving = OpenAIServing(engine, "m")
    left_out = CompletionRequest(prompt="x")
    assert serving.sampling_params(left_out, 16, None).temperature == 0.25
    given = CompletionRequest(prompt="x", temperature=0.9)
    assert serving.sampling_params(given, 16, None).temperature == 0.9
    assert serving.check_length(10, None, "prompt") == 20
    assert serving.check_length(90, None, "prompt") == 10  # the room left wins
    assert serving.check_length(10, 50, "prompt") == 20  # capped, as vLLM does
    assert serving.check_length(10, 3, "prompt") == 3
