// Dynamic per-token int8 activation quantization and the dequantizing epilogue of the
// W8A8 linear method (pagedllm/layers/quantization/int8.py), for float32 and bfloat16
// activations:
//  * quantize_per_token: each row x[m, :] (first multiplied by SmoothQuant's smoothing
//    row and rounded to x's dtype, where one is given) gets its own symmetric scale
//      s_m = amax_m / qmax,   inv_m = qmax / amax_m (0 when that is not finite),
//      q = clamp(round_half_even(x * inv_m), -qmax, qmax),   stored as uint8 q + zero_point,
//    the input oneDNN's u8 x s8 matmul takes (a fixed offset, activation scale 1);
//  * int8_epilogue: out[m, n] = (((acc[m, n] - comp[n]) * w_scale[n]) * s_m) (+ bias[n])
//    in float32, then rounded to the output dtype; acc is the matmul's integer sums of the
//    uint8 activations as float32, comp[n] = zero_point * sum_k Wq[n, k].
// Every value is computed by one IEEE operation at a time in a fixed order, so the torch
// reference (int8.py: quantize_per_token_ref, epilogue_ref) gives the same bits: empty asm
// barriers keep the compiler (-ffast-math) from fusing operations, e.g. a multiply and an
// add into an FMA, which torch rounds separately. Rows are independent and
// each is computed alone, so a row's result never depends on the batch (batch invariance).
//
// Non-finite inputs: a row with an inf or NaN gets a non-finite scale (so its output
// row is non-finite too, not silently zero); its uint8 values are unspecified.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

using pagedllm::bf16;
using pagedllm::from_f32;
using pagedllm::to_f32;

namespace {

// Elements per thread at least: the kernels stream 2-4 elements a nanosecond on one core
// (measured, AVX2), so smaller batches (e.g. 64 rows x 576) stay on the calling thread
// rather than pay a fork/join, which costs far more when the cores are shared.
constexpr int64_t kGrainElements = 65536;

// Keeps the compiler from fusing the arithmetic before and after it (e.g. into an FMA):
// the value must sit in a register here.
template <typename V>
inline void opaque(V& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("" : "+v"(v));
#elif defined(__aarch64__)
  asm volatile("" : "+w"(v));
#else
  volatile V t = v;
  v = t;
#endif
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Finite by its bits: the build's -ffast-math lets the compiler assume std::isfinite.
inline bool finite_bits(float f) { return (bits_of(f) & 0x7f800000u) != 0x7f800000u; }

// max |x[i]| of a row, found on the bit patterns: with the sign bit cleared, IEEE floats
// order as integers, and NaN patterns lie above inf, so a NaN anywhere gives a NaN
// (max on floats would drop it). An integer max is exact in any order.
template <typename T>
float row_absmax(const T* x, int64_t k) {
  int64_t i = 0;
  uint32_t m = 0;
#ifdef PAGEDLLM_AVX512
  {
    const __m512i mask = _mm512_set1_epi32(0x7fffffff);
    __m512i acc = _mm512_setzero_si512();
    for (; i + 16 <= k; i += 16)
      acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_castps_si512(pagedllm::load16_avx512(x + i)), mask));
    m = _mm512_reduce_max_epu32(acc);
  }
#endif
#ifdef PAGEDLLM_AVX2
  const __m256i mask = _mm256_set1_epi32(0x7fffffff);
  __m256i acc = _mm256_setzero_si256();
  for (; i + 8 <= k; i += 8)
    acc = _mm256_max_epi32(acc, _mm256_and_si256(_mm256_castps_si256(pagedllm::load8_avx(x + i)), mask));
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  for (uint32_t v : lanes) m = std::max(m, v);
#endif
  for (; i < k; ++i) m = std::max(m, bits_of(to_f32(x[i])) & 0x7fffffffu);
  return float_of(m);
}

// One row: amax, scale and the quantized values of xr[0, k).
template <typename T>
void quantize_row(uint8_t* o, float* scale, const T* xr, int64_t k, float qmax, float zp) {
  float amax = row_absmax(xr, k);
  // qm hidden from the optimizer so that -ffast-math cannot replace the divisions by
  // multiplications with a hoisted reciprocal (torch divides)
  float qm = qmax;
  opaque(qm);
  opaque(amax);
  float inv = qm / amax;   // inf for a zero row, 0 or NaN for a non-finite one
  opaque(inv);
  if (!finite_bits(inv)) inv = 0.f;
  *scale = amax / qm;
  int64_t i = 0;
#ifdef PAGEDLLM_AVX512
  {
    // as the 8-lane loop below: same operations in the same order, and values already in
    // [zp - qmax, zp + qmax], so the saturating narrowing changes none
    const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
    const __m512 vzp = _mm512_set1_ps(zp);
    for (; i + 16 <= k; i += 16) {
      __m512 p = _mm512_mul_ps(pagedllm::load16_avx512(xr + i), vinv);
      opaque(p);
      p = _mm512_roundscale_ps(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      p = _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(p, lo), hi), vzp);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), _mm512_cvtusepi32_epi8(_mm512_cvttps_epi32(p)));
    }
  }
#endif
#ifdef PAGEDLLM_AVX2
  const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
  const __m256 vzp = _mm256_set1_ps(zp);
  for (; i + 8 <= k; i += 8) {
    __m256 p = _mm256_mul_ps(pagedllm::load8_avx(xr + i), vinv);
    opaque(p);
    p = _mm256_round_ps(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    p = _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(p, lo), hi), vzp);   // exact: small integers
    const __m256i q32 = _mm256_cvttps_epi32(p);
    const __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(o + i), _mm_packus_epi16(q16, q16));
  }
#endif
  for (; i < k; ++i) {
    float p = to_f32(xr[i]) * inv;
    opaque(p);
    p = std::nearbyint(p);   // the default rounding mode: to nearest, ties to even
    p = p > -qmax ? p : -qmax;   // as max_ps/min_ps above (a NaN becomes -qmax)
    p = (p < qmax ? p : qmax) + zp;
    o[i] = static_cast<uint8_t>(static_cast<int>(p));
  }
}

// smooth (or nullptr): each row is first multiplied by smooth[0, k) elementwise and rounded
// to T, as torch's x * smooth in T does (one float32 product, rounded once), into a
// float32 scratch row that is then quantized.
template <typename T>
void quantize_rows(uint8_t* out, float* scales, const T* x, int64_t rows, int64_t k, int64_t xs,
                   float qmax, float zp, const T* smooth) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(k, 1));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    std::vector<float> buf(smooth ? k : 0);
    for (int64_t m = b; m < e; ++m) {
      const T* xr = x + m * xs;
      if (!smooth) {
        quantize_row(out + m * k, scales + m, xr, k, qmax, zp);
        continue;
      }
      int64_t i = 0;
#ifdef PAGEDLLM_AVX512
      for (; i + 16 <= k; i += 16) {
        __m512 p = _mm512_mul_ps(pagedllm::load16_avx512(xr + i), pagedllm::load16_avx512(smooth + i));
        opaque(p);
        _mm512_storeu_ps(buf.data() + i, pagedllm::round_through_avx512(p, xr));
      }
#endif
#ifdef PAGEDLLM_AVX2
      // 8 lanes at once (the scalar loop below took ~6 % of an int8 run's step time):
      // the same product, rounded to T by store8_avx as from_f32 rounds it
      for (; i + 8 <= k; i += 8) {
        __m256 p = _mm256_mul_ps(pagedllm::load8_avx(xr + i), pagedllm::load8_avx(smooth + i));
        opaque(p);
        T t[8];
        pagedllm::store8_avx(t, p);
        _mm256_storeu_ps(buf.data() + i, pagedllm::load8_avx(t));
      }
#endif
      for (; i < k; ++i) {
        float p = to_f32(xr[i]) * to_f32(smooth[i]);
        opaque(p);
        buf[i] = to_f32(from_f32<T>(p));
      }
      quantize_row(out + m * k, scales + m, buf.data(), k, qmax, zp);
    }
  });
}

template <typename T>
void epilogue_rows(T* out, const float* acc, const float* comp, const float* ws, const float* rs,
                   const float* bias, int64_t rows, int64_t n) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float* a = acc + m * n;
      T* o = out + m * n;
      const float s = rs[m];
      int64_t i = 0;
#ifdef PAGEDLLM_AVX2
      const __m256 vs = _mm256_set1_ps(s);
      for (; i + 8 <= n; i += 8)
        pagedllm::store8_avx(o + i, pagedllm::w8a8_epilogue8(_mm256_loadu_ps(a + i), comp + i, ws + i, vs,
                                                            bias ? bias + i : nullptr));
#endif
      for (; i < n; ++i) {
        float v = a[i] - comp[i];
        opaque(v);
        v = v * ws[i];
        opaque(v);
        v = v * s;
        if (bias) {
          opaque(v);
          v = v + bias[i];
        }
        o[i] = from_f32<T>(v);
      }
    }
  });
}

}  // namespace

void quantize_per_token(at::Tensor out, at::Tensor scales, at::Tensor x, int64_t qmax,
                        int64_t zero_point, c10::optional<at::Tensor> smooth) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == M && out.size(1) == K, "out must be contiguous uint8 [M, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 1 &&
                  scales.size(0) == M, "scales must be contiguous float32 [M]");
  TORCH_CHECK(qmax >= 1 && qmax <= 127 && zero_point - qmax >= 0 && zero_point + qmax <= 255,
              "need 1 <= qmax <= 127 and qmax <= zero_point <= 255 - qmax");
  if (smooth.has_value())
    TORCH_CHECK(smooth->scalar_type() == x.scalar_type() && smooth->is_contiguous() && smooth->numel() == K,
                "smooth must be contiguous [K] in x's dtype");
  const float q = static_cast<float>(qmax), zp = static_cast<float>(zero_point);
  if (x.scalar_type() == at::kFloat)
    quantize_rows(out.data_ptr<uint8_t>(), scales.data_ptr<float>(), x.data_ptr<float>(), M, K, x.stride(0), q, zp,
                  smooth.has_value() ? smooth->data_ptr<float>() : nullptr);
  else
    quantize_rows(out.data_ptr<uint8_t>(), scales.data_ptr<float>(), x.data_ptr<bf16>(), M, K, x.stride(0), q, zp,
                  smooth.has_value() ? smooth->data_ptr<bf16>() : nullptr);
}

void int8_epilogue(at::Tensor out, at::Tensor acc, at::Tensor compensation,
                   at::Tensor weight_scales, at::Tensor row_scales,
                   c10::optional<at::Tensor> bias) {
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kFloat && acc.dim() == 2 &&
                  acc.is_contiguous(), "acc must be a contiguous float32 CPU tensor [M, N]");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) &&
                  out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == N,
              "out must be contiguous float32 or bfloat16 [M, N]");
  TORCH_CHECK(compensation.scalar_type() == at::kFloat && compensation.is_contiguous() &&
                  compensation.numel() == N, "compensation must be contiguous float32 [N]");
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.is_contiguous() &&
                  weight_scales.numel() == N, "weight_scales must be contiguous float32 [N]");
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.is_contiguous() &&
                  row_scales.numel() == M, "row_scales must be contiguous float32 [M]");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  const float* a = acc.data_ptr<float>();
  const float* c = compensation.data_ptr<float>();
  const float* ws = weight_scales.data_ptr<float>();
  const float* rs = row_scales.data_ptr<float>();
  if (out.scalar_type() == at::kFloat)
    epilogue_rows(out.data_ptr<float>(), a, c, ws, rs, b, M, N);
  else
    epilogue_rows(out.data_ptr<bf16>(), a, c, ws, rs, b, M, N);
}
