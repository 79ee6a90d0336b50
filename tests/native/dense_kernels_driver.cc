// The dense and int8 kernels' loops (jvllm/native/cpu_dense.cc, cpu_int8.cc) on random inputs
// against a scalar reference, without Python or XLA: built for a CPU that is not at hand (ARM,
// by a cross compiler) and run under an emulator by tests/test_native_arm.py. Prints one line a
// case that fails, then "N passed, N failed".
//
// Built once a kernel: -DJVLLM_DRIVE_INT8 includes cpu_int8.cc whole, else (-DJVLLM_DRIVE_DENSE)
// cpu_dense.cc: their helpers share names.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#if defined(JVLLM_DRIVE_INT8)
#include "cpu_int8.cc"
#else
#include "cpu_dense.cc"
#endif

namespace {

int num_passed = 0, num_failed = 0;
std::mt19937 rng(0);

float random_float() { return std::normal_distribution<float>(0.f, 1.f)(rng); }

uint16_t to_bfloat16(float x) {  // truncated: any bfloat16 value will do
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

float from_bfloat16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// got [R, O] against x [R, I] . w [O, I] (each output times scale[o]) in double: within I
// float32 roundings of sum |x w|.
void check(const char* name, int64_t R, int64_t I, int64_t O, const std::vector<double>& x,
           const std::vector<double>& w, const std::vector<double>& scale,
           const std::vector<float>& got) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t o = 0; o < O; ++o) {
      double want = 0, bound = 0;
      for (int64_t k = 0; k < I; ++k) {
        want += x[r * I + k] * w[o * I + k] * scale[o];
        bound += std::fabs(x[r * I + k] * w[o * I + k] * scale[o]);
      }
      bound *= I * std::ldexp(1.0, -23);
      if (!(std::fabs(got[r * O + o] - want) <= bound)) {
        std::printf("%s R=%ld I=%ld: y[%ld, %ld] = %g, want %g\n", name, long(R), long(I), long(r),
                    long(o), got[r * O + o], want);
        ++num_failed;
        return;
      }
    }
  }
  ++num_passed;
}

#if !defined(JVLLM_DRIVE_INT8)
void check_dense(int64_t R, int64_t I, int64_t O) {
  std::vector<float> xf(R * I), wf(O * I), y(R * O);
  std::vector<uint16_t> xb(R * I), wb(O * I);
  std::vector<double> x(R * I), w(O * I), xd(R * I), wd(O * I), ones(O, 1.0);
  for (int64_t i = 0; i < R * I; ++i) {
    xf[i] = random_float(), xb[i] = to_bfloat16(xf[i]);
    x[i] = xf[i], xd[i] = from_bfloat16(xb[i]);
  }
  for (int64_t i = 0; i < O * I; ++i) {
    wf[i] = random_float(), wb[i] = to_bfloat16(wf[i]);
    w[i] = wf[i], wd[i] = from_bfloat16(wb[i]);
  }
  jvllm::dense_range<Float32>(R, 0, O, xf.data(), wf.data(), I, O, y.data());
  check("dense float32", R, I, O, x, w, ones, y);
  jvllm::dense_range<BFloat16Kernel>(R, 0, O, xb.data(), wb.data(), I, O, y.data());
  check("dense bfloat16", R, I, O, xd, wd, ones, y);
}

#else
void check_int8(int64_t R, int64_t I, int64_t O) {
  std::vector<uint16_t> xb(R * I), converted(O * I);
  std::vector<int8_t> v(O * I);
  std::vector<float> scale(O), y(R * O);
  std::vector<double> x(R * I), w(O * I), s(O), ones(O, 1.0), wc(O * I);
  for (int64_t i = 0; i < R * I; ++i) xb[i] = to_bfloat16(random_float()), x[i] = from_bfloat16(xb[i]);
  for (int64_t i = 0; i < O * I; ++i) v[i] = static_cast<int8_t>(rng() % 256 - 128), w[i] = v[i];
  for (int64_t o = 0; o < O; ++o) scale[o] = std::ldexp(1.f, int(rng() % 7) - 3), s[o] = scale[o];
  const float* widened = widened_rows(R, I, xb.data());
  dense_rows(R, 0, O, xb.data(), widened, v.data(), scale.data(), I, O, y.data());
  check("int8", R, I, O, x, w, s, y);
  // Values times power-of-two scales are exact in bfloat16: identity rows give them back.
  for (int64_t k = 0; k < O * I; k += kStep) {
    store_scaled(v.data() + k, scale[k / I], converted.data() + k);
  }
  for (int64_t i = 0; i < O * I; ++i) wc[i] = from_bfloat16(converted[i]);
  std::vector<double> eye(I * I, 0.0);
  for (int64_t k = 0; k < I; ++k) eye[k * I + k] = 1.0;
  std::vector<float> values(I * O);
  for (int64_t k = 0; k < I; ++k) {
    for (int64_t o = 0; o < O; ++o) values[k * O + o] = float(wc[o * I + k]);
  }
  check("int8 to bfloat16", I, I, O, eye, w, s, values);
}
#endif

}  // namespace

int main() {
  for (int64_t R : {1, 2, 3, 4, 5, 8, 9, 13, 64}) {
    for (int64_t I : {32, 96, 576}) {
#if defined(JVLLM_DRIVE_INT8)
      check_int8(R, I, 12);
#else
      check_dense(R, I, 12);
#endif
    }
  }
  std::printf("%d passed, %d failed\n", num_passed, num_failed);
  return num_failed == 0 ? 0 : 1;
}
