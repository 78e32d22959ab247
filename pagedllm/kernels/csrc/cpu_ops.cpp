// Elementwise CPU kernels of the model path, each one pass over memory where the torch
// composition makes several (vLLM's csrc/cpu has the same set), for float32 and bfloat16
// storage with float32 arithmetic (vec.h):
//  * reshape_and_cache: copy each token's K and V rows into the paged cache at its slot
//    (torch's index_copy_ runs this serially, ~3 ms for 2048 tokens a layer), or, for a
//    cache in another type (--kv-cache-dtype), store value / scale converted to it (vec.h:
//    cache_from_f32; OCP OFP8 for the fp8 formats);
//  * silu_and_mul: SiLU(gate) * up for the fused gate|up projection output;
//  * fused_add_rms_norm: residual += x, then x = RMSNorm(residual) * weight;
//  * rotary_embedding: rotate-half RoPE (Su et al. 2021, RoFormer) in place on q and k,
//    with float32 cos/sin tables.
// Rows are split across threads with at::parallel_for; every row is computed alone, in a
// fixed order, so its result never depends on the other rows (batch invariance).
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#ifdef __SSE__
#include <immintrin.h>
#endif

using pagedllm::bf16;
using pagedllm::from_f32;
using pagedllm::to_f32;

static void check_model_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor");
}

static void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, " must have the same dtype");
}

// x / d rounded correctly, as torch divides. -ffast-math lets GCC compute a division in
// other ways (a vectorised float division becomes a reciprocal estimate refined by one
// Newton step; a divisor shared by several divisions, a reciprocal multiplied in), which
// differ in the last bit and can move a value across an fp8 rounding boundary. On x86
// the SSE divide builtin is used, which the compiler does not rewrite.
static inline float div_exact(float x, float d) {
#ifdef __SSE__
  return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(x), _mm_set_ss(d)));
#else
  asm volatile("" : "+m"(d));   // a new divisor at every call: no shared reciprocal
  return x / d;
#endif
}

// One token's K or V row (n elements) into its cache slot: value / scale, converted to the
// cache type by cache_from_f32 (vec.h: one rounding to nearest even, fp8 saturating).
template <typename TI, typename TC>
static inline void store_row(TC* dst, const TI* src, int64_t n, float scale) {
  if (scale == 1.f) {
    for (int64_t j = 0; j < n; ++j) dst[j] = pagedllm::cache_from_f32<TC>(to_f32(src[j]));
    return;
  }
  for (int64_t j = 0; j < n; ++j) dst[j] = pagedllm::cache_from_f32<TC>(div_exact(to_f32(src[j]), scale));
}

template <typename TI, typename TC>
static void store_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, double scale) {
  const int64_t T = x.size(0), row = x.size(1) * x.size(2);
  const TI* src = x.data_ptr<TI>();
  TC* dst = cache.data_ptr<TC>();
  const int64_t xs = x.stride(0), cs = cache.stride(0);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) store_row(dst + slots[i] * cs, src + i * xs, row, sc);
  });
}

template <typename TI>
static void store_rows_to(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, double scale) {
  switch (cache.scalar_type()) {
    case at::kFloat: return store_rows<TI, float>(x, cache, slots, scale);
    case at::kBFloat16: return store_rows<TI, bf16>(x, cache, slots, scale);
    case at::kFloat8_e4m3fn: return store_rows<TI, pagedllm::fp8e4m3>(x, cache, slots, scale);
    case at::kFloat8_e5m2: return store_rows<TI, pagedllm::fp8e5m2>(x, cache, slots, scale);
    default: TORCH_CHECK(false, "the caches must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
  }
}

void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                       at::Tensor value_cache, at::Tensor slot_mapping, double k_scale,
                       double v_scale) {
  check_model_dtype(key, "key");
  check_same_dtype(key, value, "key and value");
  check_same_dtype(key_cache, value_cache, "key_cache and value_cache");
  TORCH_CHECK(pagedllm::positive_finite(k_scale) && pagedllm::positive_finite(v_scale),
              "k_scale and v_scale must be finite and > 0");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key_cache.dim() == 3 && value_cache.dim() == 3,
              "key/value [T, kv_heads, head_dim], caches [slots, kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  const int64_t T = key.size(0), nkv = key.size(1), hd = key.size(2);
  const int64_t row = nkv * hd;
  TORCH_CHECK(value.size(0) == T && slot_mapping.size(0) == T, "token counts disagree");
  TORCH_CHECK(value.size(1) == nkv && value.size(2) == hd && key_cache.size(1) == nkv &&
              key_cache.size(2) == hd && value_cache.size(1) == nkv && value_cache.size(2) == hd,
              "head shapes disagree");
  for (const auto* t : {&key, &value, &key_cache, &value_cache})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == hd, "each token's K/V row must be contiguous");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t nslots = key_cache.size(0);
  TORCH_CHECK(value_cache.size(0) == nslots, "the K and V caches must have the same number of slots");
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < nslots, "slot ", slots[i], " out of range");
  if (key.scalar_type() == key_cache.scalar_type() && k_scale == 1.0 && v_scale == 1.0) {
    // the cache in the model's dtype: a copy
    const int64_t es = key.element_size();
    const char* k = static_cast<const char*>(key.data_ptr());
    const char* v = static_cast<const char*>(value.data_ptr());
    char* kc = static_cast<char*>(key_cache.data_ptr());
    char* vc = static_cast<char*>(value_cache.data_ptr());
    const int64_t ks = key.stride(0) * es, vs = value.stride(0) * es;
    const int64_t kcs = key_cache.stride(0) * es, vcs = value_cache.stride(0) * es;
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        std::memcpy(kc + slots[i] * kcs, k + i * ks, row * es);
        std::memcpy(vc + slots[i] * vcs, v + i * vs, row * es);
      }
    });
    return;
  }
  if (key.scalar_type() == at::kFloat) {
    store_rows_to<float>(key, key_cache, slots, k_scale);
    store_rows_to<float>(value, value_cache, slots, v_scale);
  } else {
    store_rows_to<bf16>(key, key_cache, slots, k_scale);
    store_rows_to<bf16>(value, value_cache, slots, v_scale);
  }
}

template <typename T>
static void silu_and_mul_impl(T* op, const T* xp, int64_t rows, int64_t d, int64_t xs) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* g = xp + t * xs;
      const T* u = g + d;
      T* o = op + t * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float gf = to_f32(g[i]);
        o[i] = from_f32<T>(gf / (1.f + expf(-gf)) * to_f32(u[i]));
      }
    }
  });
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_model_dtype(x, "x");
  check_same_dtype(out, x, "out and x");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.is_contiguous(),
              "x [T, 2d] with contiguous rows, out [T, d] contiguous");
  const int64_t T = x.size(0), d = out.size(1);
  TORCH_CHECK(out.size(0) == T && x.size(1) == 2 * d, "out must be [T, d] for x [T, 2d]");
  if (x.scalar_type() == at::kFloat)
    silu_and_mul_impl(out.data_ptr<float>(), x.data_ptr<float>(), T, d, x.stride(0));
  else
    silu_and_mul_impl(out.data_ptr<bf16>(), x.data_ptr<bf16>(), T, d, x.stride(0));
}

template <typename T, typename R>
static void fused_add_rms_norm_impl(T* xp, R* rp, const T* w, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      T* xr = xp + t * h;
      R* rr = rp + t * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) rr[i] = from_f32<R>(to_f32(rr[i]) + to_f32(xr[i]));
      const float ss = pagedllm::sum_squares(rr, h);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) xr[i] = from_f32<T>((to_f32(rr[i]) * inv) * to_f32(w[i]));
    }
  });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_model_dtype(x, "x");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() || residual.scalar_type() == at::kFloat,
              "residual must be in x's dtype or float32");
  check_same_dtype(x, weight, "x and weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
              residual.sizes() == x.sizes() && weight.is_contiguous() && weight.size(0) == x.size(1),
              "x and residual contiguous [T, hidden], weight [hidden]");
  const int64_t T = x.size(0), h = x.size(1);
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat)
    fused_add_rms_norm_impl(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
                            T, h, feps);
  else if (residual.scalar_type() == at::kFloat)
    fused_add_rms_norm_impl(x.data_ptr<bf16>(), residual.data_ptr<float>(), weight.data_ptr<bf16>(),
                            T, h, feps);
  else
    fused_add_rms_norm_impl(x.data_ptr<bf16>(), residual.data_ptr<bf16>(), weight.data_ptr<bf16>(),
                            T, h, feps);
}

template <typename T>
static void rotary_impl(T* xp, const float* cp, const float* sp, int64_t rows, int64_t H,
                        int64_t half, int64_t s0, int64_t s1) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t hh = 0; hh < H; ++hh) {
        T* x1 = xp + t * s0 + hh * s1;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_f32(x1[i]), bb = to_f32(x2[i]);
          x1[i] = from_f32<T>(a * c[i] - bb * s[i]);
          x2[i] = from_f32<T>(bb * c[i] + a * s[i]);
        }
      }
    }
  });
}

void rotary_embedding(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_model_dtype(x, "x");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos and sin must be float32");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x [T, heads, head_dim] with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T &&
              cos.size(1) == half && sin.sizes() == cos.sizes(), "cos/sin [T, head_dim/2] contiguous");
  if (x.scalar_type() == at::kFloat)
    rotary_impl(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), T, H, half,
                x.stride(0), x.stride(1));
  else
    rotary_impl(x.data_ptr<bf16>(), cos.data_ptr<float>(), sin.data_ptr<float>(), T, H, half,
                x.stride(0), x.stride(1));
}
