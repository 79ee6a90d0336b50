"""Pieces shared by the paged attention kernels: input checks, page loads, the online softmax step.

A cache has two planes, K and V ([L, 2, K, P, B, H]), or one (MLA's latent cache [L, 1, K, P, B,
H]), whose rows are both the keys and the values: there every read of V reads plane 0.

Everything here runs both under the Triton lowering and in `interpret=True` mode, so it sticks to
generic Pallas (ref indexing, jnp ops, `lax.dot_general`).
"""

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Finite, so that a fully masked row gives exp(MASK - MASK) = 1 instead of exp(-inf + inf) = NaN;
# any real logit beats it and zeroes what such rows accumulated.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# A quantized cache's values: each is exact in every one of SUPPORTED_DTYPES, so the kernels
# convert pages to q's dtype and apply the scales to the float32 logits and probabilities.
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))

# Triton dots need M, N and K >= 16.
MIN_DOT_DIM = 16

# The kernels keep the running max in log2 units so that the inner loop uses exp2.
LOG2_E = 1.4426950408889634

# The kernels' KV tokens per inner step were chosen for heads up to this width. A wider head
# (Gemma's 256) loads proportionally fewer tokens a step, so that its K and V tiles stay the size
# they were at 128, and gets more warps for its wider rows. Not yet timed on a GPU.
_TUNED_HEAD_DIM = 128
_WIDE_HEAD_NUM_WARPS = 8


def is_supported_page_size(page_size: int) -> bool:
    """The kernels' pages: a power of two of at least 8 tokens."""
    return page_size >= 8 and not page_size & (page_size - 1)


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def validate_paged_inputs(
    name: str,
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    kv_scales: jax.Array | None = None,
) -> tuple[int, int, int, int, int, int]:
    """Checks what the kernels share; returns (L, K, P, B, H, G)."""
    if q.ndim != 3:
        raise ValueError(f"{name}: q must be [tokens, N, H], got shape {q.shape}")
    if kv_cache.ndim != 6 or kv_cache.shape[1] not in (1, 2):
        raise ValueError(
            f"{name}: kv_cache must be [L, 2, K, P, B, H] (K and V) or [L, 1, K, P, B, H] (V is "
            f"K), got shape {kv_cache.shape}"
        )
    num_layers, _, num_kv_heads, num_pages, page_size, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"{name}: q head dim {q.shape[2]} != kv_cache head dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{name}: N={num_heads} query heads is not a multiple of K={num_kv_heads}")
    if kv_scales is not None:
        _validate_quantized(name, q, kv_cache, kv_scales)
    elif q.dtype not in SUPPORTED_DTYPES or kv_cache.dtype != q.dtype:
        raise ValueError(
            f"{name}: q and kv_cache must share one dtype of bfloat16/float16/float32, "
            f"got {q.dtype} and {kv_cache.dtype}"
        )
    if not is_supported_page_size(page_size):
        raise ValueError(f"{name}: page size B={page_size} must be a power of two >= 8")
    if jnp.shape(layer) not in ((), (1,)) or not jnp.issubdtype(
        jnp.result_type(layer), jnp.integer
    ):
        raise ValueError(f"{name}: layer must be an integer scalar, got {jnp.shape(layer)}")
    layer_value = _concrete_int(layer)
    if layer_value is not None and not 0 <= layer_value < num_layers:
        raise ValueError(f"{name}: layer {layer_value} is out of range for L={num_layers} layers")
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(
            f"{name}: block_tables must be i32[S, M], got {block_tables.dtype}{block_tables.shape}"
        )
    if seq_lens.shape != block_tables.shape[:1] or seq_lens.dtype != jnp.int32:
        raise ValueError(
            f"{name}: seq_lens must be i32[S] with S={block_tables.shape[0]}, "
            f"got {seq_lens.dtype}{seq_lens.shape}"
        )
    return num_layers, num_kv_heads, num_pages, page_size, head_dim, num_heads // num_kv_heads


def _validate_quantized(name: str, q: jax.Array, kv_cache: jax.Array, kv_scales: jax.Array):
    if q.dtype not in SUPPORTED_DTYPES or kv_cache.dtype not in QUANTIZED_DTYPES:
        raise ValueError(
            f"{name}: with kv_scales, q must be bfloat16/float16/float32 and kv_cache int8 or "
            f"float8_e4m3fn, got {q.dtype} and {kv_cache.dtype}"
        )
    if kv_scales.shape != kv_cache.shape[:5] or kv_scales.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name}: kv_scales must be kv_cache's [L, 2 or 1, K, P, B] = {kv_cache.shape[:5]} of "
            f"bfloat16/float16/float32, got {kv_scales.dtype}{kv_scales.shape}"
        )


def validate_attention_options(
    name: str, sliding_window: jax.Array | int | None, logit_softcap: float | None
) -> None:
    """sliding_window: None or an integer scalar, >= 1 where it is known at trace time;
    logit_softcap: None or a positive finite float."""
    if sliding_window is not None and (
        jnp.shape(sliding_window) not in ((), (1,))
        or not jnp.issubdtype(jnp.result_type(sliding_window), jnp.integer)
    ):
        raise ValueError(
            f"{name}: sliding_window must be None or an integer scalar (keys a query sees, itself "
            f"included), got {jnp.result_type(sliding_window)}{jnp.shape(sliding_window)}"
        )
    window = None if sliding_window is None else _concrete_int(sliding_window)
    if window is not None and window < 1:
        raise ValueError(f"{name}: sliding_window must be >= 1 (itself included), got {window}")
    if logit_softcap is not None and not (
        isinstance(logit_softcap, numbers.Real)
        and not isinstance(logit_softcap, bool)
        and 0 < logit_softcap < float("inf")
    ):
        raise ValueError(
            f"{name}: logit_softcap must be None or a positive finite float, got {logit_softcap!r}"
        )


def validate_sinks(name: str, sinks: jax.Array | None, num_heads: int) -> None:
    """sinks: None or one float logit per query head, [N] (gpt-oss's attention sinks)."""
    if sinks is not None and (
        jnp.shape(sinks) != (num_heads,) or not jnp.issubdtype(jnp.result_type(sinks), jnp.floating)
    ):
        raise ValueError(
            f"{name}: sinks must be None or one float logit per query head, [{num_heads}], got "
            f"{jnp.result_type(sinks)}{jnp.shape(sinks)}"
        )


def sinks_per_kv_head(sinks: jax.Array, num_kv_heads: int, group_padded: int) -> jax.Array:
    """The sinks [N] as the kernels' rows take them: f32[K, Gp] in log2 units (query head
    n = k * G + g), the padded heads' (dropped from the output) 0."""
    sinks = jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, -1) * LOG2_E  # [K, G]
    return jnp.pad(sinks, ((0, 0), (0, group_padded - sinks.shape[1])))


def _concrete_int(x: jax.Array | int) -> int | None:
    """The value of an integer scalar known at trace time; None for a traced one."""
    if isinstance(x, (int, np.integer)):  # inside jit too: jnp.asarray(x) would be a tracer
        return int(x)
    try:
        return int(np.asarray(x).reshape(()))
    except jax.errors.TracerArrayConversionError:
        return None


def kernel_scalars(layer: jax.Array, sliding_window: jax.Array | None) -> jax.Array:
    """The kernels' scalar operand: i32[1] layer, or i32[2] layer and window when there is one."""
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    if sliding_window is None:
        return layer
    return jnp.concatenate([layer, jnp.asarray(sliding_window, jnp.int32).reshape(1)])


def kv_tokens_per_step(tokens: int, head_dim_padded: int) -> int:
    """KV tokens an inner step loads: `tokens`, proportionally fewer for heads wider than 128."""
    return max(1, tokens * _TUNED_HEAD_DIM // max(head_dim_padded, _TUNED_HEAD_DIM))


def num_warps_for(head_dim_padded: int) -> int:
    return 4 if head_dim_padded <= _TUNED_HEAD_DIM else _WIDE_HEAD_NUM_WARPS


def pad_block_tables(block_tables: jax.Array, num_extra: int) -> jax.Array:
    """Appends null-page columns so that a block of pages starting before M stays in bounds."""
    return jnp.pad(block_tables, ((0, 0), (0, num_extra)))  # [S, M + num_extra]


def load_pages(
    kv_ref,  # [L, 2 or 1, K, P, B, H]
    layer: jax.Array,
    kv_index: int,
    head: jax.Array,
    pages: jax.Array,  # i32[n]
    head_dim_padded: int,
) -> jax.Array:
    """Reads pages of one layer, K or V, and KV head from the whole cache -> [n * B, Hp]."""
    *_, page_size, head_dim = kv_ref.shape
    num_rows = pages.shape[0] * page_size
    if head_dim == head_dim_padded:
        return kv_ref[layer, kv_index, head, pages].reshape(num_rows, head_dim)  # [n, B, H]
    # Triton blocks are powers of two: gather H -> Hp columns, repeating the last one. The padded
    # columns of q are zero, so they add nothing to the logits, and the wrapper drops them from
    # the output.
    rows = jnp.arange(page_size, dtype=jnp.int32)
    cols = jnp.minimum(jnp.arange(head_dim_padded, dtype=jnp.int32), head_dim - 1)
    block = kv_ref[
        layer, kv_index, head, pages[:, None, None], rows[None, :, None], cols[None, None, :]
    ]
    return block.reshape(num_rows, head_dim_padded)  # [n, B, Hp]


def load_kv(
    kv_ref,  # [L, 2, K, P, B, H] or [L, 1, K, P, B, H]
    scales_ref,  # [L, 2 or 1, K, P, B] of a quantized cache, else None
    layer: jax.Array,
    head: jax.Array,
    pages: jax.Array,  # i32[n]
    head_dim_padded: int,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array] | None]:
    """K and V of pages of one layer and KV head -> (k [n * B, Hp], v [n * B, Hp], and for a
    quantized cache the scales of k and of v, f32[n * B] each, else None). A 1-plane cache's
    v is its k, read once."""
    is_v_k = kv_ref.shape[1] == 1
    k = load_pages(kv_ref, layer, 0, head, pages, head_dim_padded)
    v = k if is_v_k else load_pages(kv_ref, layer, 1, head, pages, head_dim_padded)
    if scales_ref is None:
        return k, v, None
    k_scale = load_row_scales(scales_ref, layer, 0, head, pages)
    v_scale = k_scale if is_v_k else load_row_scales(scales_ref, layer, 1, head, pages)
    return k, v, (k_scale, v_scale)


def load_row_scales(
    scales_ref,  # [L, 2 or 1, K, P, B]
    layer: jax.Array,
    kv_index: int,
    head: jax.Array,
    pages: jax.Array,  # i32[n]
) -> jax.Array:
    """A quantized cache's scales of pages of one layer, plane and KV head -> f32[n * B]."""
    num_rows = pages.shape[0] * scales_ref.shape[4]
    return scales_ref[layer, kv_index, head, pages].reshape(num_rows).astype(jnp.float32)


def without_operand(kernel, position: int):
    """A kernel with an optional input ref at `position` (a quantized cache's scales, the
    sinks), as pallas_call calls it when that input is absent: the ref is None."""
    return lambda *refs: kernel(*refs[:position], None, *refs[position:])


def dot_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [R, D] . k [C, D] -> f32[R, C], the float32 logits before any scale."""
    return lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=_precision(q), preferred_element_type=jnp.float32
    )


def _precision(x: jax.Array) -> lax.Precision | None:
    # TF32 would be Triton's default for float32 dots; ask for IEEE so f32 matches the reference.
    return lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def online_softmax_step(
    q: jax.Array,  # [R, Hp]
    k: jax.Array,  # [C, Hp]
    v: jax.Array,  # [C, Hp]
    is_visible: jax.Array,  # bool[R, C] or bool[1, C]
    is_valid_kv: jax.Array,  # bool[C]: slots visible to some row; the others may hold NaN
    acc: jax.Array,  # f32[R, Hp], unnormalized output
    row_max: jax.Array,  # f32[R], running max of the logits, in log2 units
    row_sum: jax.Array,  # f32[R], running sum of exp2(logit - row_max)
    sm_scale: float,
    logit_softcap: float | None = None,
    kv_scales: tuple[jax.Array, jax.Array] | None = None,  # f32[C] of K and V: quantized k, v
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block of flash attention. A quantized block's 1-byte k, v convert to q's dtype
    exactly; K's scales multiply the f32 logits and V's the probabilities."""
    if kv_scales is not None:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    logits = dot_scores(q, k)  # [R, C]
    if kv_scales is not None:
        logits = logits * kv_scales[0][None, :]
    v_scales = None if kv_scales is None else kv_scales[1]
    carry = (acc, row_max, row_sum)
    return online_softmax_update(
        logits, v, is_visible, is_valid_kv, carry, sm_scale, logit_softcap, v_scales
    )


def online_softmax_update(
    logits: jax.Array,  # f32[R, C], unscaled
    v: jax.Array,  # [C, Hv]
    is_visible: jax.Array,  # bool[R, C] or bool[1, C]
    is_valid_kv: jax.Array,  # bool[C]: slots visible to some row; the others may hold NaN
    carry: tuple[jax.Array, jax.Array, jax.Array],  # as online_softmax_step's acc, max, sum
    sm_scale: float,
    logit_softcap: float | None = None,
    v_scales: jax.Array | None = None,  # f32[C]: a quantized v's scales
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The online softmax over one block of logits and its values -> (acc f32[R, Hv], row_max,
    row_sum f32[R]). The scale (and the soft cap, cap * tanh(logit / cap)) is applied to the
    f32 logits, not to a rounded q; a quantized v's scales multiply the probabilities."""
    acc, row_max, row_sum = carry
    if logit_softcap is None:
        logits = logits * (sm_scale * LOG2_E)
    else:
        logits = jnp.tanh(logits * (sm_scale / logit_softcap)) * (logit_softcap * LOG2_E)
    logits = jnp.where(is_visible, logits, MASK_VALUE)
    max_next = jnp.maximum(row_max, logits.max(axis=1))
    alpha = jnp.exp2(row_max - max_next)
    p = jnp.exp2(logits - max_next[:, None])  # [R, C]
    sum_next = alpha * row_sum + p.sum(axis=1)
    # Slots past a length may hold anything (NaN included), and 0 * NaN = NaN: zero them.
    v = jnp.where(is_valid_kv[:, None], v, jnp.zeros_like(v))
    if v_scales is not None:
        p = p * jnp.where(is_valid_kv, v_scales, 0.0)[None, :]
    pv = lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=_precision(v),
        preferred_element_type=jnp.float32,
    )  # [R, Hv]
    return alpha[:, None] * acc + pv, max_next, sum_next


def sequence_kv(
    kv_cache: jax.Array,  # [L, 2, K, P, B, H] or [L, 1, K, P, B, H]
    kv_scales: jax.Array | None,  # [L, 2 or 1, K, P, B]
    layer: jax.Array,
    pages: jax.Array,  # i32[M]
) -> tuple[jax.Array, jax.Array]:
    """For the references: keys and values of `pages` at `layer` -> each [M*B, K, H], as
    stored, or dequantized to f32 with kv_scales; a 1-plane cache's values are its keys."""
    num_planes, num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[5]
    kv = kv_cache[layer][:, :, pages]  # [2 or 1, K, M, B, H]
    if kv_scales is not None:
        kv = kv.astype(jnp.float32) * kv_scales[layer][:, :, pages][..., None].astype(jnp.float32)
    kv = kv.reshape(num_planes, num_kv_heads, -1, head_dim).transpose(0, 2, 1, 3)  # [., M*B, K, H]
    return kv[0], kv[-1]


def reference_attention(
    q: jax.Array,  # [Q, N, H]
    keys: jax.Array,  # [C, K, H]
    values: jax.Array,  # [C, K, H]
    is_visible: jax.Array,  # bool[Q, C]
    sm_scale: float,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # [N]
) -> jax.Array:
    """Dense masked softmax attention in float32, for the references -> f32[Q, N, H]. Sinks
    join each softmax as one more, always visible, unscaled logit with no value."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    qg = q.astype(jnp.float32).reshape(
        num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim
    )
    logits = (
        jnp.einsum("qkgh,ckh->kgqc", qg, keys.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        * sm_scale
    )
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    logits = jnp.where(is_visible, logits, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1, where=is_visible)
        probs = jnp.where(is_visible, probs, 0.0)
    else:
        sink_logits = jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, -1, 1, 1)
        sink_logits = jnp.broadcast_to(sink_logits, (*logits.shape[:-1], 1))  # [K, G, Q, 1]
        probs = jax.nn.softmax(jnp.concatenate([logits, sink_logits], axis=-1), axis=-1)
        probs = jnp.where(is_visible, probs[..., :-1], 0.0)  # the sink's share has no value
    # Zero the values where invisible too: NaN in unused slots must not leak through 0 * NaN.
    values = jnp.where(jnp.any(is_visible, axis=0)[:, None, None], values.astype(jnp.float32), 0.0)
    out = jnp.einsum("kgqc,ckh->qkgh", probs, values, precision=lax.Precision.HIGHEST)
    return out.reshape(num_tokens, num_heads, head_dim)
