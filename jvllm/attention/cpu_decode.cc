// Paged decode attention for XLA:CPU, called through the XLA FFI (cpu_decode.py builds it).
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

struct Shapes {
  int64_t num_kv_heads, num_pages, block_size, head_dim, group, max_pages;
};

// Attention of one tile's G query heads of one KV head -> max [G], sum [G], values out [G, H]. HD > 0 fixes the
// head size at compile time (the common 64 and 128), so the row loops vectorise fully.
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
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict sg = scores.data() + g * kv_len;
    float m = *std::max_element(sg, sg + kv_len);
    float sum = 0.f;
    for (int64_t pos = 0; pos < kv_len; ++pos) {
      sg[pos] = std::exp(sg[pos] - m);
      sum += sg[pos];
    }
    max_out[g] = m;
    sum_out[g] = sum;
  }
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
    return ffi::Error::InvalidArgument("decode_attention: q [T, N, H], cache [L, 2, K, P, B, H]");
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
  const T* keys = base + static_cast<int64_t>(layer.typed_data()[0]) * 2 * kv_stride;
  const T* values = keys + kv_stride;
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
