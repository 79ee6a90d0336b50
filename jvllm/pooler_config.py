"""How a pooling engine turns a prompt's hidden states into one vector (vLLM's PoolerConfig),
and where its defaults come from: the user's, then a sentence-transformers layout in the model
directory, then vLLM's default for a decoder served as an embedding model (LAST, normalized)."""

import dataclasses
import json
import os

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config keys -> ours.
_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
# The sentence-transformers modules whose work the engine does: the model, pooling, L2 norm.
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """`pooling_type`: "LAST" (the last prompt token's hidden state), "MEAN" (the mean over
    the prompt) or "CLS" (the first token's); `normalize`: L2-normalize the pooled vector.
    None: taken from the model directory, else the default (LAST, True)."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(
                    f"pooler_config.pooling_type must be one of {POOLING_TYPES}, "
                    f"got {self.pooling_type!r}"
                )
            object.__setattr__(self, "pooling_type", kind)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be a bool, got {self.normalize!r}")


def as_pooler_config(config: "PoolerConfig | dict | None") -> PoolerConfig:
    """A PoolerConfig from one, a dict of its fields, or None; ValueError for anything else."""
    if config is None:
        return PoolerConfig()
    if isinstance(config, PoolerConfig):
        return config
    if isinstance(config, dict):
        unknown = sorted(set(config) - {f.name for f in dataclasses.fields(PoolerConfig)})
        if unknown:
            raise ValueError(
                f"pooler_config has unknown keys {unknown}; allowed: pooling_type, normalize"
            )
        return PoolerConfig(**config)
    raise ValueError(f"pooler_config must be a PoolerConfig or a dict, got {config!r}")


def resolve_pooler_config(config: "PoolerConfig | dict | None", model_dir: str | None):
    """Every field set: the user's, else the model directory's sentence-transformers
    modules', else LAST pooling, normalized (vLLM's default for a decoder it converts)."""
    user = as_pooler_config(config)
    found = sentence_transformers_pooling(model_dir) or PoolerConfig()
    pooling_type = user.pooling_type or found.pooling_type or "LAST"
    normalize = next(v for v in (user.normalize, found.normalize, True) if v is not None)
    return PoolerConfig(pooling_type, normalize)


def sentence_transformers_pooling(model_dir: str | None) -> PoolerConfig | None:
    """The pooling of a sentence-transformers layout (`modules.json`, the Pooling module's
    `config.json`, a Normalize module or not); None where the directory has none. A module the
    engine does not run (Dense, ...) or a pooling mode it lacks is a ValueError: ignoring it
    would give other embeddings than sentence-transformers does."""
    if model_dir is None or not os.path.isdir(model_dir):
        return None
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        modules = json.load(f)
    kinds = [module["type"].rsplit(".", 1)[-1] for module in modules]
    unsupported = [kind for kind in kinds if kind not in _ST_MODULES]
    if unsupported:
        raise ValueError(
            f"{path} lists sentence-transformers modules {unsupported} that jvllm does not run; "
            f"supported: {list(_ST_MODULES)}"
        )
    pooling_type = None
    if "Pooling" in kinds:
        module = modules[kinds.index("Pooling")]
        pooling_type = _st_pooling_type(os.path.join(model_dir, module["path"], "config.json"))
    return PoolerConfig(pooling_type, "Normalize" in kinds)


def _st_pooling_type(path: str) -> str:
    with open(path) as f:
        config = json.load(f)
    modes = [key for key, on in config.items() if key.startswith("pooling_mode_") and on is True]
    if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
        raise ValueError(
            f"{path} sets pooling modes {modes}; jvllm supports exactly one of "
            f"{list(_ST_POOLING_MODES)}"
        )
    return _ST_POOLING_MODES[modes[0]]
