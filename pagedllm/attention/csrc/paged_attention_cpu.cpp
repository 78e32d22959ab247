// Paged decode attention for CPU, float32: one query token per request attends over
// all of the request's cached tokens, read in place through its block table (no gather
// copy). A work item is one request and a range of its kv heads: with many requests,
// all heads at once, so each token's K/V row (every kv head, contiguous) is streamed
// once from memory; with few requests, one kv head per item for parallelism.
// Per item: scores = q·k * scale (4 tokens at a time, independent FMA chains), a
// max-subtracted softmax, then the probability-weighted sum of V rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <math.h>
#include <vector>

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

static void attend(const Args& a, int64_t n, int64_t kh0, int64_t kh1,
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
  for (int64_t h = 0; h < nheads; ++h) {
    float* s = scores.data() + h * L;
    float m = -INFINITY;
    for (int64_t i = 0; i < L; ++i) m = std::max(m, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < L; ++i) {
      s[i] = expf(s[i] - m);
      sum += s[i];
    }
    inv[h] = 1.f / sum;
  }
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
    for (int64_t w = begin; w < end; ++w) {
      if (split_heads) attend(a, w / a.nkv, w % a.nkv, w % a.nkv + 1, scores, acc);
      else attend(a, w, 0, a.nkv, scores, acc);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention (CPU, float32), written into out");
}
