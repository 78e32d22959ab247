// Elementwise CPU kernels for the float32 model path, each one pass over memory where
// the torch composition makes several (vLLM's csrc/cpu has the same set):
//  * reshape_and_cache: copy each token's K and V rows into the paged cache at its slot
//    (torch's index_copy_ runs this serially, ~3 ms for 2048 tokens a layer);
//  * silu_and_mul: SiLU(gate) * up for the fused gate|up projection output;
//  * fused_add_rms_norm: residual += x, then x = RMSNorm(residual) * weight;
//  * rotary_embedding: rotate-half RoPE (Su et al. 2021, RoFormer) in place on q and k.
// Rows are split across threads with at::parallel_for; inner loops are vectorised by
// the compiler (-O3 -march=native -ffast-math; expf from libmvec).
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

static void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor");
}

void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping) {
  check_f32(key, "key"); check_f32(value, "value");
  check_f32(key_cache, "key_cache"); check_f32(value_cache, "value_cache");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key_cache.dim() == 3 && value_cache.dim() == 3,
              "key/value [T, kv_heads, head_dim], caches [slots, kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(),
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
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < nslots, "slot ", slots[i], " out of range");
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  const int64_t kcs = key_cache.stride(0), vcs = value_cache.stride(0);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      std::memcpy(kc + slots[i] * kcs, k + i * ks, row * sizeof(float));
      std::memcpy(vc + slots[i] * vcs, v + i * vs, row * sizeof(float));
    }
  });
}

void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  check_f32(out, "out"); check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.is_contiguous(),
              "x [T, 2d] with contiguous rows, out [T, d] contiguous");
  const int64_t T = x.size(0), d = out.size(1);
  TORCH_CHECK(out.size(0) == T && x.size(1) == 2 * d, "out must be [T, d] for x [T, 2d]");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + d;
      float* o = op + t * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
  });
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_f32(x, "x"); check_f32(residual, "residual"); check_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
              residual.sizes() == x.sizes() && weight.is_contiguous() && weight.size(0) == x.size(1),
              "x and residual contiguous [T, hidden], weight [hidden]");
  const int64_t T = x.size(0), h = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* xr = xp + t * h;
      float* rr = rp + t * h;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) {
        const float r = rr[i] + xr[i];
        rr[i] = r;
        ss += r * r;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + feps);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) xr[i] = (rr[i] * inv) * w[i];
    }
  });
}

void rotary_embedding(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_f32(x, "x"); check_f32(cos, "cos"); check_f32(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x [T, heads, head_dim] with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T &&
              cos.size(1) == half && sin.sizes() == cos.sizes(), "cos/sin [T, head_dim/2] contiguous");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t hh = 0; hh < H; ++hh) {
        float* x1 = xp + t * s0 + hh * s1;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], bb = x2[i];
          x1[i] = a * c[i] - bb * s[i];
          x2[i] = bb * c[i] + a * s[i];
        }
      }
    }
  });
}
