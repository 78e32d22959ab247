// Storage types of the CPU kernels and their conversion to the float32 they compute in.
// (The KV cache's own storage types, which include 8-bit floats, are further down.)
//
// Every kernel is a template over its storage type: float (float32) or c10::BFloat16
// (bfloat16: the top 16 bits of a float32). Loads widen to float32, all arithmetic and
// accumulation is float32, and stores round back once, to nearest-even, with NaN kept
// NaN (what torch's .to(torch.bfloat16) does). The integer rounding used here gives the
// same bits on every x86 CPU, with or without AVX512-BF16. (The kernels that multiply bf16
// pairs with VDPBF16PS or AMX tiles, where the CPU has them, are the exception: their
// sums run in another order, so their bits are the same on every CPU of one kind, and
// batch-invariant there, but not across kinds.)
//
// Reductions in the kernels never rely on the compiler's vectoriser (which may peel a
// loop differently for differently aligned pointers): they accumulate in explicit 8-lane
// vectors from index 0 and fold in a fixed tree, so a row's result depends only on the
// row's own values, never on the batch it came in (batch invariance).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

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

// ---- KV-cache storage types ----------------------------------------------------------
// The paged KV cache may be stored in a narrower type than the model computes in: float32,
// bfloat16, or 8-bit floating point (OCP 8-bit Floating Point Specification (OFP8), rev.
// 1.0, 2023: E4M3 with no infinities and one NaN pattern per sign, as torch.float8_e4m3fn;
// E5M2 with IEEE infinities and NaNs, as torch.float8_e5m2).
using fp8e4m3 = c10::Float8_e4m3fn;
using fp8e5m2 = c10::Float8_e5m2;

// Storing: float32 -> cache type, one rounding to nearest even, finite values beyond the
// format's largest finite value (and infinities) saturated to it, NaN -> NaN (0x7f with
// the input's sign, as torch). Float32 subnormals round to zero (both fp8 formats' least
// subnormal is far above them). Integer arithmetic only, so -ffast-math cannot change it.
template <int MAN, int BIAS, uint8_t MAXCODE>
inline uint8_t fp8_from_f32(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;                     // NaN
  // the largest finite value's float32 bits: its exponent and mantissa, re-biased
  constexpr uint32_t kMaxBits = ((static_cast<uint32_t>(MAXCODE >> MAN) + 127 - BIAS) << 23) |
                                (static_cast<uint32_t>(MAXCODE & ((1 << MAN) - 1)) << (23 - MAN));
  if (a >= kMaxBits) return sign | MAXCODE;                    // saturate (also +-inf)
  const int32_t e = static_cast<int32_t>(a >> 23);             // biased float32 exponent
  if (e == 0) return sign;                                     // float32 zero or subnormal
  constexpr int32_t kMinNormalE = 127 - BIAS + 1;              // float32 exponent of 2^(1-BIAS)
  if (e >= kMinNormalE) {
    // normal in the target: drop 23-MAN mantissa bits, round half to even; a carry moves
    // into the exponent, and the result stays <= MAXCODE because a < kMaxBits
    constexpr uint32_t kDrop = 23 - MAN;
    const uint32_t r = a + ((1u << (kDrop - 1)) - 1) + ((a >> kDrop) & 1u);
    return sign | static_cast<uint8_t>((r >> kDrop) - (static_cast<uint32_t>(127 - BIAS) << MAN));
  }
  // subnormal in the target, in units of its least subnormal 2^(1-BIAS-MAN): the value is
  // m * 2^(e-150) (m: the 24-bit significand) = m * 2^-s units, rounded half to even
  const uint64_t m = (a & 0x7fffffu) | 0x800000u;
  const int32_t s = kMinNormalE - e + 23 - MAN;                // >= 24 - MAN
  if (s > 40) return sign;                                     // below half the least subnormal
  const uint64_t r = (m + ((uint64_t{1} << (s - 1)) - 1) + ((m >> s) & 1u)) >> s;
  return sign | static_cast<uint8_t>(r);                       // r == 1 << MAN: least normal
}

template <typename T> inline T cache_from_f32(float x);
template <> inline float cache_from_f32<float>(float x) { return x; }
template <> inline bf16 cache_from_f32<bf16>(float x) { return from_f32<bf16>(x); }
template <> inline fp8e4m3 cache_from_f32<fp8e4m3>(float x) {
  return fp8e4m3(fp8_from_f32<3, 7, 0x7e>(x), fp8e4m3::from_bits());
}
template <> inline fp8e5m2 cache_from_f32<fp8e5m2>(float x) {
  return fp8e5m2(fp8_from_f32<2, 15, 0x7b>(x), fp8e5m2::from_bits());
}

// Reading: a cache element as a float32 "raw" value, exactly; the element's value is
// raw * kRawScale<T>, and the kernels fold kRawScale into their scales. Both fp8 formats
// widen through IEEE half precision, exactly (subnormals included): an E5M2 byte is the
// high byte of the half with the same value; an E4M3 byte b, placed as half bits
// sign << 15 | (b & 0x7f) << 7, is a half of value 2^-8 times b's (the exponent fields
// line up, the biases differ by 8: 15 vs 7; subnormals scale alike). E4M3's NaN (0x7f)
// would read as 480: the writers never store it for a finite input.
template <typename T> constexpr float kRawScale = 1.f;
template <> constexpr float kRawScale<fp8e4m3> = 256.f;

// IEEE half bits -> float32, exactly (portable; F16C's vcvtph2ps gives the same).
inline float half_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0) {
    const float v = static_cast<float>(m) * 0x1p-24f;          // subnormal (or zero): exact
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (m << 13);
  } else {
    bits = sign | ((e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t e4m3_half_bits(uint8_t b) {
  return static_cast<uint16_t>((static_cast<uint16_t>(b & 0x80u) << 8) | (static_cast<uint16_t>(b & 0x7fu) << 7));
}

inline float raw_f32(float x) { return x; }
inline float raw_f32(bf16 x) { return to_f32(x); }
inline float raw_f32(fp8e5m2 x) { return half_bits_to_f32(static_cast<uint16_t>(x.x << 8)); }
inline float raw_f32(fp8e4m3 x) { return half_bits_to_f32(e4m3_half_bits(x.x)); }

// 8 consecutive cache elements as raw float32 values (unaligned).
template <typename T>
inline v8 load8_raw(const T* p) {
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = raw_f32(p[i]);
  return v;
}

// x > 0 and finite, decided on the bits (-ffast-math assumes no NaN or infinity, so
// std::isfinite and comparisons cannot be trusted to see them).
inline bool positive_finite(double x) {
  uint64_t bits;
  std::memcpy(&bits, &x, 8);
  return (bits >> 63) == 0 && ((bits >> 52) & 0x7ff) != 0x7ff && bits != 0;
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
inline __m256 load8_raw_avx(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_raw_avx(const bf16* p) { return load8_avx(p); }
#ifdef __F16C__
// The fp8 widenings of raw_f32, 8 lanes at once (F16C's vcvtph2ps is exact for halves).
inline __m256 load8_raw_avx(const fp8e5m2* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));   // b << 8 per 16-bit lane
}
inline __m256 load8_raw_avx(const fp8e4m3* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  // sign-extended to 16 bits and shifted left by 7: sign at bits 15 and 14, the rest at
  // 13..7; clearing bit 14 leaves e4m3_half_bits(b)
  const __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(b), 7);
  return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0xbf80))));
}
#define PAGEDLLM_FP8_AVX 1
#endif
// The int8 W8A8 method's dequantizing epilogue on 8 float32 sums (layers/quantization/
// int8.py, epilogue_ref): (((acc - comp) * ws) * s) (+ bias), one IEEE operation at a time,
// the asm barriers keeping -ffast-math from fusing a multiply and an add into an FMA, so
// that every kernel computing it (quant_act.cpp's int8_epilogue, int8_linear_avx2.cpp)
// gives the torch reference's bits. comp, ws, bias: the 8 columns' values (bias may be null).
inline __m256 w8a8_epilogue8(__m256 acc, const float* comp, const float* ws, __m256 s, const float* bias) {
  __m256 v = _mm256_sub_ps(acc, _mm256_loadu_ps(comp));
  asm volatile("" : "+x"(v));
  v = _mm256_mul_ps(v, _mm256_loadu_ps(ws));
  asm volatile("" : "+x"(v));
  v = _mm256_mul_ps(v, s);
  if (bias) {
    asm volatile("" : "+x"(v));
    v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
  }
  return v;
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

#ifdef __AVX512F__
// from_f32<bf16>'s rounding in 16 lanes (nearest-even; NaN -> 0x7fc0): the integer
// rounding, not VCVTNEPS2BF16, which flushes subnormals. Each lane's bf16 is its top 16
// bits; the low 16 are left over from the rounding add (the two callers below drop them).
inline __m512i round_bf16_high16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                              _mm512_set1_epi32(0x7f800000), _MM_CMPINT_NLE);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}
// 16 float32 -> 16 bf16, rounded as from_f32.
inline __m256i round_bf16x16(__m512 v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_high16(v), 16)); }
// 16 float32 into p[0, 16): as they are, or as bf16 rounded by round_bf16x16 (the 16-lane
// twin of store8_avx).
inline void store16_avx512(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16_avx512(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_bf16x16(v));
}

// w8a8_epilogue8 on 16 sums, the same operations lane for lane (so the same bits), with the
// 16 columns' comp, ws and bias already loaded (the caller loads them once for its rows).
inline __m512 w8a8_epilogue16(__m512 acc, __m512 comp, __m512 ws, __m512 s, const __m512* bias) {
  __m512 v = _mm512_sub_ps(acc, comp);
  asm volatile("" : "+v"(v));
  v = _mm512_mul_ps(v, ws);
  asm volatile("" : "+v"(v));
  v = _mm512_mul_ps(v, s);
  if (bias) {
    asm volatile("" : "+v"(v));
    v = _mm512_add_ps(v, *bias);
  }
  return v;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define PAGEDLLM_AVX512 1
// 16 storage elements widened exactly to float32 (as to_f32 and raw_f32; fp8 through the
// halves of F16C, which every AVX-512 CPU has): the widenings of the loads below.
inline __m512 widen16_avx512(__m256i h, const bf16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16_avx512(__m128i b, const fp8e5m2*) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));   // b << 8 per 16-bit lane
}
inline __m512 widen16_avx512(__m128i b, const fp8e4m3*) {
  // as load8_raw_avx: sign-extended, shifted left by 7, bit 14 cleared
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
  return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xbf80))));
}
// 16 consecutive elements as float32 (unaligned).
inline __m512 load16_avx512(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_avx512(const bf16* p) {
  return widen16_avx512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), p);
}
// 16 consecutive cache elements, as load8_raw_avx.
inline __m512 load16_raw_avx512(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_raw_avx512(const bf16* p) { return load16_avx512(p); }
template <typename T8>
inline __m512 load16_raw_avx512(const T8* p) {   // fp8e4m3, fp8e5m2
  return widen16_avx512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), p);
}
// 8 elements of row a in lanes 0-7 and 8 of row b in lanes 8-15, widened as load8_raw_avx:
// two 8-lane vectors side by side, so 8-lane arithmetic runs on two rows at once.
inline __m512 load8x2_raw_avx512(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
inline __m512 load8x2_raw_avx512(const bf16* a, const bf16* b) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return widen16_avx512(h, a);
}
template <typename T8>
inline __m512 load8x2_raw_avx512(const T8* a, const T8* b) {   // fp8e4m3, fp8e5m2
  return widen16_avx512(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))), a);
}
// v rounded to T and widened back to float32: to_f32(from_f32<T>(v)) in 16 lanes.
inline __m512 round_through_avx512(__m512 v, const float*) { return v; }
inline __m512 round_through_avx512(__m512 v, const bf16*) {
  return _mm512_castsi512_ps(_mm512_and_si512(round_bf16_high16(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
#endif

}  // namespace pagedllm
