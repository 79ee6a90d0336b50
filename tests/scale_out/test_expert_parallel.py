"""Expert parallelism (enable_expert_parallel) on the fake CPU devices of this directory: each
device holds E/T whole experts, and the MoE families decode token for token as on one device,
float, int8 at load and pre-quantized, with tensor parallelism's collectives and no others."""

import functools
import glob
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from family_parity import ragged_prompts, save_random_model
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_families_tp import _TINY, FAMILY_VOCAB
from test_families_tp import FAMILIES as TP_FAMILIES
from test_family_deepseek import v2_lite_like, v3_like
from test_family_gpt_oss import _save_gpt_oss
from test_gguf_families import _gguf_of

from jvllm import LLM, SamplingParams
from jvllm.benchmarks import moe_parallel
from jvllm.benchmarks.quantized_checkpoints import quantize_checkpoint
from jvllm.distributed.expert_parallel import expert_parallel_config
from jvllm.distributed.mesh import make_mesh
from jvllm.distributed.tensor_parallel import axis_rules, shard_config, shard_layout
from jvllm.layers.deepseek_moe import DeepseekMoE
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.model_loader.safetensors_file import read_safetensors
from jvllm.quantization import IntWeight

ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 32, "max_num_seqs": 8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ragged_prompts(FAMILY_VOCAB)
# Mixtral's 8 experts, 2 a device at T = 4; test_scale_out's Qwen2-MoE (the gated shared
# expert's partial sums joining the held experts'), Granite (the ungated one) and gpt-oss
# (gate_up's biases placed by expert, down's whole), 4 experts each. Qwen3-MoE and OLMoE run
# Mixtral's layer.
FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(
        **_TINY, num_local_experts=8, num_experts_per_tok=2
    ),
    **{name: TP_FAMILIES[name] for name in ("qwen2_moe", "granitemoeshared", "gpt_oss")},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """name -> the family's tiny random model, saved once."""

    @functools.cache
    def save(name: str) -> str:
        path = tmp_path_factory.mktemp(name)
        (_save_gpt_oss if name == "gpt_oss" else save_random_model)(path, FAMILIES[name]())
        return str(path)

    return save


@pytest.fixture(scope="module")
def one_device(model_dir):
    """name -> the tokens one device decodes for PROMPTS."""
    return functools.cache(lambda name, **kwargs: _greedy(model_dir(name), **kwargs)[0])


@pytest.fixture(scope="module")
def expert_parallel(model_dir):
    """(name, T) -> (the tokens decoded for PROMPTS, the engine) under expert parallelism."""
    return functools.cache(
        lambda name, t: _greedy(
            model_dir(name), tensor_parallel_size=t, enable_expert_parallel=True
        )
    )


def _greedy(path, prompts=PROMPTS, **kwargs) -> tuple[list[list[int]], LLM]:
    return _greedy_with(LLM(path, **{**ENGINE_KWARGS, **kwargs}), prompts)


def _greedy_with(llm: LLM, prompts=PROMPTS) -> tuple[list[list[int]], LLM]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def _local_shapes(array: jax.Array) -> set:
    return {shard.data.shape for shard in array.addressable_shards}


@pytest.mark.parametrize(
    ("name", "t"),
    [
        ("mixtral", 2),
        ("mixtral", 4),
        ("qwen2_moe", 2),
        ("qwen2_moe", 4),
        ("granitemoeshared", 2),
        ("gpt_oss", 2),
        ("gpt_oss", 4),
    ],
)
def test_moe_families_decode_as_on_one_device(expert_parallel, one_device, name, t):
    assert expert_parallel(name, t)[0] == one_device(name)


def test_each_device_holds_whole_experts_and_the_step_tensor_parallelisms_collectives(
    expert_parallel,
):
    """Mixtral at T = 4: 2 of the 8 experts a device, each of the whole F = 96, the router
    whole, the attention cut as ever; per layer one all-reduce after o and one after the
    experts (no all-to-all), one for the embedding, the logits' all-gathers."""
    _, llm = expert_parallel("mixtral", 4)
    runner = llm.llm_engine.model_runner
    layers = runner.params["layers"]
    assert _local_shapes(layers["mlp"]["gate_up"]) == {(2, 2, 64, 2 * 96)}
    assert _local_shapes(layers["mlp"]["down"]) == {(2, 2, 96, 64)}
    assert _local_shapes(layers["mlp"]["router"]) == {(2, 8, 64)}
    assert _local_shapes(layers["attn"]["o"]["weight"]) == {(2, 64, 16)}
    for shape in runner.compiler.all_shapes()[:2]:
        text = runner.compiler.executables.wait(shape).as_text()
        ops = re.findall(r"= \S+ ([a-z-]+?)(?:-start)?\(", text)
        collectives = sorted(op for op in ops if op.startswith(("all-", "collective", "reduce-s")))
        assert collectives == ["all-gather"] * 2 + ["all-reduce"] * 3


def test_load_weights_places_experts_as_the_loader_does(expert_parallel, model_dir, one_device):
    """The checkpoint's own weights loaded again into the T = 4 engine (each device's experts
    from the whole stacks) leave one device's tokens."""
    _, llm = expert_parallel("mixtral", 4)
    (path,) = glob.glob(f"{model_dir('mixtral')}/*.safetensors")
    llm.load_weights(read_safetensors(path).items())
    tokens, _ = _greedy_with(llm)
    assert tokens == one_device("mixtral")


def test_experts_quantized_at_load_decode_as_on_one_device(model_dir, one_device):
    """int8 experts quantized where they lie: values and per-channel scales cut by expert."""
    expected = one_device("mixtral", quantization="int8")
    tokens, llm = _greedy(
        model_dir("mixtral"),
        quantization="int8",
        tensor_parallel_size=2,
        enable_expert_parallel=True,
    )
    assert tokens == expected
    gate_up = llm.llm_engine.model_runner.params["layers"]["mlp"]["gate_up"]
    assert _local_shapes(gate_up.values) == {(2, 4, 64, 2 * 96)}
    assert _local_shapes(gate_up.scale) == {(2, 4, 2 * 96)}


def test_pre_quantized_experts_decode_as_on_one_device(model_dir, tmp_path):
    """A compressed-tensors W4A16 Mixtral: packed values, scales and zero points cut by
    expert, each expert's groups whole on its device."""
    quantize_checkpoint(
        model_dir("mixtral"),
        str(tmp_path),
        "compressed-tensors",
        scheme="W4A16_ASYM",
        group_size=32,
    )
    expected, _ = _greedy(str(tmp_path))
    tokens, llm = _greedy(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True)
    assert tokens == expected
    down = llm.llm_engine.model_runner.params["layers"]["mlp"]["down"]
    assert isinstance(down, IntWeight)
    # [L, E, O, I * 4 bits]: 4 experts a device, D = 64 rows of F = 96 packed inputs.
    assert _local_shapes(down.packed) == {(2, 4, 64, 48)}


def test_a_moe_gguf_decodes_as_on_one_device(tmp_path):
    """A Qwen2-MoE GGUF dequantized at load (its shared expert's 3 blocks of down inputs do not
    split over 2 devices packed): llama.cpp's 3-D expert tensors placed whole by expert."""
    _, path = _gguf_of(tmp_path, "qwen2_moe")
    expected, _ = _greedy(path, PROMPTS[:3])
    tokens, _ = _greedy(path, PROMPTS[:3], tensor_parallel_size=2, enable_expert_parallel=True)
    assert tokens == expected


def test_the_benchmark_times_both_layouts(capsys):
    moe_parallel.main(
        [
            "--shapes",
            "tiny",
            "--tensor-parallel-size",
            "2",
            "--num-tokens",
            "1",
            "8",
            "--num-iters",
            "1",
        ]
    )
    rows = [
        line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tiny ")
    ]
    assert [row[1:3] for row in rows] == [["2", "1"], ["2", "8"]]
    for *_, tensor, expert, ratio in rows:
        assert float(ratio.rstrip("x")) == pytest.approx(float(expert) / float(tensor), rel=0.05)


def test_experts_that_do_not_divide_over_the_devices_are_refused(tmp_path):
    config = transformers.MixtralConfig(**_TINY, num_local_experts=6, num_experts_per_tok=2)
    save_random_model(str(tmp_path), config)
    message = r"6 routed experts whole on one of tensor_parallel_size=4 devices"
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), tensor_parallel_size=4, enable_expert_parallel=True, **ENGINE_KWARGS)


# DeepSeek's MoE layer alone, under shard_map, against the layer on one device (the whole model
# decodes as on one device in test_deepseek_parallel.py).


def _layer_metadata(config, name: str) -> dict:
    """Each DeepseekMoE param's `name` metadata (its axes, its fused pieces), in its tree."""
    _, state = nnx.split(nnx.eval_shape(lambda: DeepseekMoE(config)))
    boxed = jax.tree.map(
        lambda v: (v.get_metadata()[name],), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    is_box = lambda x: isinstance(x, tuple) and len(x) == 1
    return jax.tree.map(lambda b: b[0], nnx.to_pure_dict(boxed), is_leaf=is_box)


def _run_layer(params: dict, x: jax.Array, config) -> jax.Array:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekMoE(config)))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)(x)


@pytest.mark.parametrize(
    ("routing", "t", "is_expert_parallel"),
    [("noaux_tc", 2, True), ("noaux_tc", 4, True), ("noaux_tc", 4, False), ("greedy", 2, True)],
    ids=["v3-ep2", "v3-ep4", "v3-tp4", "v2-ep2"],
)
def test_deepseek_moe_over_devices_matches_one_device(routing, t, is_expert_parallel):
    """V3's sigmoid router with its correction bias and one shared expert, V2's softmax one
    with two: the routed experts (whole, or cut on F) and the shared experts' partial sums
    joined before the one all-reduce."""
    hf_config = v3_like() if routing == "noaux_tc" else v2_lite_like()
    config = expert_parallel_config(model_config_from_hf(hf_config, "float32"), t, True)
    config = config if is_expert_parallel else model_config_from_hf(hf_config, "float32")
    axes, segments = _layer_metadata(config, "out_sharding"), _layer_metadata(config, "segments")
    _, state = nnx.split(nnx.eval_shape(lambda: DeepseekMoE(config)))
    shapes = nnx.to_pure_dict(state)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(0), len(leaves) + 1)
    params = jax.tree.unflatten(
        treedef, [0.3 * jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)]
    )
    x = jax.random.normal(keys[-1], (24, config.hidden_size))
    expected = _run_layer(params, x, config)

    is_axes = lambda a: isinstance(a, tuple)
    rules = jax.tree.map(lambda a: axis_rules(a, config.is_expert_parallel), axes, is_leaf=is_axes)
    laid_out = jax.tree.map(
        lambda p, a, s, r: shard_layout(np.asarray(p), a, s, t, p.shape, r),
        params,
        axes,
        segments,
        rules,
        is_leaf=is_axes,
    )
    specs = jax.tree.map(lambda a, r: P(*(r.get(n) for n in a)), axes, rules, is_leaf=is_axes)
    local = shard_config(config, t)
    sharded = jax.shard_map(
        functools.partial(_run_layer, config=local),
        mesh=make_mesh(1, t),
        in_specs=(specs, P()),
        out_specs=P(),
        check_vma=False,
    )
    out = jax.jit(sharded)(laid_out, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-4, atol=1e-4)
    assert float(jnp.abs(expected).max()) > 0.1  # the layer's output moves
