"""The model contract (docs/design.md) over any registered family: what the runner, the loaders
and the step loop call. A model is a flax.nnx module; its weights travel as a params pytree (a
nested dict of arrays, split from the module outside jit) and are merged back into the module
inside the jitted step, so one executable serves every set of weights of a config.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.expert_counts import counting_experts, expert_counts
from jvllm.layers.lora import adapter_tokens
from jvllm.layers.scan import is_unstacked
from jvllm.models.registry import model_class
from jvllm.models.weights import CheckpointWeights
from jvllm.quantization import is_quantized


@functools.cache
def _abstract(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The module of `config` split into its graph and its weights' shapes (nothing computed)."""
    cls = model_class(config.architecture)
    return nnx.split(nnx.eval_shape(lambda: cls(config)))


def param_shapes(config: ModelConfig) -> dict:
    """The params pytree the model takes, as ShapeDtypeStructs: what every loader must produce."""
    return nnx.to_pure_dict(_abstract(config)[1])


def param_axes(config: ModelConfig) -> dict:
    """Each param's logical axis names (layers/params.py's AXIS_NAMES), in the params' tree."""
    return _metadata(config, "out_sharding")


def param_segments(config: ModelConfig) -> dict:
    """Each param's fused-axis pieces (layers/params.py's Segments), or None, in the params'
    tree."""
    return _metadata(config, "segments")


def _metadata(config: ModelConfig, name: str) -> dict:
    _, state = _abstract(config)
    is_param = lambda x: isinstance(x, nnx.Variable)
    # Wrapped in a 1-tuple, so that a None or a tuple stays one leaf of the tree.
    boxed = jax.tree.map(lambda v: (v.get_metadata()[name],), state, is_leaf=is_param)
    return jax.tree.map(lambda b: b[0], nnx.to_pure_dict(boxed), is_leaf=_is_box)


def _is_box(x) -> bool:
    return isinstance(x, tuple) and len(x) == 1


def _module(params: dict, config: ModelConfig) -> nnx.Module:
    """The model's module holding `params` (arrays or tracers)."""
    graphdef, state = _abstract(config)
    treedef = jax.tree.structure(state)
    # A quantized weight is one param, however many arrays it holds; so are a param's layers
    # split by layers/scan.py's unstack_layers.
    leaves = jax.tree.leaves(params, is_leaf=lambda x: is_quantized(x) or is_unstacked(x))
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def forward(
    params: dict,
    kv_cache: jax.Array,
    token_ids: jax.Array,
    positions: jax.Array,
    metadata: Any,
    mm=None,
    *,
    config: ModelConfig,
    attn,
) -> tuple[jax.Array, jax.Array]:
    """token_ids i32[T], positions i32[T] -> (post-norm hidden f32[T, D], kv_cache); `mm`:
    the image embeddings of the step's image tokens (a model that takes images; None for
    text)."""
    with adapter_tokens(getattr(metadata, "adapter_slots", None)):
        module = _module(params, config)
        if mm is None:
            return module(kv_cache, token_ids, positions, metadata, attn)
        return module(kv_cache, token_ids, positions, metadata, attn, mm=mm)


def forward_counting_experts(
    params: dict,
    kv_cache: jax.Array,
    token_ids: jax.Array,
    positions: jax.Array,
    metadata: Any,
    mm=None,
    *,
    config: ModelConfig,
    attn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`forward`, and each MoE layer's count of its (token, expert) assignments of the step's
    tokens that the engine keeps -> (hidden, kv_cache, i32[L_moe, E]), the MoE layers in order
    (layers/expert_counts.py). For a model with routed experts.

    A token is kept where it writes a KV slot off the null page (metadata.slot_mapping != 0):
    not a bucket's padding, nor a row of a decode window or of a step run ahead that stopped,
    which compute as the others do and write only the null page."""
    with counting_experts(metadata.slot_mapping != 0) as counting:
        hidden, kv_cache = forward(
            params, kv_cache, token_ids, positions, metadata, mm, config=config, attn=attn
        )
    counts = expert_counts(counting)
    if counts is None:
        raise ValueError(f"{config.architecture} counted no routed experts in its forward")
    return hidden, kv_cache, counts


def module_method(params: dict, method: str, *args, config: ModelConfig):
    """`method` of the module of `config` holding `params`, called with `args`: a draft
    head's computations (models/eagle3.py), which are not a model's forward."""
    return getattr(_module(params, config), method)(*args)


def token_embeddings(params: dict, token_ids: jax.Array, *, config: ModelConfig) -> jax.Array:
    """token_ids i32[T] -> their rows of the model's embedding table f32[T, D], unscaled (an
    EAGLE-3 head embeds its tokens with its target's table); a ValueError for a family that
    keeps its table elsewhere."""
    embed = getattr(_module(params, config), "embed", None)
    if embed is None:
        raise ValueError(f"{config.architecture} keeps no token embedding table named embed")
    return embed(token_ids)


def num_moe_layers(config: ModelConfig) -> int:
    """L_moe: the layers whose MLP routes to experts, the rows of forward_counting_experts'
    counts. They come after any dense layers (the families refuse other mixes), so row i is
    layer num_layers - L_moe + i. Each MoE family names its router param `router` [L, E, D]."""
    flat, _ = jax.tree_util.tree_flatten_with_path(param_shapes(config))
    return sum(leaf.shape[0] for path, leaf in flat if path[-1].key == "router")


def takes_images(config: ModelConfig) -> bool:
    """Whether the model has a vision encoder (`encode_images`, and the image token its
    config names: a multimodal checkpoint without its vision_config runs as text)."""
    family = model_class(config.architecture)
    return hasattr(family, "encode_images") and config.option("image_token_id") is not None


def image_num_embeds(config: ModelConfig) -> int:
    """The most embeddings (and prompt tokens) one image takes in the family's model."""
    return model_class(config.architecture).image_num_embeds(config)


def encode_images(params: dict, data: dict, *, config: ModelConfig) -> jax.Array:
    """A batch of images, as the family's processor lays them out (`data`, e.g. pixel_values
    f32[N, 3, S, S]) -> each image's embeddings f32[N, I, D]."""
    return _module(params, config).encode_images(**data)


def compute_logits(params: dict, hidden: jax.Array, *, config: ModelConfig) -> jax.Array:
    """hidden f32[S, D] (already final-normed) -> logits f32[S, V]; a ValueError for a model
    loaded without its LM head (its tied stand-in would give wrong logits)."""
    config.check_can_generate()
    return _module(params, config).compute_logits(hidden)


def load_checkpoint_weights(
    config: ModelConfig, get, place=None, keep_packed=False, quantized=None
) -> dict:
    """The params of `config`'s family from HF-named torch-layout tensors `get(name)`, each put
    on its device(s) by `place(path, array)` (see CheckpointWeights, also for keep_packed and
    quantized)."""
    weights = CheckpointWeights(
        get,
        param_shapes(config),
        config.num_layers,
        place=place,
        keep_packed=keep_packed,
        quantized=quantized,
    )
    model_class(config.architecture).load_weights(config, weights)
    return weights.params()
