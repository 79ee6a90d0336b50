// The decode attention kernel (jvllm/native/cpu_decode.cc) on random shuffled pages against a
// scalar reference, without Python or XLA: built for a CPU that is not at hand (ARM, by a cross
// compiler) and run under an emulator by tests/test_native_arm.py. Prints one line a case that
// fails, then "N passed, N failed".

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cpu_decode.cc"

namespace {

int num_passed = 0, num_failed = 0;
std::mt19937 rng(0);

float random_float() { return std::normal_distribution<float>(0.f, 1.f)(rng); }

float from_bfloat16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

void random_value(float& x, float& value) { value = x = random_float(); }

void random_value(uint16_t& x, float& value) {  // truncated: any bfloat16 value will do
  const float f = random_float();
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  x = static_cast<uint16_t>(bits >> 16);
  value = from_bfloat16(x);
}

// One token a sequence of each length, its G query heads a KV head of K attending to it in
// a cache of T rows of H (two planes, keys then values, or one read as both), pages of B rows
// shuffled: the kernel's max, sum and weighted values against the same in double.
template <typename T>
void check(const char* name, int64_t K, int64_t G, int64_t H, int64_t B, int64_t num_planes) {
  const std::vector<int64_t> lens = {1, 2, B, B + 1, 37, 100};
  const int64_t S = static_cast<int64_t>(lens.size()), N = K * G;
  int64_t max_pages = 0, num_pages = 1;  // page 0 unused
  for (int64_t n : lens) {
    max_pages = std::max(max_pages, (n + B - 1) / B);
    num_pages += (n + B - 1) / B;
  }
  std::vector<int32_t> free(num_pages - 1), tables(S * max_pages, 0), token(S), kv_lens(S);
  for (int64_t p = 0; p < num_pages - 1; ++p) free[p] = static_cast<int32_t>(p + 1);
  std::shuffle(free.begin(), free.end(), rng);
  for (int64_t s = 0, next = 0; s < S; ++s) {
    for (int64_t p = 0; p < (lens[s] + B - 1) / B; ++p) tables[s * max_pages + p] = free[next++];
    token[s] = static_cast<int32_t>(s), kv_lens[s] = static_cast<int32_t>(lens[s]);
  }
  const int64_t plane = K * num_pages * B * H;
  std::vector<T> cache(num_planes * plane);
  std::vector<float> values(cache.size()), q(S * N * H), m(S * N), l(S * N), out(S * N * H);
  for (size_t i = 0; i < cache.size(); ++i) random_value(cache[i], values[i]);
  for (float& x : q) x = random_float() / 4;
  const Shapes shapes{K, num_pages, B, H, G, max_pages};
  const int64_t v_at = (num_planes - 1) * plane;
  attend_tiles(0, S, q.data(), cache.data(), cache.data() + v_at, tables.data(), token.data(),
               token.data(), kv_lens.data(), shapes, m.data(), l.data(), out.data());

  for (int64_t s = 0; s < S; ++s) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t row = s * N + n, head = n / G * num_pages * B * H;  // its KV head's rows
      auto row_at = [&](int64_t pos) {
        return head + (tables[s * max_pages + pos / B] * B + pos % B) * H;
      };
      std::vector<double> score(lens[s]);
      for (int64_t pos = 0; pos < lens[s]; ++pos) {
        const int64_t at = row_at(pos);
        score[pos] = 0;
        for (int64_t h = 0; h < H; ++h) score[pos] += double(q[row * H + h]) * values[at + h];
      }
      const double want_m = *std::max_element(score.begin(), score.end());
      double want_l = 0;
      std::vector<double> want(H, 0.0);
      for (int64_t pos = 0; pos < lens[s]; ++pos) {
        const double p = std::exp(score[pos] - want_m);
        const int64_t at = v_at + row_at(pos);
        want_l += p;
        for (int64_t h = 0; h < H; ++h) want[h] += p * values[at + h];
      }
      bool ok = std::fabs(m[row] - want_m) <= 1e-4 && std::fabs(l[row] / want_l - 1) <= 1e-4;
      for (int64_t h = 0; h < H && ok; ++h) {
        ok = std::fabs(out[row * H + h] / l[row] - want[h] / want_l) <= 1e-4;
      }
      if (!ok) {
        std::printf("%s K=%ld G=%ld H=%ld B=%ld: sequence %ld of %ld rows, query head %ld\n", name,
                    long(K), long(G), long(H), long(B), long(s), long(lens[s]), long(n));
        ++num_failed;
        return;
      }
    }
  }
  ++num_passed;
}

}  // namespace

int main() {
  for (int64_t H : {64, 128, 40}) {    // 40: the path of any head size
    for (int64_t G : {1, 3, 7, 8}) {  // query heads a KV head: groups of 4 and what is left
      check<uint16_t>("bfloat16", 2, G, H, 16, 2);
      check<float>("float32", 2, G, H, 3, 2);
    }
  }
  check<uint16_t>("bfloat16, one plane", 1, 8, 64, 8, 1);  // MLA's latent: keys are values
  std::printf("%d passed, %d failed\n", num_passed, num_failed);
  return num_failed == 0 ? 0 : 1;
}
