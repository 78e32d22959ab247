// Paged decode attention for CPU, float32: one query token per request attends over
// all of the request's cached tokens, read in place through its block table (no gather
// copy). A work item is one request and a range of its kv heads: with many requests,
// all heads at once, so each token's K/V row (every kv head, contiguous) is streamed
// once from memory; with few requests, one kv head per item for parallelism.
// Per item: scores = q·k * scale, a max-subtracted softmax, then the probability-
// weighted sum of V rows.
//
// Two implementations of one item:
//  * attend_avx2 (x86 with AVX2+FMA, head_dim a multiple of 64):
//    q·k for 8 tokens (whole K rows, in order) per query head in 8 accumulators, folded into one vector of 8
//    scores with a horizontal-add tree; V accumulated in registers, 64 dims at a time
//    (software prefetch of the next block was tried and measured no gain).
//  * attend_generic (any head_dim or CPU): the same maths with GCC vector types.
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <math.h>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#endif

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

static inline float hsum8(v8 a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

struct Args {
  const float* q; const float* k; const float* v; float* out;
  const int32_t* bt; const int32_t* sl;
  int64_t nh, nkv, g, hd, mb, bs, k_slot, k_head, v_slot, v_head;
  float scale;
};

// Softmax numerators in place over s[0, L): s[i] = exp(s[i] - max); returns 1 / sum.
static inline float softmax_numerators(float* s, int64_t L) {
  float m = -INFINITY;
  for (int64_t i = 0; i < L; ++i) m = std::max(m, s[i]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < L; ++i) {
    s[i] = expf(s[i] - m);
    sum += s[i];
  }
  return 1.f / sum;
}

static void attend_generic(const Args& a, int64_t n, int64_t kh0, int64_t kh1,
                   std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t L = a.sl[n];
  const int64_t nheads = (kh1 - kh0) * a.g;  // query heads handled here
  const int64_t hd = a.hd;
  scores.resize(nheads * L);
  acc.assign(nheads * hd, 0.f);
  const int32_t* row = a.bt + n * a.mb;
  const float* qn = a.q + (n * a.nh + kh0 * a.g) * hd;
  auto slot_of = [&](int64_t t) {
    return static_cast<int64_t>(row[t / a.bs]) * a.bs + t % a.bs;
  };
  int64_t t = 0;
  if (hd % 8 == 0) {
    for (; t + 4 <= L; t += 4) {
      const float* kr[4];
      for (int u = 0; u < 4; ++u) kr[u] = a.k + slot_of(t + u) * a.k_slot;
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        const int64_t off = kh * a.k_head;
        for (int64_t j = 0; j < a.g; ++j) {
          const int64_t h = (kh - kh0) * a.g + j;
          const float* qj = qn + h * hd;
          v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
          for (int64_t d = 0; d < hd; d += 8) {
            const v8 qv = load8(qj + d);
            a0 += qv * load8(kr[0] + off + d);
            a1 += qv * load8(kr[1] + off + d);
            a2 += qv * load8(kr[2] + off + d);
            a3 += qv * load8(kr[3] + off + d);
          }
          float* s = scores.data() + h * L + t;
          s[0] = hsum8(a0) * a.scale;
          s[1] = hsum8(a1) * a.scale;
          s[2] = hsum8(a2) * a.scale;
          s[3] = hsum8(a3) * a.scale;
        }
      }
    }
  }
  for (; t < L; ++t) {
    const float* kr = a.k + slot_of(t) * a.k_slot;
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      for (int64_t j = 0; j < a.g; ++j) {
        const int64_t h = (kh - kh0) * a.g + j;
        const float* qj = qn + h * hd;
        const float* kk = kr + kh * a.k_head;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < hd; ++d) s += qj[d] * kk[d];
        scores[h * L + t] = s * a.scale;
      }
    }
  }
  std::vector<float> inv(nheads);
  for (int64_t h = 0; h < nheads; ++h) inv[h] = softmax_numerators(scores.data() + h * L, L);
  for (int64_t i = 0; i < L; ++i) {
    const float* vr = a.v + slot_of(i) * a.v_slot;
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      const float* vv = vr + kh * a.v_head;
      for (int64_t j = 0; j < a.g; ++j) {
        const int64_t h = (kh - kh0) * a.g + j;
        const float p = scores[h * L + i];
        float* ah = acc.data() + h * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) ah[d] += p * vv[d];
      }
    }
  }
  float* o = a.out + (n * a.nh + kh0 * a.g) * hd;
  for (int64_t h = 0; h < nheads; ++h)
    for (int64_t d = 0; d < hd; ++d) o[h * hd + d] = acc[h * hd + d] * inv[h];
}

#ifdef PAGEDLLM_AVX2
// Sum each of 8 vectors: returns {sum(x0), ..., sum(x7)}.
static inline __m256 fold8(__m256 x0, __m256 x1, __m256 x2, __m256 x3, __m256 x4, __m256 x5,
                           __m256 x6, __m256 x7) {
  const __m256 h01 = _mm256_hadd_ps(x0, x1), h23 = _mm256_hadd_ps(x2, x3);
  const __m256 h45 = _mm256_hadd_ps(x4, x5), h67 = _mm256_hadd_ps(x6, x7);
  // lanes: lo = {x0 x1 x2 x3 partials of 128-bit half 0}, hi = same for half 1
  const __m256 a = _mm256_hadd_ps(h01, h23);  // [s0l s1l s2l s3l | s0h s1h s2h s3h]
  const __m256 b = _mm256_hadd_ps(h45, h67);  // [s4l s5l s6l s7l | s4h s5h s6h s7h]
  const __m256 lo = _mm256_permute2f128_ps(a, b, 0x20);  // [s0l..s3l | s4l..s7l]
  const __m256 hi = _mm256_permute2f128_ps(a, b, 0x31);  // [s0h..s3h | s4h..s7h]
  return _mm256_add_ps(lo, hi);
}

static void attend_avx2(const Args& a, int64_t n, int64_t kh0, int64_t kh1,
                        std::vector<float>& scores, std::vector<int64_t>& slots) {
  const int64_t L = a.sl[n];
  const int64_t g = a.g, hd = a.hd, bs = a.bs;
  const int64_t nkh = kh1 - kh0, nheads = nkh * g;
  const int64_t Lp = (L + 7) / 8 * 8;  // score row stride: whole 8-token chunks
  scores.resize(nheads * Lp);
  // token -> slot, once per item (no division in the inner loops)
  slots.resize(L + 8);
  const int32_t* row = a.bt + n * a.mb;
  for (int64_t t = 0, b = 0; t < L; ++b)
    for (int64_t i = 0; i < bs && t < L; ++i, ++t) slots[t] = static_cast<int64_t>(row[b]) * bs + i;
  for (int64_t t = L; t < L + 8; ++t) slots[t] = slots[L - 1];  // pad: repeat the last token
  const float* kb = a.k + kh0 * a.k_head;   // K rows of this item's kv heads
  const float* vb = a.v + kh0 * a.v_head;
  const float* qn = a.q + (n * a.nh + kh0 * g) * hd;
  // ---- scores = q·k * scale, 8 tokens at a time; K rows read whole, in order ----
  for (int64_t t0 = 0; t0 < L; t0 += 8) {
    const float* kr[8];
    for (int64_t u = 0; u < 8; ++u) kr[u] = kb + slots[t0 + u] * a.k_slot;
    for (int64_t kh = 0; kh < nkh; ++kh) {
      const int64_t off = kh * a.k_head;
      for (int64_t j = 0; j < g; ++j) {
        const int64_t h = kh * g + j;
        const float* qj = qn + h * hd;
        __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0,
               c6 = c0, c7 = c0;
        for (int64_t d = off; d < off + hd; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qj + d - off);
          c0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[0] + d), c0);
          c1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[1] + d), c1);
          c2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[2] + d), c2);
          c3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[3] + d), c3);
          c4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[4] + d), c4);
          c5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[5] + d), c5);
          c6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[6] + d), c6);
          c7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[7] + d), c7);
        }
        const __m256 sc = _mm256_mul_ps(fold8(c0, c1, c2, c3, c4, c5, c6, c7),
                                        _mm256_set1_ps(a.scale));
        // rows are Lp long: a partial last chunk may store all 8 lanes
        _mm256_storeu_ps(scores.data() + h * Lp + t0, sc);
      }
    }
  }
  // ---- softmax per query head (max-subtracted), then out = sum_t p_t v_t / sum_t p_t ----
  for (int64_t h = 0; h < nheads; ++h) {
    float* s = scores.data() + h * Lp;
    const __m256 iv = _mm256_set1_ps(softmax_numerators(s, L));
    const float* vh = vb + (h / g) * a.v_head;
    float* o = a.out + (n * a.nh + kh0 * g + h) * hd;
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {
      __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, o4 = o0, o5 = o0,
             o6 = o0, o7 = o0;
      for (int64_t t = 0; t < L; ++t) {
        const float* vr = vh + slots[t] * a.v_slot + d0;
        const __m256 p = _mm256_broadcast_ss(s + t);
        o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr), o0);
        o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8), o1);
        o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 16), o2);
        o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 24), o3);
        o4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 32), o4);
        o5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 40), o5);
        o6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 48), o6);
        o7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 56), o7);
      }
      _mm256_storeu_ps(o + d0, _mm256_mul_ps(o0, iv));
      _mm256_storeu_ps(o + d0 + 8, _mm256_mul_ps(o1, iv));
      _mm256_storeu_ps(o + d0 + 16, _mm256_mul_ps(o2, iv));
      _mm256_storeu_ps(o + d0 + 24, _mm256_mul_ps(o3, iv));
      _mm256_storeu_ps(o + d0 + 32, _mm256_mul_ps(o4, iv));
      _mm256_storeu_ps(o + d0 + 40, _mm256_mul_ps(o5, iv));
      _mm256_storeu_ps(o + d0 + 48, _mm256_mul_ps(o6, iv));
      _mm256_storeu_ps(o + d0 + 56, _mm256_mul_ps(o7, iv));
    }
  }
}
#endif

static void attend(const Args& a, int64_t n, int64_t kh0, int64_t kh1,
                   std::vector<float>& scores, std::vector<float>& acc,
                   std::vector<int64_t>& slots) {
#ifdef PAGEDLLM_AVX2
  if (a.hd % 64 == 0) return attend_avx2(a, n, kh0, kh1, scores, slots);
#endif
  attend_generic(a, n, kh0, kh1, scores, acc);
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && key_cache.dtype() == torch::kFloat32 &&
              value_cache.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 3, "q [n, heads, dim], cache [slots, kv_heads, dim]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q/out must be contiguous");
  TORCH_CHECK(key_cache.stride(2) == 1 && value_cache.stride(2) == 1, "cache rows must be contiguous");
  TORCH_CHECK(block_table.dtype() == torch::kInt32 && block_table.is_contiguous(), "block_table int32");
  TORCH_CHECK(seq_lens.dtype() == torch::kInt32 && seq_lens.is_contiguous(), "seq_lens int32");
  Args a;
  const int64_t nd = q.size(0);
  a.nh = q.size(1); a.hd = q.size(2); a.nkv = key_cache.size(1);
  TORCH_CHECK(out.size(0) == nd && block_table.size(0) >= nd && seq_lens.size(0) >= nd,
              "batch sizes of q, out, block_table and seq_lens disagree");
  TORCH_CHECK(a.nh % a.nkv == 0, "num_heads must be a multiple of num_kv_heads");
  a.g = a.nh / a.nkv; a.mb = block_table.size(1); a.bs = block_size;
  a.k_slot = key_cache.stride(0); a.k_head = key_cache.stride(1);
  a.v_slot = value_cache.stride(0); a.v_head = value_cache.stride(1);
  a.q = q.data_ptr<float>(); a.k = key_cache.data_ptr<float>(); a.v = value_cache.data_ptr<float>();
  a.out = out.data_ptr<float>(); a.bt = block_table.data_ptr<int32_t>(); a.sl = seq_lens.data_ptr<int32_t>();
  a.scale = static_cast<float>(scale);
  const bool split_heads = nd < 2 * at::get_num_threads();
  const int64_t items = split_heads ? nd * a.nkv : nd;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    std::vector<int64_t> slots;
    for (int64_t w = begin; w < end; ++w) {
      if (split_heads) attend(a, w / a.nkv, w % a.nkv, w % a.nkv + 1, scores, acc, slots);
      else attend(a, w, 0, a.nkv, scores, acc, slots);
    }
  });
}
