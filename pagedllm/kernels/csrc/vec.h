// Storage types of the CPU kernels and their conversion to the float32 they compute in.
//
// Every kernel is a template over its storage type: float (float32) or c10::BFloat16
// (bfloat16: the top 16 bits of a float32). Loads widen to float32, all arithmetic and
// accumulation is float32, and stores round back once, to nearest-even, with NaN kept
// NaN (what torch's .to(torch.bfloat16) does). The integer rounding used here gives the
// same bits on every x86 CPU, with or without AVX512-BF16, so results never depend on
// which CPU of the project's two kinds computed them.
//
// Reductions in the kernels never rely on the compiler's vectoriser (which may peel a
// loop differently for differently aligned pointers): they accumulate in explicit 8-lane
// vectors from index 0 and fold in a fixed tree, so a row's result depends only on the
// row's own values, never on the batch it came in (batch invariance).
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#endif

namespace pagedllm {

using bf16 = c10::BFloat16;

typedef float v8 __attribute__((vector_size(32)));

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float32 -> storage type, round to nearest even (NaN stays a quiet NaN).
template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bf16 out;
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    out.x = 0x7fc0;
  } else {
    out.x = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
  return out;
}

// 8 consecutive elements as a float32 vector (unaligned).
inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v8 load8(const bf16* p) {
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = to_f32(p[i]);
  return v;
}

// Fixed-order sum of 8 lanes.
inline float hsum8(v8 a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// Sum of squares of x[0, n) in float32: 8-lane partial sums over whole chunks of 8 from
// index 0, folded by hsum8, then the tail in order.
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 v = load8(x + i);
    acc += v * v;
  }
  float s = hsum8(acc);
  for (; i < n; ++i) {
    const float f = to_f32(x[i]);
    s += f * f;
  }
  return s;
}

// Fixed-order sum of x[0, n) (float32).
inline float sum_f32(const float* x, int64_t n) {
  v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += load8(x + i);
  float s = hsum8(acc);
  for (; i < n; ++i) s += x[i];
  return s;
}

#ifdef PAGEDLLM_AVX2
inline __m256 load8_avx(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_avx(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store8_avx(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8_avx(bf16* p, __m256 v) {
  // the same rounding as from_f32<bf16>, 8 lanes at once
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // 32-bit lanes -> 16-bit: packus works per 128-bit half, so fix the order after
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

}  // namespace pagedllm
