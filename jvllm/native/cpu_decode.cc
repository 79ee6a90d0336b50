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
// Tiles are split among XLA's intra-op threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// H cache values in float32: float32 ones where they lie, bfloat16 bits converted into row
// (copying float32 ones there took a call to memmove a row).
inline const float* as_floats(const float* src, int64_t, float*) { return src; }

inline const float* as_floats(const uint16_t* bf16_bits, int64_t H, float* __restrict row) {
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

// Attention of one tile's G query heads of one KV head -> max [G], sum [G], values out [G, H].
// HD > 0 fixes the head size at compile time (the common 64 and 128), so the row loops
// vectorise fully.
template <int HD, typename T>
void attend_head(const float* __restrict q, const T* __restrict keys,
                 const T* __restrict values, const int32_t* __restrict pages, int64_t kv_len,
                 const Shapes& s, float* __restrict max_out, float* __restrict sum_out,
                 float* __restrict out, std::vector<float>& scores) {
  const int64_t G = s.group, B = s.block_size;
  const int64_t H = HD > 0 ? HD : s.head_dim;
  scores.resize(static_cast<size_t>(G * kv_len + H));
  float* __restrict row = scores.data() + G * kv_len;  // one bfloat16 key or value row in float32
  for (int64_t pos = 0; pos < kv_len; ++pos) {
    const T* k = keys + (static_cast<int64_t>(pages[pos / B]) * B + pos % B) * H;
    const float* __restrict key = as_floats(k, H, row);
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
    const float* __restrict value = as_floats(v, H, row);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * kv_len + pos];
      float* __restrict og = out + g * H;
      for (int64_t h = 0; h < H; ++h) og[h] += p * value[h];
    }
  }
}

#if defined(__AVX512F__)
// With AVX-512 and a head size of 64 or 128 (32 W), the same attention in far fewer
// instructions: each run of 32 values of a row loads as two float32 vectors, 16 lanes each
// (bfloat16: the 32-bit words shifted left 16 bits are the even values, the words with their
// low 16 bits cleared the odd ones: two instructions a run), the query heads' values are put
// in the same lanes once, and the weighted values go back in order at the end. A key row's
// products stay in 16 lanes until 16 positions are done, and one transposing sum makes their
// 16 scores; the sums of up to 4 query heads stay in registers. Each row read asks for the
// same row of the sequence's next page, which shuffled pages are slow to reach.

// Lane i: first + step * i.
inline __m512i from(int first, int step) {
  const __m512i i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_add_epi32(_mm512_set1_epi32(first), _mm512_mullo_epi32(_mm512_set1_epi32(step), i));
}

// Which of a run's 32 values the two vectors' lanes hold (as indices into 32 for
// _mm512_permutex2var_ps), and the indices that put them back in order.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  static void load(const float* p, __m512& a, __m512& b) {
    a = _mm512_loadu_ps(p);
    b = _mm512_loadu_ps(p + 16);
  }
  static __m512i a_values() { return from(0, 1); }
  static __m512i b_values() { return from(16, 1); }
  static __m512i first_16() { return a_values(); }
  static __m512i last_16() { return b_values(); }
};

template <>
struct Lanes<uint16_t> {  // bfloat16 bits
  static void load(const uint16_t* p, __m512& a, __m512& b) {
    const __m512i words = _mm512_loadu_si512(p);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(0xFFFF0000)));
  }
  static __m512i a_values() { return from(0, 2); }
  static __m512i b_values() { return from(1, 2); }
  static __m512i first_16() {
    return _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  }
  static __m512i last_16() {
    return _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
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
        _mm_prefetch(ahead + byte, _MM_HINT_T0);
    }
    if (++offset == block_size) offset = 0, ++page;
    return row;
  }
};

// r[16] -> lane i the sum of r[i]'s lanes.
inline __m512 transpose_sum(const __m512* r) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128 bits: lanes 0, 2 sum r[2i]'s, lanes 1, 3 r[2i + 1]'s
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]),
                         _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128 bits: lane j sums r[4i + j]'s
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // 128-bit lane k of the result: b[k]'s four 128-bit lanes summed
  const __m512 b01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                   _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 b23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                   _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(b01, b23, 0x88),
                       _mm512_shuffle_f32x4(b01, b23, 0xDD));
}

// Scores of NG query heads q [NG, 32 W] against the sequence's first kv_len keys ->
// scores[g * stride + pos], written in runs of 16 (stride a multiple of 16).
template <typename T, int W, int NG>
void scores_avx512(const float* q, RowWalk<T> keys, int64_t kv_len, float* scores,
                   int64_t stride) {
  __m512 qa[NG][W], qb[NG][W];
  for (int g = 0; g < NG; ++g) {
    for (int w = 0; w < W; ++w) {
      const float* run = q + (g * W + w) * 32;
      const __m512 lo = _mm512_loadu_ps(run), hi = _mm512_loadu_ps(run + 16);
      qa[g][w] = _mm512_permutex2var_ps(lo, Lanes<T>::a_values(), hi);
      qb[g][w] = _mm512_permutex2var_ps(lo, Lanes<T>::b_values(), hi);
    }
  }
  __m512 products[NG][16];
  for (int64_t start = 0; start < kv_len; start += 16) {
    const int64_t n = std::min<int64_t>(16, kv_len - start);
    for (int64_t j = 0; j < 16; ++j) {
      __m512 sum[NG];
      for (int g = 0; g < NG; ++g) sum[g] = _mm512_setzero_ps();
      if (j < n) {
        const T* key = keys.next();
        for (int w = 0; w < W; ++w) {
          __m512 a, b;
          Lanes<T>::load(key + 32 * w, a, b);
          for (int g = 0; g < NG; ++g) {
            sum[g] = _mm512_fmadd_ps(qa[g][w], a, sum[g]);
            sum[g] = _mm512_fmadd_ps(qb[g][w], b, sum[g]);
          }
        }
      }
      for (int g = 0; g < NG; ++g) products[g][j] = sum[g];
    }
    for (int g = 0; g < NG; ++g)
      _mm512_storeu_ps(scores + g * stride + start, transpose_sum(products[g]));
  }
}

// out [NG, 32 W] = the sum over pos < kv_len of p[g * stride + pos] times value row pos.
template <typename T, int W, int NG>
void values_avx512(const float* p, int64_t stride, RowWalk<T> values, int64_t kv_len,
                   float* out) {
  __m512 sa[NG][W], sb[NG][W];
  for (int g = 0; g < NG; ++g)
    for (int w = 0; w < W; ++w) sa[g][w] = sb[g][w] = _mm512_setzero_ps();
  for (int64_t pos = 0; pos < kv_len; ++pos) {
    const T* value = values.next();
    for (int w = 0; w < W; ++w) {
      __m512 a, b;
      Lanes<T>::load(value + 32 * w, a, b);
      for (int g = 0; g < NG; ++g) {
        const __m512 weight = _mm512_set1_ps(p[g * stride + pos]);
        sa[g][w] = _mm512_fmadd_ps(weight, a, sa[g][w]);
        sb[g][w] = _mm512_fmadd_ps(weight, b, sb[g][w]);
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    for (int w = 0; w < W; ++w) {
      float* run = out + (g * W + w) * 32;
      _mm512_storeu_ps(run, _mm512_permutex2var_ps(sa[g][w], Lanes<T>::first_16(), sb[g][w]));
      _mm512_storeu_ps(run + 16,
                       _mm512_permutex2var_ps(sa[g][w], Lanes<T>::last_16(), sb[g][w]));
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

// attend_head's results, head size 32 W.
template <typename T, int W>
void attend_head_avx512(const float* q, const T* keys, const T* values, const int32_t* pages,
                        int64_t kv_len, const Shapes& s, float* max_out, float* sum_out,
                        float* out, std::vector<float>& scores) {
  const int64_t stride = (kv_len + 15) / 16 * 16, H = 32 * W;
  scores.resize(static_cast<size_t>(s.group * stride));
  const int64_t num_pages = (kv_len + s.block_size - 1) / s.block_size;
  const RowWalk<T> key_rows{keys, pages, s.block_size, H, num_pages};
  const RowWalk<T> value_rows{values, pages, s.block_size, H, num_pages};
  in_groups<4>(s.group, [&](auto n, int64_t g) {
    scores_avx512<T, W, n>(q + g * H, key_rows, kv_len, scores.data() + g * stride, stride);
  });
  softmax(scores.data(), s.group, stride, kv_len, max_out, sum_out);
  in_groups<8 / W>(s.group, [&](auto n, int64_t g) {  // 16 vectors of sums
    values_avx512<T, W, n>(scores.data() + g * stride, stride, value_rows, kv_len, out + g * H);
  });
}
#endif

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
#if defined(__AVX512F__)
      if (H == 64 || H == 128) {
        (H == 64 ? attend_head_avx512<T, 2> : attend_head_avx512<T, 4>)(
            q + at, keys, values, pages, kv_lens[t], s, max_out + n, sum_out + n, out + at,
            scores);
      } else {
        attend_head<0>(q + at, keys, values, pages, kv_lens[t], s, max_out + n,
                         sum_out + n, out + at, scores);
      }
#else
      if (H == 64) {
        attend_head<64>(q + at, keys, values, pages, kv_lens[t], s, max_out + n,
                         sum_out + n, out + at, scores);
      } else if (H == 128) {
        attend_head<128>(q + at, keys, values, pages, kv_lens[t], s, max_out + n,
                         sum_out + n, out + at, scores);
      } else {
        attend_head<0>(q + at, keys, values, pages, kv_lens[t], s, max_out + n,
                         sum_out + n, out + at, scores);
      }
#endif
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

DECODE_ATTENTION_HANDLER(DecodeAttentionBF16, ffi::DataType::U16)
DECODE_ATTENTION_HANDLER(DecodeAttentionF32, ffi::DataType::F32)
