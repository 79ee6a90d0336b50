// The GGUF kernel's loops (jvllm/native/cpu_gguf.cc) on random blocks of every format it takes
// against a scalar reference written from ggml's definition of each format, without Python or
// XLA: built for a CPU that is not at hand (ARM, by a cross compiler) and run under an emulator
// by tests/test_native_arm.py. Prints one line a case that fails, then "N passed, N failed".
//
// Built as the builder builds the kernel, with -ffp-contract=off (the reference's products and
// sums round apart too), and without -DJVLLM_MODEL_BF16: the flag only picks which handlers a
// build defines, and this drives the float32 and the bfloat16 model's loops in one build.
// A weight's values must be gguf's bit for bit (rounded to bfloat16 in a bfloat16 model), so
// dequantize_rows and rows of the identity through dense_rows are compared exactly; random rows
// within float32's roundings.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "cpu_gguf.cc"

namespace {

int num_passed = 0, num_failed = 0;
std::mt19937 rng(0);

float random_float() { return std::normal_distribution<float>(0.f, 1.f)(rng); }

// IEEE half -> float from its fields (no infinities or NaNs are made below).
float from_half(const uint8_t* p) {
  const int h = p[0] | p[1] << 8, exponent = (h >> 10) & 31, mantissa = h & 1023;
  const float magnitude = exponent == 0 ? std::ldexp(float(mantissa), -24)
                                        : std::ldexp(float(1024 + mantissa), exponent - 25);
  return h & 0x8000 ? -magnitude : magnitude;
}

// A scale of either sign, from 2^-10 to 1 or, one time in eight, subnormal (or zero).
void random_half(uint8_t* p) {
  const int exponent = rng() % 8 == 0 ? 0 : 5 + int(rng() % 10);
  const int h = int(rng() % 2) << 15 | exponent << 10 | int(rng() % 1024);
  p[0] = uint8_t(h), p[1] = uint8_t(h >> 8);
}

// x to the nearest bfloat16 (ties to even), as a float.
float round_to_bfloat16(float x) {
  int e;
  std::frexp(x, &e);
  const double step = std::ldexp(1.0, e - 8);  // 8 significant bits
  return x == 0 ? x : float(std::nearbyint(x / step) * step);
}

float from_bfloat16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// One block's values w as ggml's dequantize_row_* (and gguf.quants) compute them, from its
// fields' bytes f in gguf_blocks.py's order, and the magnitudes m of the terms each value sums
// (|scale * q| + |offset|), which bound a sum's rounding. The formats' blocks.
void q8_0(const uint8_t* const* f, float* w, double* m) {
  const float d = from_half(f[0]);
  for (int j = 0; j < 32; ++j) w[j] = d * float(int8_t(f[1][j])), m[j] = std::fabs(w[j]);
}

void q4_0(const uint8_t* const* f, float* w, double* m) {
  const float d = from_half(f[0]);
  for (int j = 0; j < 16; ++j) {
    w[j] = d * float((f[1][j] & 15) - 8), w[j + 16] = d * float((f[1][j] >> 4) - 8);
    m[j] = std::fabs(w[j]), m[j + 16] = std::fabs(w[j + 16]);
  }
}

void q4_1(const uint8_t* const* f, float* w, double* m) {
  const float d = from_half(f[0]), min = from_half(f[1]);
  for (int j = 0; j < 32; ++j) {
    const float scaled = d * float(j < 16 ? f[2][j] & 15 : f[2][j - 16] >> 4);
    w[j] = scaled + min, m[j] = std::fabs(scaled) + std::fabs(min);
  }
}

// Q5_0's and Q5_1's 32 integers: low nibbles of qs for values 0-15, high for 16-31, and bit j of
// the little-endian u32 qh as value j's fifth bit.
void five_bits(const uint8_t* qh, const uint8_t* qs, int* q) {
  const uint32_t high = qh[0] | qh[1] << 8 | qh[2] << 16 | uint32_t(qh[3]) << 24;
  for (int j = 0; j < 16; ++j) {
    q[j] = (qs[j] & 15) | ((high >> j) << 4 & 0x10);
    q[j + 16] = (qs[j] >> 4) | ((high >> (j + 12)) & 0x10);
  }
}

void q5_0(const uint8_t* const* f, float* w, double* m) {
  const float d = from_half(f[0]);
  int q[32];
  five_bits(f[1], f[2], q);
  for (int j = 0; j < 32; ++j) w[j] = d * float(q[j] - 16), m[j] = std::fabs(w[j]);
}

void q5_1(const uint8_t* const* f, float* w, double* m) {
  const float d = from_half(f[0]), min = from_half(f[1]);
  int q[32];
  five_bits(f[2], f[3], q);
  for (int j = 0; j < 32; ++j) {
    const float scaled = d * float(q[j]);
    w[j] = scaled + min, m[j] = std::fabs(scaled) + std::fabs(min);
  }
}

// ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from a K-quant's 12 bytes.
void scale_min_k4(int j, const uint8_t* s, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63, *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K's and Q5_K's 256 values: four runs of 64, each two sub-blocks of 32 from the low and the
// high nibbles of 32 bytes of qs, and (qh non-null, Q5_K) their fifth bits from qh's 32 bytes,
// bits 2i and 2i + 1 for run i.
void k_quant(const uint8_t* const* f, const uint8_t* qh, const uint8_t* qs, float* w, double* m) {
  const float d = from_half(f[0]), dmin = from_half(f[1]);
  for (int run = 0; run < 4; ++run) {
    for (int half = 0; half < 2; ++half) {
      int scale, min;
      scale_min_k4(2 * run + half, f[2], &scale, &min);
      const float d1 = d * float(scale), m1 = dmin * float(min);
      for (int l = 0; l < 32; ++l) {
        int q = half == 0 ? qs[32 * run + l] & 15 : qs[32 * run + l] >> 4;
        if (qh != nullptr && (qh[l] >> (2 * run + half) & 1)) q += 16;
        const float scaled = d1 * float(q);
        const int j = 64 * run + 32 * half + l;
        w[j] = scaled - m1, m[j] = std::fabs(scaled) + std::fabs(m1);
      }
    }
  }
}

void q4_k(const uint8_t* const* f, float* w, double* m) { k_quant(f, nullptr, f[3], w, m); }
void q5_k(const uint8_t* const* f, float* w, double* m) { k_quant(f, f[3], f[4], w, m); }

void q6_k(const uint8_t* const* f, float* w, double* m) {
  const float d = from_half(f[3]);
  for (int n = 0; n < 2; ++n) {
    const uint8_t *ql = f[0] + 64 * n, *qh = f[1] + 32 * n;
    const int8_t* sc = reinterpret_cast<const int8_t*>(f[2]) + 8 * n;
    for (int l = 0; l < 32; ++l) {
      // Values l, l + 32, l + 64, l + 96: low bits from ql's low nibbles, then its high ones.
      const int q[4] = {(ql[l] & 15) | (qh[l] & 3) << 4, (ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4,
                        (ql[l] >> 4) | (qh[l] >> 4 & 3) << 4,
                        (ql[l + 32] >> 4) | (qh[l] >> 6) << 4};
      for (int k = 0; k < 4; ++k) {
        const int j = 128 * n + 32 * k + l;
        w[j] = (d * float(sc[l / 16 + 2 * k])) * float(q[k] - 32), m[j] = std::fabs(w[j]);
      }
    }
  }
}

// A format as the driver sees it: its kernel type's fields' bytes a block, which of them hold a
// float16, and its reference.
struct Format {
  const char* name;
  std::vector<int64_t> field_bytes;
  std::vector<int> halves;
  void (*reference)(const uint8_t* const*, float*, double*);
};

// W [O, I] of format F as random field arrays [O, nb, bytes] and its values; then the kernel's
// dequantized layer and products with R rows of x against them, in a float32 and a bfloat16
// model.
template <typename F>
void check(const Format& format, int64_t O, int64_t I) {
  const int64_t nb = I / F::kBlock;
  std::vector<std::vector<uint8_t>> fields(F::kFields);
  const uint8_t* data[F::kFields];
  for (int i = 0; i < F::kFields; ++i) {
    fields[i].resize(O * nb * format.field_bytes[i]);
    for (uint8_t& byte : fields[i]) byte = uint8_t(rng());
    if (std::count(format.halves.begin(), format.halves.end(), i) != 0) {
      for (size_t at = 0; at < fields[i].size(); at += 2) random_half(&fields[i][at]);
    }
    data[i] = fields[i].data();
  }
  std::vector<float> values(O * I);
  std::vector<double> magnitudes(O * I);
  for (int64_t block = 0; block < O * nb; ++block) {
    const uint8_t* at[F::kFields];
    for (int i = 0; i < F::kFields; ++i) at[i] = data[i] + block * format.field_bytes[i];
    format.reference(at, &values[block * F::kBlock], &magnitudes[block * F::kBlock]);
  }
  const int64_t* field_bytes = format.field_bytes.data();
  const int64_t split = O / 3;  // two ranges of output rows, as XLA's threads take them
  char name[64];

  for (bool bf16 : {false, true}) {
    std::vector<float> want(values);
    if (bf16) {
      for (float& v : want) v = round_to_bfloat16(v);
    }
    // The layer dequantized (float32, or the bfloat16 values' bits), bit for bit.
    std::snprintf(name, sizeof(name), "%s %s dequantize", format.name, bf16 ? "bf16" : "f32");
    std::vector<float> w32(O * I);
    std::vector<uint16_t> w16(O * I);
    for (int64_t first : {int64_t(0), split}) {
      const int64_t last = first == 0 ? split : O;
      if (bf16) {
        dequantize_rows<F, true>(first, last, I, data, field_bytes, w16.data());
        for (int64_t i = first * I; i < last * I; ++i) w32[i] = from_bfloat16(w16[i]);
      } else {
        dequantize_rows<F, false>(first, last, I, data, field_bytes, w32.data());
      }
    }
    int64_t wrong = -1;
    for (int64_t i = 0; i < O * I && wrong < 0; ++i) {
      if (std::memcmp(&w32[i], &want[i], sizeof(float)) != 0) wrong = i;
    }
    if (wrong >= 0) {
      std::printf("%s I=%ld: w[%ld, %ld] = %a, want %a\n", name, long(I), long(wrong / I),
                  long(wrong % I), w32[wrong], want[wrong]);
      ++num_failed;
    } else {
      ++num_passed;
    }

    // Rows of x (bfloat16 values in a bfloat16 model) as gguf_dense passes them: each of the
    // first rows_of_identity a row of the identity (gives a value exactly), the rest random.
    for (int64_t R : {1, 3, 8, 13, 32}) {
      const int64_t rows_of_identity = R / 4;
      std::vector<float> x(R * I, 0.f), y(R * O, NAN);
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t k = 0; k < I && r >= rows_of_identity; ++k) {
          x[r * I + k] = bf16 ? round_to_bfloat16(random_float() + 0.5f) : random_float() + 0.5f;
        }
        if (r < rows_of_identity) x[r * I + rng() % I] = 1.f;
      }
      auto products = [&](auto is_bf16) {
        constexpr bool kBF16 = decltype(is_bf16)::value;
        const std::vector<float> x_sums = factored<F, kBF16>() && F::kOffset
                                             ? sub_block_sums<F>(x.data(), R, I)
                                             : std::vector<float>();
        const std::vector<uint16_t> x_bf16 = bf16_bits<kBF16>(x.data(), R, I);
        dense_rows<F, kBF16>(0, split, x.data(), x_sums.data(), x_bf16.data(), R, I, O, data,
                             field_bytes, y.data());
        dense_rows<F, kBF16>(split, O, x.data(), x_sums.data(), x_bf16.data(), R, I, O, data,
                             field_bytes, y.data());
      };
      bf16 ? products(std::true_type{}) : products(std::false_type{});
      std::snprintf(name, sizeof(name), "%s %s dense", format.name, bf16 ? "bf16" : "f32");
      bool ok = true;
      for (int64_t r = 0; r < R && ok; ++r) {
        for (int64_t o = 0; o < O && ok; ++o) {
          double exact = 0, bound = 0;
          for (int64_t k = 0; k < I; ++k) {
            exact += double(x[r * I + k]) * want[o * I + k];
            bound += std::fabs(x[r * I + k]) * (bf16 ? std::fabs(want[o * I + k])
                                                     : magnitudes[o * I + k]);
          }
          // A row of the identity: exactly; else within I float32 roundings of the terms.
          bound = r < rows_of_identity ? 0 : bound * I * std::ldexp(1.0, -23);
          const float got = y[r * O + o];
          if (!(std::fabs(got - exact) <= bound)) {
            std::printf("%s R=%ld I=%ld: y[%ld, %ld] = %a, want %a\n", name, long(R), long(I),
                        long(r), long(o), got, exact);
            ok = false;
          }
        }
      }
      ok ? ++num_passed : ++num_failed;
    }
  }
}

}  // namespace

int main() {
  const Format q8_0f{"Q8_0", {2, 32}, {0}, q8_0};
  const Format q4_0f{"Q4_0", {2, 16}, {0}, q4_0};
  const Format q4_1f{"Q4_1", {2, 2, 16}, {0, 1}, q4_1};
  const Format q5_0f{"Q5_0", {2, 4, 16}, {0}, q5_0};
  const Format q5_1f{"Q5_1", {2, 2, 4, 16}, {0, 1}, q5_1};
  const Format q4_kf{"Q4_K", {2, 2, 12, 128}, {0, 1}, q4_k};
  const Format q5_kf{"Q5_K", {2, 2, 12, 32, 128}, {0, 1}, q5_k};
  const Format q6_kf{"Q6_K", {128, 64, 16, 2}, {3}, q6_k};
  for (int64_t I : {256, 768}) {  // one block of 256 and three
    check<Q8_0>(q8_0f, 7, I);
    check<Q4_0>(q4_0f, 7, I);
    check<Q4_1>(q4_1f, 7, I);
    check<Q5_0>(q5_0f, 7, I);
    check<Q5_1>(q5_1f, 7, I);
    check<Q4_K>(q4_kf, 7, I);
    check<Q5_K>(q5_kf, 7, I);
    check<Q6_K>(q6_kf, 7, I);
  }
  std::printf("%d passed, %d failed\n", num_passed, num_failed);
  return num_failed == 0 ? 0 : 1;
}
