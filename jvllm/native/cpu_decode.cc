// Paged decode attention for XLA:CPU, called through the XLA FFI (attention/cpu_decode.py
// builds it).
//
// One query per tile: tile t is token token_idx[t] of sequence seq[t], which reads the first
// kv_lens[t] positions of its pages block_tables[seq[t], :]. Each KV head's row of keys is read
// once for the G query heads that share it, and its scores, softmax and weighted values are
// computed in float32 from the cache's float32 values or bfloat16 bits (uint16, as kv_quant.py
// stores bfloat16 on CPU). Like the pure-JAX page walk it writes, over the rows of the tokens
// the tiles read, each query's unnormalised result (max score, sum of exponentials, weighted
// values) into arrays that come in and go out aliased; every other row keeps what it held.
// Tiles are split among XLA's intra-op threads. Heads of 64 and 128 values take a vector path
// over the portable SIMD layer, other sizes a scalar loop that the compiler vectorises.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel_for.h"
#include "simd_lanes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// H cache values in float32: float32 ones where they lie, bfloat16 bits converted into row
// (copying float32 ones there took a call to memmove a row).
inline const float* row_as_floats(const float* src, int64_t, float*) { return src; }

inline const float* row_as_floats(const uint16_t* bf16_bits, int64_t H, float* __restrict row) {
  for (int64_t h = 0; h < H; ++h) {
    const uint32_t bits = static_cast<uint32_t>(bf16_bits[h]) << 16;
    std::memcpy(row + h, &bits, sizeof(bits));
  }
  return row;
}

// The G rows scores[g * stride + pos], pos < kv_len, exponentiated less their max -> the max
// [G] and the sum [G] of each.
inline void softmax(float* scores, int64_t G, int64_t stride, int64_t kv_len, float* max_out,
                    float* sum_out) {
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict sg = scores + g * stride;
    const float m = *std::max_element(sg, sg + kv_len);
    float sum = 0.f;
    for (int64_t pos = 0; pos < kv_len; ++pos) {
      sg[pos] = std::exp(sg[pos] - m);
      sum += sg[pos];
    }
    max_out[g] = m;
    sum_out[g] = sum;
  }
}

struct Shapes {
  int64_t num_kv_heads, num_pages, block_size, head_dim, group, max_pages;
};

// Attention of one tile's G query heads of one KV head -> max [G], sum [G], values out [G, H]:
// any head size, one dot product at a time (heads of 64 and 128 take attend_head_vectors).
template <typename T>
void attend_head(const float* __restrict q, const T* __restrict keys,
                 const T* __restrict values, const int32_t* __restrict pages, int64_t kv_len,
                 const Shapes& s, float* __restrict max_out, float* __restrict sum_out,
                 float* __restrict out, std::vector<float>& scores) {
  const int64_t G = s.group, B = s.block_size;
  const int64_t H = s.head_dim;
  scores.resize(static_cast<size_t>(G * kv_len + H));
  float* __restrict row = scores.data() + G * kv_len;  // one bfloat16 key or value row in float32
  for (int64_t pos = 0; pos < kv_len; ++pos) {
    const T* k = keys + (static_cast<int64_t>(pages[pos / B]) * B + pos % B) * H;
    const float* __restrict key = row_as_floats(k, H, row);
    for (int64_t g = 0; g < G; ++g) {
      const float* __restrict qg = q + g * H;
      float dot = 0.f;
      for (int64_t h = 0; h < H; ++h) dot += qg[h] * key[h];
      scores[g * kv_len + pos] = dot;
    }
  }
  softmax(scores.data(), G, kv_len, kv_len, max_out, sum_out);
  std::fill(out, out + G * H, 0.f);
  for (int64_t pos = 0; pos < kv_len; ++pos) {
    const T* v = values + (static_cast<int64_t>(pages[pos / B]) * B + pos % B) * H;
    const float* __restrict value = row_as_floats(v, H, row);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * kv_len + pos];
      float* __restrict og = out + g * H;
      for (int64_t h = 0; h < H; ++h) og[h] += p * value[h];
    }
  }
}

// Heads of 64 or 128 values (W runs of 2 kLanes), over the portable SIMD layer (simd_lanes.h),
// the same code for AVX-512, AVX2 and NEON (AVX-512 as fast as the intrinsics it replaced, AVX2
// 1.4-2.2x faster than attend_head; docs/benchmarks/cpu_kernels.md): each run of a row loads as two vectors a and b (bfloat16: the 32-bit words shifted left 16
// bits are the even values, the words with their low 16 bits cleared the odd ones: two
// instructions a run), the query heads' values are put in the same lanes once, and the weighted
// values go back in order at the end. A key row's products stay in kLanes lanes until kLanes
// positions are done, and one transposing sum makes their kLanes scores; the sums of a group of
// query heads stay in registers. Each row read asks for the same row of the sequence's next
// page, which shuffled pages are slow to reach.

// Which of a run's 2 kLanes values lane l of a and of b hold, and the loads that put them there.
template <typename T>
struct Run;

template <>
struct Run<float> {
  static constexpr int a_value(int l) { return l; }
  static constexpr int b_value(int l) { return kLanes + l; }
  JVLLM_INLINE static void load(const float* p, vf32& a, vf32& b) {
    a = load_lanes(p);
    b = load_lanes(p + kLanes);
  }
};

template <>
struct Run<uint16_t> {  // bfloat16 bits
  static constexpr int a_value(int l) { return 2 * l; }
  static constexpr int b_value(int l) { return 2 * l + 1; }
  JVLLM_INLINE static void load(const uint16_t* p, vf32& a, vf32& b) {
    load_bfloat16_pairs(p, a, b);
  }
};

// A sequence's rows of one KV head, one after another along its pages.
template <typename T>
struct RowWalk {
  const T* head;  // the KV head's page 0
  const int32_t* pages;
  int64_t block_size, row_size, num_pages, page = 0, offset = 0;

  const T* next() {
    const T* row = head + (static_cast<int64_t>(pages[page]) * block_size + offset) * row_size;
    if (page + 1 < num_pages) {
      const char* ahead = reinterpret_cast<const char*>(
          head + (static_cast<int64_t>(pages[page + 1]) * block_size + offset) * row_size);
      for (int64_t byte = 0; byte < row_size * static_cast<int64_t>(sizeof(T)); byte += 64)
        __builtin_prefetch(ahead + byte, 0, 3);
    }
    if (++offset == block_size) offset = 0, ++page;
    return row;
  }
};

// Scores of NG query heads q [NG, 2 kLanes W] against the sequence's first kv_len keys ->
// scores[g * stride + pos], written in runs of kLanes (stride a multiple of kLanes).
template <typename T, int W, int NG>
void head_scores(const float* q, RowWalk<T> keys, int64_t kv_len, float* scores,
                 int64_t stride) {
  vf32 qa[NG][W], qb[NG][W];
  JVLLM_UNROLLED for (int g = 0; g < NG; ++g) {
    JVLLM_UNROLLED for (int w = 0; w < W; ++w) {
      const float* run = q + (g * W + w) * 2 * kLanes;
      qa[g][w] = vf32([run](auto l) { return run[Run<T>::a_value(l)]; });
      qb[g][w] = vf32([run](auto l) { return run[Run<T>::b_value(l)]; });
    }
  }
  vf32 products[NG][kLanes];
  for (int64_t start = 0; start < kv_len; start += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, kv_len - start);
    for (int64_t j = 0; j < kLanes; ++j) {
      vf32 sum[NG];
      JVLLM_UNROLLED for (int g = 0; g < NG; ++g) sum[g] = 0.f;
      if (j < n) {
        const T* key = keys.next();
        JVLLM_UNROLLED for (int w = 0; w < W; ++w) {
          vf32 a, b;
          Run<T>::load(key + 2 * kLanes * w, a, b);
          JVLLM_UNROLLED for (int g = 0; g < NG; ++g) {
            sum[g] = multiply_add(qa[g][w], a, sum[g]);
            sum[g] = multiply_add(qb[g][w], b, sum[g]);
          }
        }
      }
      JVLLM_UNROLLED for (int g = 0; g < NG; ++g) products[g][j] = sum[g];
    }
    JVLLM_UNROLLED for (int g = 0; g < NG; ++g) {
      transpose_sum(products[g]).copy_to(scores + g * stride + start, stdx::element_aligned);
    }
  }
}

// out [NG, 2 kLanes W] = the sum over pos < kv_len of p[g * stride + pos] times value row pos
// (of row_size values), runs [first, first + W) of each.
template <typename T, int W, int NG>
void head_values(const float* p, int64_t stride, RowWalk<T> values, int64_t kv_len,
                 int64_t first, int64_t row_size, float* out) {
  vf32 sa[NG][W], sb[NG][W];
  JVLLM_UNROLLED for (int g = 0; g < NG; ++g) {
    JVLLM_UNROLLED for (int w = 0; w < W; ++w) sa[g][w] = sb[g][w] = 0.f;
  }
  for (int64_t pos = 0; pos < kv_len; ++pos) {
    const T* value = values.next() + 2 * kLanes * first;
    JVLLM_UNROLLED for (int w = 0; w < W; ++w) {
      vf32 a, b;
      Run<T>::load(value + 2 * kLanes * w, a, b);
      JVLLM_UNROLLED for (int g = 0; g < NG; ++g) {
        const vf32 weight = p[g * stride + pos];
        sa[g][w] = multiply_add(weight, a, sa[g][w]);
        sb[g][w] = multiply_add(weight, b, sb[g][w]);
      }
    }
  }
  JVLLM_UNROLLED for (int g = 0; g < NG; ++g) {
    JVLLM_UNROLLED for (int w = 0; w < W; ++w) {
      float* run = out + g * row_size + 2 * kLanes * (first + w);
      float a[kLanes], b[kLanes];
      sa[g][w].copy_to(a, stdx::element_aligned);
      sb[g][w].copy_to(b, stdx::element_aligned);
      for (int l = 0; l < kLanes; ++l) {
        run[Run<T>::a_value(l)] = a[l];
        run[Run<T>::b_value(l)] = b[l];
      }
    }
  }
}

// pass(n, g) with n the compile-time constant (std::integral_constant) equal to count <= kMost.
template <int kMost, typename Pass>
void with_count(int64_t count, int64_t g, const Pass& pass) {
  if constexpr (kMost > 1) {
    if (count < kMost) return with_count<kMost - 1>(count, g, pass);
  }
  pass(std::integral_constant<int, kMost>(), g);
}

// pass(n, g) for the query heads [g, g + n) of G in groups of n <= kMost, so that a group's
// vectors stay in registers.
template <int kMost, typename Pass>
void in_groups(int64_t G, const Pass& pass) {
  for (int64_t g = 0; g < G; g += kMost) {
    with_count<kMost>(std::min<int64_t>(kMost, G - g), g, pass);
  }
}

// Query heads whose scores a key row meets at once (AVX2's 2 and 3 were slower than 4), and
// vectors of weighted values summed at once: half the registers.
constexpr int kScoreHeads = 4;
constexpr int kValueSums = kRegisters / 2;

// attend_head's results, head size 2 kLanes W.
template <typename T, int W>
void attend_head_vectors(const float* q, const T* keys, const T* values, const int32_t* pages,
                         int64_t kv_len, const Shapes& s, float* max_out, float* sum_out,
                         float* out, std::vector<float>& scores) {
  const int64_t stride = (kv_len + kLanes - 1) / kLanes * kLanes, H = 2 * kLanes * W;
  scores.resize(static_cast<size_t>(s.group * stride));
  const int64_t num_pages = (kv_len + s.block_size - 1) / s.block_size;
  const RowWalk<T> key_rows{keys, pages, s.block_size, H, num_pages};
  const RowWalk<T> value_rows{values, pages, s.block_size, H, num_pages};
  in_groups<kScoreHeads>(s.group, [&](auto n, int64_t g) {
    head_scores<T, W, n>(q + g * H, key_rows, kv_len, scores.data() + g * stride, stride);
  });
  softmax(scores.data(), s.group, stride, kv_len, max_out, sum_out);
  // Each pass sums kValueSums vectors: the runs [first, first + kRuns) of n query heads.
  constexpr int kRuns = std::min(W, kValueSums / 2);
  static_assert(W % kRuns == 0);
  for (int64_t first = 0; first < W; first += kRuns) {
    in_groups<kValueSums / (2 * kRuns)>(s.group, [&](auto n, int64_t g) {
      head_values<T, kRuns, n>(scores.data() + g * stride, stride, value_rows, kv_len, first, H,
                               out + g * H);
    });
  }
}

template <typename T>
void attend_tiles(int64_t first, int64_t last, const float* q, const T* layer_keys,
                  const T* layer_values, const int32_t* tables, const int32_t* token_idx,
                  const int32_t* seq, const int32_t* kv_lens, const Shapes& s, float* max_out,
                  float* sum_out, float* out) {
  const int64_t N = s.num_kv_heads * s.group, H = s.head_dim;
  const int64_t head_stride = s.num_pages * s.block_size * H;  // one KV head's pages
  std::vector<float> scores;
  for (int64_t t = first; t < last; ++t) {
    if (kv_lens[t] <= 0) continue;
    const int32_t* pages = tables + static_cast<int64_t>(seq[t]) * s.max_pages;
    const int64_t row = static_cast<int64_t>(token_idx[t]) * N;
    for (int64_t kh = 0; kh < s.num_kv_heads; ++kh) {
      const int64_t n = row + kh * s.group, at = n * H;  // the head's first query, its values
      const T* keys = layer_keys + kh * head_stride;
      const T* values = layer_values + kh * head_stride;
      constexpr int kRun = 2 * kLanes;
      const auto attend = H == 64    ? attend_head_vectors<T, 64 / kRun>
                          : H == 128 ? attend_head_vectors<T, 128 / kRun>
                                     : attend_head<T>;
      attend(q + at, keys, values, pages, kv_lens[t], s, max_out + n, sum_out + n, out + at,
             scores);
    }
  }
}

template <ffi::DataType D>
ffi::Error decode_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<D> cache, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> token_idx,
                            ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> kv_lens,
                            ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,  // aliased to the results
                            ffi::ResultBuffer<ffi::F32> max_out,
                            ffi::ResultBuffer<ffi::F32> sum_out, ffi::ResultBuffer<ffi::F32> out) {
  using T = std::conditional_t<D == ffi::DataType::U16, uint16_t, float>;  // U16: bfloat16 bits
  auto q_dims = q.dimensions(), cache_dims = cache.dimensions();
  if (q_dims.size() != 3 || cache_dims.size() != 6 || block_tables.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("decode_attention: q [T, N, H], cache [L, V, K, P, B, H]");
  }
  Shapes s;
  s.num_kv_heads = cache_dims[2];
  s.num_pages = cache_dims[3];
  s.block_size = cache_dims[4];
  s.head_dim = cache_dims[5];
  s.group = q_dims[1] / s.num_kv_heads;
  s.max_pages = block_tables.dimensions()[1];
  const int64_t kv_stride = s.num_kv_heads * s.num_pages * s.block_size * s.head_dim;
  const T* base = reinterpret_cast<const T*>(cache.typed_data());
  // V = 2 planes: keys then values; V = 1: MLA's latent rows, the keys and the values alike.
  const int64_t num_planes = cache_dims[1];
  if (num_planes != 1 && num_planes != 2) {
    return ffi::Error::InvalidArgument("decode_attention: the cache's planes V must be 1 or 2");
  }
  const T* keys = base + static_cast<int64_t>(layer.typed_data()[0]) * num_planes * kv_stride;
  const T* values = num_planes == 2 ? keys + kv_stride : keys;
  float *m = max_out->typed_data(), *l = sum_out->typed_data(), *o = out->typed_data();

  const int64_t num_tiles = static_cast<int64_t>(token_idx.element_count());
  jvllm::parallel_ranges(pool, num_tiles, 4, num_tiles, [&](int64_t first, int64_t last) {
    attend_tiles(first, last, q.typed_data(), keys, values, block_tables.typed_data(),
                 token_idx.typed_data(), seq.typed_data(), kv_lens.typed_data(), s, m, l, o);
  });
  return ffi::Error::Success();
}

}  // namespace

#define DECODE_ATTENTION_HANDLER(name, dtype)                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, decode_attention<dtype>,   \
                                ffi::Ffi::Bind()                 \
                                    .Ctx<ffi::ThreadPool>()      \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<dtype>>()   \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::AnyBuffer>()       \
                                    .Arg<ffi::AnyBuffer>()       \
                                    .Arg<ffi::AnyBuffer>()       \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>());

// One cache dtype's handler a build where the builder says which (native.dtype_flags, a
// bfloat16 cache's model dtype: 3.5 against 4.8 s of a core on the Zen 5), both where it does
// not (the tests' drivers).
#if !defined(JVLLM_MODEL_BF16) || JVLLM_MODEL_BF16
DECODE_ATTENTION_HANDLER(DecodeAttentionBF16, ffi::DataType::U16)
#endif
#if !defined(JVLLM_MODEL_BF16) || !JVLLM_MODEL_BF16
DECODE_ATTENTION_HANDLER(DecodeAttentionF32, ffi::DataType::F32)
#endif
