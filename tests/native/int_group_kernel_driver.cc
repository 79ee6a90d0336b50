// The grouped-integer kernel's loops (jvllm/native/cpu_int_group.cc) on random 4- and 8-bit
// weights, symmetric and with zero points, and float8 e4m3 weights with a scale per block,
// against a scalar reference written from quantization/int_weight.py's and fp8_weight.py's
// definitions, without Python or XLA: built for a CPU that is not at hand (ARM, by a cross
// compiler) and run under an emulator by tests/test_native_arm.py. Prints one line a case that
// fails, then "N passed, N failed".
//
// Built as the builder builds the kernel, with -ffp-contract=off. A weight's values must be
// the format's bit for bit, so dequantize_rows (the path past kMaxRows rows) is compared
// exactly; dense_rows' products of 1 to kMaxRows rows within float32's roundings.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "cpu_int_group.cc"

namespace {

int num_passed = 0, num_failed = 0;
std::mt19937 rng(0);

float random_float() { return std::normal_distribution<float>(0.f, 1.f)(rng); }

float from_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// x to the nearest value of `bits` significant bits (ties to even), its exponent at least
// min_exponent (below, the subnormals' step): float16's 11 and -14, bfloat16's 8 and -126.
float round_to(float x, int bits, int min_exponent) {
  int e;
  std::frexp(x, &e);  // |x| in [2^(e - 1), 2^e)
  const double step = std::ldexp(1.0, std::max(e - 1, min_exponent) - (bits - 1));
  return x == 0 ? x : float(std::nearbyint(x / step) * step);
}

float to_half(float x) { return round_to(x, 11, -14); }
float to_bfloat16(float x) { return round_to(x, 8, -126); }

// A float8 e4m3fn byte's value: sign, exponent e of bias 7, mantissa m; 0x7F and 0xFF NaN.
float e4m3(uint8_t b) {
  const int e = b >> 3 & 15, m = b & 7;
  const float magnitude = (b & 0x7F) == 0x7F ? NAN
                          : e == 0           ? std::ldexp(float(m), -9)
                                             : std::ldexp(float(8 + m), e - 10);
  return b & 0x80 ? -magnitude : magnitude;
}

// A scale of dtype S, of either sign, its bytes at p; a float16 one from 2^-10 to 1/2 or, one
// time in eight, so small that (q - z) * s falls among float16's subnormals.
template <Scale S>
float random_scale(uint8_t* p) {
  if constexpr (S == Scale::kF16) {
    const int exponent = rng() % 8 == 0 ? int(rng() % 4) : 5 + int(rng() % 10);
    const int h = int(rng() % 2) << 15 | exponent << 10 | int(rng() % 1024);
    p[0] = uint8_t(h), p[1] = uint8_t(h >> 8);
    const float magnitude = exponent == 0 ? std::ldexp(float(h & 1023), -24)
                                          : std::ldexp(float(1024 + (h & 1023)), exponent - 25);
    return h & 0x8000 ? -magnitude : magnitude;
  } else {
    const float s = random_float() / 16;
    if constexpr (S == Scale::kF32) {
      std::memcpy(p, &s, 4);
      return s;
    }
    uint32_t bits;
    std::memcpy(&bits, &s, 4);
    const uint16_t h = uint16_t(bits >> 16);  // truncated: any bfloat16 value will do
    std::memcpy(p, &h, 2);
    return from_bits(uint32_t(h) << 16);
  }
}

// W [O, I] of format F with a scale of dtype S (and, where has_zero, a zero point) a block of
// `block_rows` rows by `group` columns (the last of a row short where group does not divide I),
// random; then the kernel's dequantized layer and products with rows of x against the format's
// values, in a float32 and a bfloat16 model.
template <Format F, Scale S>
void check(const char* name, int64_t O, int64_t I, int64_t group, int64_t block_rows,
           bool has_zero) {
  constexpr int kBits = F == Format::kInt4 ? 4 : 8;
  constexpr int64_t kScaleBytes = S == Scale::kF32 ? 4 : 2;
  const int64_t G = (I + group - 1) / group, scale_rows = (O + block_rows - 1) / block_rows;
  std::vector<int> q(O * I);
  std::vector<uint8_t> packed(O * I * kBits / 8), scale_bytes(scale_rows * G * kScaleBytes);
  std::vector<int16_t> zero(has_zero ? O * G : 0);
  std::vector<float> s(scale_rows * G), exact(O * I);
  for (int& v : q) {
    v = int(rng() % (1 << kBits));
    if (F == Format::kFP8 && (v & 0x7F) == 0x7F) v = 0;  // no NaN: the products compare sums
  }
  for (int64_t o = 0; o < O; ++o) {
    for (int64_t k = 0; k < I; ++k) {  // 4 bits: run c's byte j, column c + j low, c + 16 + j high
      const int64_t i = o * I + k;
      if (kBits == 8) packed[i] = uint8_t(q[i]);
      if (kBits == 4) packed[i / 32 * 16 + i % 16] |= uint8_t(q[i] << (i % 32 / 16 * 4));
    }
  }
  for (size_t i = 0; i < s.size(); ++i) s[i] = random_scale<S>(&scale_bytes[i * kScaleBytes]);
  for (int16_t& z : zero) z = int16_t(rng() % ((1 << kBits) + 1));  // GPTQ's v1 reaches 2^bits
  for (int64_t i = 0; i < O * I; ++i) {  // (q - z) * s or e4m3(q) * s, rounded to the scale dtype
    const int64_t o = i / I, g = i % I / group;
    const int z = has_zero ? zero[o * G + g] : 1 << (kBits - 1);
    const float d = F == Format::kFP8 ? e4m3(uint8_t(q[i])) : float(q[i] - z);
    const float w = d * s[o / block_rows * G + g];
    exact[i] = S == Scale::kF16 ? to_half(w) : S == Scale::kBF16 ? to_bfloat16(w) : w;
  }
  const Layer layer{packed.data(), scale_bytes.data(), has_zero ? zero.data() : nullptr,
                    O, I, G, group, kBits, block_rows};
  const int64_t split = O / 3;  // two ranges of output rows, as XLA's threads take them
  char label[96];

  for (bool bf16 : {false, true}) {
    std::vector<float> want(exact);  // in the model dtype
    if (bf16) {
      for (float& v : want) v = to_bfloat16(v);
    }
    std::snprintf(label, sizeof(label), "%s group %ld%s %s", name, long(group),
                  has_zero ? " zero points" : "", bf16 ? "bf16" : "f32");
    std::vector<float> w32(O * I);
    std::vector<uint16_t> w16(O * I);
    for (int64_t first : {int64_t(0), split}) {
      const int64_t last = first == 0 ? split : O;
      if (bf16) {
        dequantize_rows<F, S, true>(layer, first, last, w16.data());
        for (int64_t i = first * I; i < last * I; ++i) w32[i] = from_bits(uint32_t(w16[i]) << 16);
      } else {
        dequantize_rows<F, S, false>(layer, first, last, w32.data());
      }
    }
    int64_t wrong = -1;
    for (int64_t i = 0; i < O * I && wrong < 0; ++i) {
      if (std::memcmp(&w32[i], &want[i], sizeof(float)) != 0) wrong = i;
    }
    if (wrong >= 0) {
      std::printf("%s dequantize I=%ld: w[%ld, %ld] = %a, want %a\n", label, long(I),
                  long(wrong / I), long(wrong % I), w32[wrong], want[wrong]);
      ++num_failed;
    } else {
      ++num_passed;
    }

    // Rows of x as int_group_dense passes them: float32, or a bfloat16 model's as float32 or,
    // where its values meet them in bfloat16 dot products, as their bits.
    for (int64_t R : {1, 2, 3, 4, 7, 32}) {
      std::vector<float> x(R * I), y(R * O, NAN);
      std::vector<uint16_t> x_bits(R * I);
      for (int64_t i = 0; i < R * I; ++i) {
        x[i] = random_float();
        if (bf16) x[i] = to_bfloat16(x[i]);
        uint32_t bits;
        std::memcpy(&bits, &x[i], 4);
        x_bits[i] = uint16_t(bits >> 16);
      }
      const Rows rows{bf16 && bf16_dots<true>() ? static_cast<const void*>(x_bits.data())
                                               : x.data(),
                      R, I};
      auto products = [&](auto is_bf16) {
        constexpr bool kBF16 = decltype(is_bf16)::value;
        dense_rows<F, S, kBF16>(layer, rows, 0, split, y.data());
        dense_rows<F, S, kBF16>(layer, rows, split, O, y.data());
      };
      bf16 ? products(std::true_type{}) : products(std::false_type{});
      bool ok = true;
      for (int64_t r = 0; r < R && ok; ++r) {
        for (int64_t o = 0; o < O && ok; ++o) {
          double sum = 0, bound = 0;
          for (int64_t k = 0; k < I; ++k) {
            sum += double(x[r * I + k]) * want[o * I + k];
            bound += std::fabs(double(x[r * I + k]) * want[o * I + k]);
          }
          bound *= I * std::ldexp(1.0, -23);  // I float32 roundings of the terms
          if (!(std::fabs(y[r * O + o] - sum) <= bound)) {
            std::printf("%s dense R=%ld I=%ld: y[%ld, %ld] = %g, want %g\n", label, long(R),
                        long(I), long(r), long(o), y[r * O + o], sum);
            ok = false;
          }
        }
      }
      ok ? ++num_passed : ++num_failed;
    }
  }
}

template <Format F, Scale S>
void check_groups(const char* name) {
  for (int64_t group : {32, 128, 384}) {  // 12 groups a row, 3, one
    for (bool has_zero : {false, true}) check<F, S>(name, 19, 384, group, 1, has_zero);
  }
}

// FP8 blocks as checkpoints hold them: 128 x 128 over a weight of 576 columns (the last block
// of a row 64), a scale a row, one a weight.
template <Scale S>
void check_fp8_blocks(const char* name) {
  check<Format::kFP8, S>(name, 150, 576, 128, 128, false);
  check<Format::kFP8, S>(name, 19, 384, 384, 1, false);
  check<Format::kFP8, S>(name, 19, 96, 96, 19, false);
}

// Every e4m3 byte, NaN's two included, dequantized with a scale of one: float32's bits of the
// value, NaN the quiet one with the byte's sign (XLA's conversion).
void check_every_e4m3_byte() {
  std::vector<uint8_t> bytes(256);
  for (int b = 0; b < 256; ++b) bytes[b] = uint8_t(b);
  const float one = 1.f;
  uint8_t scale[4];
  std::memcpy(scale, &one, 4);
  const Layer layer{bytes.data(), scale, nullptr, 8, 32, 1, 32, 8, 8};
  std::vector<float> w(256);
  dequantize_rows<Format::kFP8, Scale::kF32, false>(layer, 0, 8, w.data());
  int wrong = 0;
  for (int b = 0; b < 256; ++b) {
    const float want = (b & 0x7F) == 0x7F ? from_bits(b & 0x80 ? 0xFFC00000u : 0x7FC00000u)
                                          : e4m3(uint8_t(b));
    if (std::memcmp(&w[b], &want, 4) != 0) {
      std::printf("e4m3 byte 0x%02x: %a, want %a\n", b, w[b], want);
      ++wrong;
    }
  }
  wrong ? ++num_failed : ++num_passed;
}

}  // namespace

int main() {
  check_groups<Format::kInt4, Scale::kF16>("4-bit f16 scales");
  check_groups<Format::kInt4, Scale::kBF16>("4-bit bf16 scales");
  check_groups<Format::kInt4, Scale::kF32>("4-bit f32 scales");
  check_groups<Format::kInt8, Scale::kF16>("8-bit f16 scales");
  check_groups<Format::kInt8, Scale::kBF16>("8-bit bf16 scales");
  check_groups<Format::kInt8, Scale::kF32>("8-bit f32 scales");
  check_fp8_blocks<Scale::kF16>("fp8 f16 scales");
  check_fp8_blocks<Scale::kBF16>("fp8 bf16 scales");
  check_fp8_blocks<Scale::kF32>("fp8 f32 scales");
  check_every_e4m3_byte();
  std::printf("%d passed, %d failed\n", num_passed, num_failed);
  return num_failed == 0 ? 0 : 1;
}
