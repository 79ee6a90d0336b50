"""The model's generation_config.json: the EOS ids it stops at and the sampling it recommends.

vLLM reads it by default (`generation_config="auto"`), and so do we: its EOS ids end requests
besides config.json's (Llama 3's <|eot_id|>, Qwen's <|endoftext|>), and its sampling fields are
the defaults of requests that do not set them (`LLM.get_default_sampling_params()`, and the
fields an HTTP request leaves out).
"""

import dataclasses
import json
import os

from jvllm.sampling_params import SamplingParams

GENERATION_CONFIG_OPTIONS = ("auto", "vllm")  # or a directory holding generation_config.json
# generation_config.json field -> SamplingParams field: the ones vLLM takes as defaults.
_SAMPLING_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    # SamplingParams field -> the model's default, only for the fields the file sets.
    sampling_defaults: dict = dataclasses.field(default_factory=dict)


def check_generation_overrides(overrides: dict | None) -> None:
    """vLLM's override_generation_config: None, or a dict of generation_config.json's sampling
    fields whose values SamplingParams takes."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise ValueError(  # noqa: TRY004 - every bad engine option is a ValueError (vLLM)
            f"override_generation_config must be a dict (or None), got {overrides!r}"
        )
    unknown = sorted(set(overrides) - set(_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config sets {unknown}; allowed: {sorted(_SAMPLING_FIELDS)}"
        )
    try:
        SamplingParams(**{_SAMPLING_FIELDS[k]: v for k, v in overrides.items()})
    except (TypeError, ValueError) as e:
        raise ValueError(f"override_generation_config: {e}") from None


def load_generation_config(
    option: str, model: str | None, overrides: dict | None = None
) -> GenerationConfig:
    """option "auto": `model`'s generation_config.json when `model` is a directory that has one;
    "vllm": none (the library's defaults, vLLM's spelling); otherwise a directory holding one.
    `overrides` (checked by check_generation_overrides) are set over its sampling fields."""
    config = _read_generation_config(option, model)
    if not overrides:
        return config
    defaults = {**config.sampling_defaults}
    defaults.update({_SAMPLING_FIELDS[k]: v for k, v in overrides.items()})
    return GenerationConfig(config.eos_token_ids, defaults)


def _read_generation_config(option: str, model: str | None) -> GenerationConfig:
    if option == "vllm":
        return GenerationConfig()
    if option == "auto":
        if model is None or not os.path.isdir(model):
            return GenerationConfig()  # the default model and GGUF files ship none
        path = os.path.join(model, "generation_config.json")
        if not os.path.isfile(path):
            return GenerationConfig()
    else:
        path = os.path.join(option, "generation_config.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"generation_config={option!r} holds no generation_config.json; pass 'auto' "
                "(the model's own), 'vllm' (no model defaults) or a directory that holds one"
            )
    with open(path) as f:
        raw = json.load(f)
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    defaults = {
        ours: raw[theirs]
        for theirs, ours in _SAMPLING_FIELDS.items()
        if raw.get(theirs) is not None
    }
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} sets sampling defaults SamplingParams rejects: {e}") from None
    return GenerationConfig(eos_ids, defaults)
