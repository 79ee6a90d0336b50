// x @ W.T for a weight W [O, I] kept as GGUF blocks, on XLA:CPU through the XLA FFI
// (quantization/cpu_gguf.py builds it).
//
// Each block of a row of W is split into its integers and its scales (once for each group of up
// to 8 rows of x); its values are made from them with gguf.quants' operations in its order
// (compiled with -ffp-contract=off, so a product and a sum never fuse), which gives the values
// gguf's dequantize gives bit for bit, and in a bfloat16 model rounded to bfloat16 (to nearest
// even) as the model's float weight would be. Those values are multiplied into the R rows of x
// (already in the model dtype, as float32) and summed in float32, with fused multiply-adds
// where the CPU has them (in a bfloat16 model, bfloat16 dot products where it has those); in a
// float32 model most formats instead multiply a sub-block's scale into the sum of x times its
// integers (dense_rows says why, and what it rounds). The fields of the blocks come in as
// separate arrays [L, O, nb, ...] with a layer index, so that a layer of the scan's stacked
// weights is read where it lies; output rows are split among XLA's intra-op threads. For more
// rows than gguf_dense takes, gguf_dequantize writes the layer's values out for XLA's matmul.
//
// Written over the portable SIMD layer (simd_lanes.h: SSE, AVX2, AVX-512 and NEON from this
// source); x86's extending byte loads, F16C's half conversions, AVX-512's narrowing store and
// BF16 dot products stay intrinsics beside their portable lines, where GCC 12's code of the
// portable line was measured slower (docs/benchmarks/cpu_kernels.md).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "parallel_for.h"
#include "simd_lanes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

static_assert(N == kLanes, "simd.h's lane count, the vectors' here");

constexpr int kMaxRows = 32;
constexpr int kPrefetchBlocks = 64;  // how far ahead each field's stream is fetched

inline float bits_to_float(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// IEEE half -> float, exactly: the F16C instruction where there is one, else integer
// arithmetic only (XLA's threads may treat denormal floats as zero; F16C's half inputs are not).
inline float half_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000 | (mantissa << 13));
  if (exponent == 0) {
    const float x = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -x : x;
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
#endif
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return half_to_float(h);
}

// n float16 values at src -> float32 at dst; eight at a time with F16C.
inline void halves_to_floats(const uint8_t* src, int64_t n, float* dst) {
  int64_t j = 0;
#ifdef __F16C__
  for (; j + 8 <= n; j += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * j));
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(h));
  }
#endif
  for (; j < n; ++j) dst[j] = half_at(src + 2 * j);
}

// Each format: its block size, its number of fields, how many of them (kHalves, leading) are
// one float16 scale per block, and how one block splits into integers and scales. Value j of
// the block is scale[j / kSub] * q[j] (+ offset[j / kSub] where kOffset), rounded after the
// product and after the sum, as gguf.quants computes it. split() gets pointers to the block's
// bytes in each field array (gguf_blocks.py's order) and its kHalves scales s, already in
// float32 (row_scales converts a row's at once), and writes the integers q[kBlock / N], exact
// in float32, and the kBlock / kSub scales and offsets.
struct Q8_0 {
  static constexpr int kFields = 2, kHalves = 1, kBlock = 32, kSub = 32;
  static constexpr bool kOffset = false;
  static void split(const uint8_t* const* f, const float* s, vf32* q, float* scale, float*) {
    scale[0] = s[0];
    for (int v = 0; v < 32 / N; ++v) q[v] = to_floats(widen_bytes<true>(f[1] + N * v));
  }
};

// The fifth bits of Q5_0 and Q5_1, bit j of the u32 at qh for value j: the N values from
// `first`, each at bit 4.
JVLLM_INLINE vi32 fifth_bits(const uint8_t* qh, int first) {
  int32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  const vi32 shifts([first](auto l) { return first + static_cast<int>(l); });
  return ((vi32(bits) >> shifts) & 1) << 4;
}

// The 32 integers of a Q4_0 / Q4_1 / Q5_0 / Q5_1 block, less `bias`: byte j of qs holds the low
// 4 bits of values j (low nibble) and j + 16 (high), and qh, where the format has it (Q5_*),
// their fifth bits.
inline void nibble_block(const uint8_t* qs, const uint8_t* qh, int bias, vf32* q) {
  for (int v = 0; v < 16 / N; ++v) {
    const vi32 b = widen_bytes(qs + N * v);
    vi32 low = b & 15, high = b >> 4;
    if (qh != nullptr) {
      low |= fifth_bits(qh, N * v);
      high |= fifth_bits(qh, 16 + N * v);
    }
    q[v] = to_floats(low - bias);
    q[16 / N + v] = to_floats(high - bias);
  }
}

struct Q4_0 {
  static constexpr int kFields = 2, kHalves = 1, kBlock = 32, kSub = 32;
  static constexpr bool kOffset = false;
  static void split(const uint8_t* const* f, const float* s, vf32* q, float* scale, float*) {
    scale[0] = s[0];
    nibble_block(f[1], nullptr, 8, q);
  }
};

struct Q4_1 {
  static constexpr int kFields = 3, kHalves = 2, kBlock = 32, kSub = 32;
  static constexpr bool kOffset = true;
  static void split(const uint8_t* const* f, const float* s, vf32* q, float* scale,
                    float* offset) {
    scale[0] = s[0];
    offset[0] = s[1];
    nibble_block(f[2], nullptr, 0, q);
  }
};

struct Q5_0 {
  static constexpr int kFields = 3, kHalves = 1, kBlock = 32, kSub = 32;
  static constexpr bool kOffset = false;
  static void split(const uint8_t* const* f, const float* s, vf32* q, float* scale, float*) {
    scale[0] = s[0];
    nibble_block(f[2], f[1], 16, q);
  }
};

struct Q5_1 {
  static constexpr int kFields = 4, kHalves = 2, kBlock = 32, kSub = 32;
  static constexpr bool kOffset = true;
  static void split(const uint8_t* const* f, const float* s, vf32* q, float* scale,
                    float* offset) {
    scale[0] = s[0];
    offset[0] = s[1];
    nibble_block(f[3], f[2], 0, q);
  }
};

// Q4_K's and Q5_K's eight (scale, min) pairs of 6 bits, from 12 bytes s, times d and dmin: the
// first four in the low bits of bytes 0-7, the last four split over bytes 8-11 and the top bits
// of bytes 0-7. gguf subtracts dmin * min; adding its negation rounds the same.
inline void k_scales(const uint8_t* s, float d, float dmin, float* scale, float* offset) {
  for (int j = 0; j < 4; ++j) {
    scale[j] = d * static_cast<float>(s[j] & 0x3F);
    offset[j] = -(dmin * static_cast<float>(s[j + 4] & 0x3F));
    scale[j + 4] = d * static_cast<float>((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
    offset[j + 4] = -(dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30)));
  }
}

// The 256 integers of a Q4_K / Q5_K block: 32 bytes of qs per pair of sub-blocks, the low
// nibbles the first, the high the second; and qh, where the format has it (Q5_K), sub-block
// i's fifth bits as bit i of each of its 32 bytes.
inline void k_block(const uint8_t* qs, const uint8_t* qh, vf32* q) {
  for (int pair = 0; pair < 4; ++pair) {
    for (int v = 0; v < 32 / N; ++v) {
      const vi32 b = widen_bytes(qs + pair * 32 + N * v);
      vi32 low = b & 15, high = b >> 4;
      if (qh != nullptr) {
        const vi32 h = widen_bytes(qh + N * v);
        low |= (h >> (2 * pair) & 1) << 4;
        high |= (h >> (2 * pair + 1) & 1) << 4;
      }
      q[(2 * pair) * (32 / N) + v] = to_floats(low);
      q[(2 * pair + 1) * (32 / N) + v] = to_floats(high);
    }
  }
}

struct Q4_K {
  static constexpr int kFields = 4, kHalves = 2, kBlock = 256, kSub = 32;
  static constexpr bool kOffset = true;
  static void split(const uint8_t* const* f, const float* halves, vf32* q, float* scale,
                    float* offset) {
    k_scales(f[2], halves[0], halves[1], scale, offset);
    k_block(f[3], nullptr, q);
  }
};

struct Q5_K {
  static constexpr int kFields = 5, kHalves = 2, kBlock = 256, kSub = 32;
  static constexpr bool kOffset = true;
  static void split(const uint8_t* const* f, const float* halves, vf32* q, float* scale,
                    float* offset) {
    k_scales(f[2], halves[0], halves[1], scale, offset);
    k_block(f[4], f[3], q);
  }
};

struct Q6_K {
  static constexpr int kFields = 4, kHalves = 0, kBlock = 256, kSub = 16;
  static constexpr bool kOffset = false;
  static void split(const uint8_t* const* f, const float*, vf32* q, float* scale, float*) {
    const uint8_t *ql = f[0], *qh = f[1];
    const int8_t* scales = reinterpret_cast<const int8_t*>(f[2]);
    const float d = half_at(f[3]);
    for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(scales[j]);
    // Two halves of 128 values; in each, rows k = 0..3 of 32: the low 4 bits from the low
    // (k < 2) or high nibbles of 32 bytes of ql, the high 2 bits from bits 2k of qh's 32.
    for (int half = 0; half < 2; ++half) {
      for (int v = 0; v < 32 / N; ++v) {
        const uint8_t* bytes = ql + half * 64 + N * v;
        const vi32 low[2] = {widen_bytes(bytes), widen_bytes(bytes + 32)};
        const vi32 high = widen_bytes(qh + half * 32 + N * v);
        for (int k = 0; k < 4; ++k) {
          const vi32 b = ((low[k % 2] >> ((k / 2) * 4)) & 15) | (((high >> (2 * k)) & 3) << 4);
          q[(half * 128 + k * 32) / N + v] = to_floats(b - 32);
        }
      }
    }
  }
};

// One block as F::split leaves it.
template <typename F>
struct Block {
  static constexpr int kVectors = F::kBlock / N, kSubs = F::kBlock / F::kSub;
  vf32 q[kVectors];
  float scale[kSubs], offset[kSubs];

  // The block's values, as gguf's dequantize gives them.
  void values(vf32* w) const {
    for (int v = 0; v < kVectors; ++v) {
      w[v] = scale[v * N / F::kSub] * q[v];
      if (F::kOffset) w[v] = w[v] + offset[v * N / F::kSub];
    }
  }
};

// Row o of W's kHalves scales, as float32 halves [kHalves, nb].
template <typename F>
void row_scales(int64_t o, int64_t nb, const uint8_t* const* fields, const int64_t* field_bytes,
                float* halves) {
  for (int i = 0; i < F::kHalves; ++i) {
    halves_to_floats(fields[i] + o * nb * field_bytes[i], nb, halves + i * nb);
  }
}

// Row o of W's blocks (fields at one layer) in order, each split by F::split; `halves` holds
// the row's scales. A reader rather than a visitor taking a lambda: sums captured by a lambda
// went through memory at every block.
template <typename F>
class BlockReader {
 public:
  BlockReader(int64_t o, int64_t nb, const uint8_t* const* fields, const int64_t* field_bytes,
              const float* halves)
      : nb_(nb), halves_(halves) {
    for (int i = 0; i < F::kFields; ++i) {
      bytes_[i] = field_bytes[i];
      at_[i] = fields[i] + o * nb * bytes_[i];
    }
  }

  // The next block (the first at first).
  __attribute__((always_inline)) void read(Block<F>& block) {
    float s[F::kHalves + 1];
    for (int i = 0; i < F::kHalves; ++i) s[i] = halves_[i * nb_ + next_];
    ++next_;
    F::split(at_, s, block.q, block.scale, block.offset);
    for (int i = 0; i < F::kFields; ++i) {
      __builtin_prefetch(at_[i] + kPrefetchBlocks * bytes_[i]);
      at_[i] += bytes_[i];
    }
  }

 private:
  int64_t nb_, next_ = 0;
  const float* halves_;
  const uint8_t* at_[F::kFields];
  int64_t bytes_[F::kFields];
};

// The block's values, rounded to bfloat16 where kBF16.
template <typename F, bool kBF16>
inline void model_values(const Block<F>& block, vf32* w) {
  block.values(w);
  if (kBF16) {
    for (int v = 0; v < Block<F>::kVectors; ++v) w[v] = round_bits_to_bfloat16(w[v]);
  }
}

// The number of sub-blocks in a row of I values, rounded up to whole vectors.
template <typename F>
int64_t padded_subs(int64_t I) {
  return (I / F::kSub + N - 1) / N * N;
}

// x_sums [R, padded_subs(I)]: the sum of each sub-block of each row of x [R, I], and zeros.
template <typename F>
std::vector<float> sub_block_sums(const float* x, int64_t R, int64_t I) {
  const int64_t num_subs = padded_subs<F>(I);
  std::vector<float> sums(R * num_subs, 0.f);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t sub = 0; sub < I / F::kSub; ++sub) {
      const float* xs = x + r * I + sub * F::kSub;
      vf32 sum = load_lanes(xs);
      for (int v = 1; v < F::kSub / N; ++v) sum += load_lanes(xs + N * v);
      sums[r * num_subs + sub] = sum_lanes(sum);
    }
  }
  return sums;
}

// Whether dense_rows multiplies a sub-block's scale into the sum of x times its integers (see
// there): in a float32 model, where a sub-block spans two vectors or more (Q6_K's 16 values,
// one AVX-512 vector, took 1.4x longer at 8 rows).
template <typename F, bool kBF16>
constexpr bool factored() {
  return !kBF16 && F::kSub >= 2 * N;
}

// Whether dense_rows multiplies a bfloat16 model's values into x's rows with vdpbf16ps (CPUs
// with AVX-512 BF16): x holds bfloat16 values and the values are rounded to bfloat16, so each
// product is exact in float32 and the instruction adds two at a time, one row's 32 values in
// one instruction where multiply-adds took two and the rounding twelve more.
template <bool kBF16>
constexpr bool bf16_dots() {
#if defined(__AVX512BF16__)
  return kBF16;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
// 32 values (two vectors, lo first) rounded to bfloat16 (to nearest even), in order.
inline __m512bh bf16_pairs(vf32 lo, vf32 hi) {
  return _mm512_cvtne2ps_pbh(static_cast<__m512>(hi), static_cast<__m512>(lo));
}
#endif

// x [R, I] as bfloat16 bits (to nearest even: exact for the bfloat16 values the model passes),
// where bf16_dots<kBF16>().
template <bool kBF16>
std::vector<uint16_t> bf16_bits(const float* x, int64_t R, int64_t I) {
  std::vector<uint16_t> bits(bf16_dots<kBF16>() ? R * I : 0);
  for (size_t i = 0; i < bits.size(); i += N) {  // R * I: whole vectors of blocks
    store_rounded(round_bits_to_bfloat16(vf32(x + i, stdx::element_aligned)), &bits[i]);
  }
  return bits;
}

// What dense_rows shares among the groups of rows of x it multiplies W's rows into.
struct Rows {
  const float* x;       // [R, I]
  const float* x_sums;  // [R, num_subs] where the format has offsets (see dense_rows)
  const uint16_t* x_bf16;  // [R, I]: x's bfloat16 bits, where bf16_dots<kBF16>()
  int64_t I, O, nb, num_subs;
  const uint8_t* const* fields;
  const int64_t* field_bytes;
  const float* halves;  // row o's scales
  float* offsets;       // [num_subs]: room for row o's offsets, zeros past them
  float* y;             // [R, O]
};

// y[r, o] for the G rows r of x from `first`. G is fixed at compile time, and the loops over
// the rows unrolled, so that the rows' sums stay in registers (GCC 12 kept them in memory,
// indexed by the loop: 8 rows 1.1-1.5x slower on AVX-512).
template <typename F, bool kBF16, int G>
void group_products(const Rows& rows, int64_t first, int64_t o) {
  constexpr int V = Block<F>::kVectors, S = F::kSub / N, kSubs = Block<F>::kSubs;
  constexpr bool kFactored = factored<F, kBF16>(), kOffsets = kFactored && F::kOffset;
  const int64_t I = rows.I;
  const float* x = rows.x + first * I;
  float* offsets = rows.offsets;
  vf32 acc[G];
  JVLLM_UNROLLED for (int r = 0; r < G; ++r) acc[r] = 0.f;
  BlockReader<F> reader(o, rows.nb, rows.fields, rows.field_bytes, rows.halves);
  Block<F> block;
  for (int64_t b = 0; b < rows.nb; ++b) {
    reader.read(block);
#if defined(__AVX512BF16__)
    if (bf16_dots<kBF16>()) {
      vf32 w[V];
      block.values(w);
      __m512bh pairs[V / 2];
      for (int v = 0; v < V / 2; ++v) pairs[v] = bf16_pairs(w[2 * v], w[2 * v + 1]);
      JVLLM_UNROLLED for (int r = 0; r < G; ++r) {
        const uint16_t* xb = rows.x_bf16 + (first + r) * I + b * F::kBlock;
        for (int v = 0; v < V / 2; ++v) {
          const __m512bh xs = (__m512bh)_mm512_loadu_si512(xb + 2 * N * v);
          acc[r] = vf32(_mm512_dpbf16_ps(static_cast<__m512>(acc[r]), pairs[v], xs));
        }
      }
      continue;
    }
#endif
    if (!kFactored) {
      vf32 w[V];
      model_values<F, kBF16>(block, w);
      JVLLM_UNROLLED for (int r = 0; r < G; ++r) {
        const float* xb = x + r * I + b * F::kBlock;
        for (int v = 0; v < V; ++v) acc[r] = multiply_add(w[v], load_lanes(xb + N * v), acc[r]);
      }
      continue;
    }
    if (kOffsets) std::copy_n(block.offset, kSubs, offsets + b * kSubs);
    JVLLM_UNROLLED for (int r = 0; r < G; ++r) {
      const float* xb = x + r * I + b * F::kBlock;
      for (int sub = 0; sub < kSubs; ++sub) {
        const vf32* q = block.q + sub * S;
        const float* xs = xb + sub * F::kSub;
        vf32 t = q[0] * load_lanes(xs);
        for (int v = 1; v < S; ++v) t = multiply_add(q[v], load_lanes(xs + N * v), t);
        acc[r] = multiply_add(vf32(block.scale[sub]), t, acc[r]);
      }
    }
  }
  JVLLM_UNROLLED for (int r = 0; r < G; ++r) {
    // The offsets times the sums, added to the lanes: a row of the identity puts a value's
    // scaled integer and its offset in one lane or in two, so either sum rounds once.
    for (int64_t i = 0; kOffsets && i < rows.num_subs; i += N) {
      const float* sums = rows.x_sums + (first + r) * rows.num_subs;
      acc[r] = multiply_add(load_lanes(offsets + i), load_lanes(sums + i), acc[r]);
    }
    rows.y[(first + r) * rows.O + o] = sum_lanes(acc[r]);
  }
}

// Output rows [o_first, o_last) of y [R, O] = x [R, I] @ W.T, W's fields at one layer, x's rows
// in groups of 8, then 4, 2 and 1: each group reads row o's blocks again from the cache.
//
// Where factored<F, kBF16>(), a sub-block's scale multiplies the sum of x times its integers,
// and its offset x_sums' sum of x over it, rather than each value: fewer operations a vector
// and a chain of sums half as long (a Q4_1 row on one EPYC core 1.2x faster). A row of the
// identity still gives gguf's values bit for bit (the scale times one integer, rounded, then
// the offset added, rounded). Other rows' sums differ from the made values' by more than an
// order of sums would: the scaled sums and the offsets' grow apart and cancel at the end, so
// the error is bounded by |scale| sum |x q| + |offset| |sum x| rather than sum |x w| (13x the
// worst error where x's mean is far from 0, about 3e-7 of sum |x w|; adding the offsets block
// by block in the lanes kept it small but cost all the speed). In a bfloat16 model each value
// is rounded to bfloat16 first, so the values are made and multiplied into the rows, pairs at a
// time where bf16_dots<kBF16>() (one Q4_1 row 1.8x faster, eight rows 1.15x slower; every
// group takes the same path, or a row's products would depend on the batch).
template <typename F, bool kBF16>
void dense_rows(int64_t o_first, int64_t o_last, const float* x, const float* x_sums,
                const uint16_t* x_bf16, int64_t R, int64_t I, int64_t O,
                const uint8_t* const* fields, const int64_t* field_bytes, float* y) {
  const int64_t nb = I / F::kBlock, num_subs = padded_subs<F>(I);
  std::vector<float> halves(F::kHalves * nb + 1);  // [kHalves, nb]
  std::vector<float> offsets(num_subs, 0.f);
  const Rows rows{x,    x_sums,      x_bf16, I, O, nb, num_subs, fields, field_bytes,
                  halves.data(), offsets.data(), y};
  for (int64_t o = o_first; o < o_last; ++o) {
    row_scales<F>(o, nb, fields, field_bytes, halves.data());
    int64_t first = 0;
    for (; first + 8 <= R; first += 8) group_products<F, kBF16, 8>(rows, first, o);
    if (first + 4 <= R) group_products<F, kBF16, 4>(rows, first, o), first += 4;
    if (first + 2 <= R) group_products<F, kBF16, 2>(rows, first, o), first += 2;
    if (first < R) group_products<F, kBF16, 1>(rows, first, o);
  }
}

// Rows [o_first, o_last) of W [O, I] at one layer, dequantized into out: float32, or the
// bfloat16 values' 16 bits.
template <typename F, bool kBF16>
void dequantize_rows(int64_t o_first, int64_t o_last, int64_t I, const uint8_t* const* fields,
                     const int64_t* field_bytes, void* out) {
  constexpr int V = Block<F>::kVectors;
  const int64_t nb = I / F::kBlock;
  std::vector<float> halves(F::kHalves * nb + 1);
  for (int64_t o = o_first; o < o_last; ++o) {
    row_scales<F>(o, nb, fields, field_bytes, halves.data());
    BlockReader<F> reader(o, nb, fields, field_bytes, halves.data());
    Block<F> block;
    for (int64_t b = 0; b < nb; ++b) {
      reader.read(block);
      vf32 w[V];
      model_values<F, kBF16>(block, w);
      const int64_t first = o * I + b * F::kBlock;
      if (!kBF16) {
        float* dst = static_cast<float*>(out) + first;
        for (int v = 0; v < V; ++v) w[v].copy_to(dst + N * v, stdx::element_aligned);
        continue;
      }
      uint16_t* dst = static_cast<uint16_t*>(out) + first;
      for (int v = 0; v < V; ++v) store_rounded(w[v], dst + N * v);
    }
  }
}

// The fields' arrays at the layer, and one block's bytes of each; an error where the arguments
// do not describe W [O, I] of the format.
template <typename F>
ffi::Error layer_fields(ffi::RemainingArgs& fields, int64_t at, int64_t O, int64_t I,
                        const uint8_t** data, int64_t* field_bytes) {
  if (fields.size() != F::kFields || I % F::kBlock != 0) {
    return ffi::Error::InvalidArgument("gguf: the format's fields, whole blocks");
  }
  const int64_t num_blocks = O * (I / F::kBlock);
  for (int i = 0; i < F::kFields; ++i) {
    auto field = fields.get<ffi::AnyBuffer>(i);
    if (field.has_error()) return field.error();
    if (field->dimensions().size() == 0 || at < 0 || at >= field->dimensions()[0]) {
      return ffi::Error::InvalidArgument("gguf: fields [L, O, nb, ...], layer in [0, L)");
    }
    const int64_t layer_bytes = static_cast<int64_t>(field->size_bytes()) / field->dimensions()[0];
    field_bytes[i] = layer_bytes / num_blocks;
    data[i] = static_cast<const uint8_t*>(field->untyped_data()) + at * layer_bytes;
  }
  return ffi::Error::Success();
}

template <typename F, bool kBF16>
ffi::Error gguf_dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                      ffi::RemainingArgs fields, ffi::ResultBuffer<ffi::F32> y) {
  auto x_dims = x.dimensions(), y_dims = y->dimensions();
  if (x_dims.size() != 2 || y_dims.size() != 2 || x_dims[0] > kMaxRows) {
    return ffi::Error::InvalidArgument("gguf_dense: x [R <= 32, I], y [R, O]");
  }
  const int64_t R = x_dims[0], I = x_dims[1], O = y_dims[1];
  const uint8_t* data[F::kFields];
  int64_t field_bytes[F::kFields];
  ffi::Error error = layer_fields<F>(fields, layer.typed_data()[0], O, I, data, field_bytes);
  if (error.failure()) return error;
  float* out = y->typed_data();
  const std::vector<float> x_sums = factored<F, kBF16>() && F::kOffset
                                       ? sub_block_sums<F>(x.typed_data(), R, I)
                                       : std::vector<float>();
  const std::vector<uint16_t> x_bf16 = bf16_bits<kBF16>(x.typed_data(), R, I);
  jvllm::parallel_ranges(pool, O, 8, O / 16, [&](int64_t first, int64_t last) {
    dense_rows<F, kBF16>(first, last, x.typed_data(), x_sums.data(), x_bf16.data(), R, I, O, data,
                         field_bytes, out);
  });
  return ffi::Error::Success();
}

// W [O, I] at the layer, dequantized for XLA's matmul of more rows than gguf_dense takes: XLA's
// own dequantization of a Q4_1 [3072, 576] layer took 1.5 ms (4.4 in bfloat16) against the
// 64-row matmul's 1.2.
template <typename F, bool kBF16>
ffi::Error gguf_dequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer,
                           ffi::RemainingArgs fields,
                           ffi::Result<ffi::Buffer<kBF16 ? ffi::BF16 : ffi::F32>> w) {
  auto w_dims = w->dimensions();
  if (w_dims.size() != 2) return ffi::Error::InvalidArgument("gguf_dequantize: w [O, I]");
  const int64_t O = w_dims[0], I = w_dims[1];
  const uint8_t* data[F::kFields];
  int64_t field_bytes[F::kFields];
  ffi::Error error = layer_fields<F>(fields, layer.typed_data()[0], O, I, data, field_bytes);
  if (error.failure()) return error;
  void* out = w->untyped_data();
  jvllm::parallel_ranges(pool, O, 8, O, [&](int64_t first, int64_t last) {
    dequantize_rows<F, kBF16>(first, last, I, data, field_bytes, out);
  });
  return ffi::Error::Success();
}

}  // namespace

#define GGUF_HANDLERS(name, format, bf16, type)                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(GGUFDense##name, (gguf_dense<format, bf16>),  \
                                ffi::Ffi::Bind()                             \
                                    .Ctx<ffi::ThreadPool>()                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()            \
                                    .Arg<ffi::Buffer<ffi::S32>>()            \
                                    .RemainingArgs()                         \
                                    .Ret<ffi::Buffer<ffi::F32>>());          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(GGUFDequantize##name,                        \
                                (gguf_dequantize<format, bf16>),             \
                                ffi::Ffi::Bind()                             \
                                    .Ctx<ffi::ThreadPool>()                  \
                                    .Arg<ffi::Buffer<ffi::S32>>()            \
                                    .RemainingArgs()                         \
                                    .Ret<ffi::Buffer<ffi::type>>());

// One model dtype's handlers a build where the builder says which (native.dtype_flags'
// JVLLM_MODEL_BF16=0 or 1: a model's first process then compiles half the templates, 4.2
// against 6.7 s of a core); both where it does not (the tests' drivers).
#if !defined(JVLLM_MODEL_BF16) || !JVLLM_MODEL_BF16
#define GGUF_FORMAT_F32(format) GGUF_HANDLERS(format##F32, format, false, F32)
#else
#define GGUF_FORMAT_F32(format)
#endif
#if !defined(JVLLM_MODEL_BF16) || JVLLM_MODEL_BF16
#define GGUF_FORMAT_BF16(format) GGUF_HANDLERS(format##BF16, format, true, BF16)
#else
#define GGUF_FORMAT_BF16(format)
#endif
#define GGUF_FORMAT(format) GGUF_FORMAT_F32(format) GGUF_FORMAT_BF16(format)

GGUF_FORMAT(Q8_0)
GGUF_FORMAT(Q4_0)
GGUF_FORMAT(Q4_1)
GGUF_FORMAT(Q5_0)
GGUF_FORMAT(Q5_1)
GGUF_FORMAT(Q4_K)
GGUF_FORMAT(Q5_K)
GGUF_FORMAT(Q6_K)
