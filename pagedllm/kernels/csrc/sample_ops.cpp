// Row-wise selection kernels of the sampler and the logprobs (sample/topk.py,
// sample/logprobs.py, sample/logits_processors.py): the k largest values of each row of
// float32 logits [N, V] with their indices, optionally the rank of a given token in the
// same pass and the row's log-softmax normaliser (its maximum and log sum exp(x - max))
// while the row is still in cache; and the tokens a sequence has seen with their output counts (the inputs of
// the repetition / frequency / presence penalties).
//
// Why: each full pass over 32 x 49,152 float32 logits through torch ops costs 0.2-0.9 ms
// on 2 threads, and a sampled step with logprobs made several (a two-stage top-k for the
// sampler's candidates, another for the top logprobs, a count for the sampled token's
// rank). Here a row is read once: a vector compare against the current k-th value
// discards almost every element (about k * ln(V / k) of the V are ever kept as
// candidates), and the rank's count rides on the same loads.
//
// Order: values descending; equal values by ascending index (as a stable descending sort,
// torch.sort(stable=True, descending=True)); NaN above +inf (as torch.topk and torch.sort),
// NaNs among themselves by index; -0.0 equal to +0.0. Comparisons go through integer keys
// or compare intrinsics with explicit predicates, so -ffast-math (the kernels' flags) cannot
// change them. Row by row, so a row's result never depends on the batch around it.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

// A float's place in the order above, as an unsigned integer (larger = ranked higher).
inline uint32_t order_key(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu;   // any NaN: above everything
  if (b == 0x80000000u) b = 0;                                 // -0.0 ranks as +0.0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct Cand {
  uint32_t key;
  int32_t idx;
  float val;
};

// a ranks above b: larger key, or the same key at a lower index
inline bool above(const Cand& a, const Cand& b) {
  return a.key > b.key || (a.key == b.key && a.idx < b.idx);
}

// Lanes i of x[0:W) that might rank above t: !(x[i] <= t), true for NaN (a superset of
// the lanes whose key exceeds t's; the heap then decides with the keys). Bit i = lane i.
#if defined(__AVX512F__)
constexpr int W = 16;
inline uint32_t maybe_above(const float* x, float t) {
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(t), _CMP_NLE_UQ);
}
inline int count_gt(const float* x, float c) {   // lanes with x[i] > c (ordered: NaN never)
  return __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(c), _CMP_GT_OQ));
}
#elif defined(PAGEDLLM_AVX2)
constexpr int W = 8;
inline uint32_t maybe_above(const float* x, float t) {
  return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), _mm256_set1_ps(t), _CMP_NLE_UQ));
}
inline int count_gt(const float* x, float c) {
  return __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), _mm256_set1_ps(c), _CMP_GT_OQ)));
}
#else
constexpr int W = 1;
inline uint32_t maybe_above(const float* x, float t) { return order_key(x[0]) > order_key(t) ? 1u : 0u; }
inline int count_gt(const float* x, float c) {   // ordered compare through keys: NaN never counts
  return (order_key(x[0]) != 0xffffffffu && order_key(c) != 0xffffffffu && order_key(x[0]) > order_key(c)) ? 1 : 0;
}
#endif

// The k best of row x[0:V) into vals/idx (best first); *rank = 1 + #{j : x[j] > x[chosen]}
// (ordered compare, so 1 when x[chosen] is NaN) when chosen >= 0.
//
// buf holds the k best so far plus the newcomers that rank above the k-th of them
// (``thr``); when it holds 2k (at least k + 64), nth_element keeps the k best and ``thr``
// rises to the new k-th. Scanning by ascending index, a newcomer equal to ``thr`` comes
// after it in the order, so it is never taken: the k kept are the k best of the order.
void topk_row(const float* x, int64_t V, int64_t k, int64_t chosen, std::vector<Cand>& buf,
              float* vals, int64_t* idx, int64_t* rank) {
  const float c = chosen >= 0 ? x[chosen] : 0.f;
  const uint32_t c_key = chosen >= 0 ? order_key(c) : 0;
  const bool count = chosen >= 0 && c_key != 0xffffffffu;
  int64_t greater = 0;
  auto count_one = [&](int64_t j) {
    const uint32_t kj = order_key(x[j]);
    greater += (kj != 0xffffffffu && kj > c_key);
  };
  if (k == 0) {   // the rank alone
    if (count) {
      int64_t j = 0;
      for (; j + W <= V; j += W) greater += count_gt(x + j, c);
      for (; j < V; ++j) count_one(j);
    }
    if (rank) *rank = 1 + greater;
    return;
  }
  const size_t cap = static_cast<size_t>(std::max<int64_t>(2 * k, k + 64));
  buf.clear();
  for (int64_t j = 0; j < k; ++j) {
    buf.push_back({order_key(x[j]), static_cast<int32_t>(j), x[j]});
    if (count) count_one(j);
  }
  Cand thr = *std::min_element(buf.begin(), buf.end(), [](const Cand& a, const Cand& b) { return above(b, a); });
  auto compact = [&]() {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), above);
    buf.resize(k);
    thr = buf[k - 1];
  };
  auto offer = [&](int64_t j) {
    const Cand cand{order_key(x[j]), static_cast<int32_t>(j), x[j]};
    if (above(cand, thr)) {
      buf.push_back(cand);
      if (buf.size() >= cap) compact();
    }
  };
  int64_t j = k;
  for (; j + W <= V; j += W) {
    if (count) greater += count_gt(x + j, c);
    uint32_t m = maybe_above(x + j, thr.val);
    while (m) {
      const int lane = __builtin_ctz(m);
      m &= m - 1;
      offer(j + lane);
    }
  }
  for (; j < V; ++j) {
    if (count) count_one(j);
    offer(j);
  }
  if (buf.size() > static_cast<size_t>(k)) compact();
  std::sort(buf.begin(), buf.end(), above);   // best first
  for (int64_t i = 0; i < k; ++i) {
    vals[i] = buf[i].val;
    idx[i] = buf[i].idx;
  }
  if (rank) *rank = 1 + greater;
}

// The log-softmax normaliser of row x[0:V) whose largest value is m:
// log sum_j exp(x[j] - m), so that log_softmax(x)[j] = (x[j] - m) - result (torch's
// formula). The differences go through a fixed scratch chunk (the same alignment and
// lengths for every row of a given V) and are summed by sum_f32's fixed tree, so the
// value depends on the row alone.
constexpr int64_t kExpChunk = 512;
float log_sum_exp_shifted(const float* x, int64_t V, float m, float* scratch) {
  float total = 0.f;
  for (int64_t j0 = 0; j0 < V; j0 += kExpChunk) {
    const int64_t n = std::min<int64_t>(kExpChunk, V - j0);
    for (int64_t i = 0; i < n; ++i) scratch[i] = expf(x[j0 + i] - m);
    total += pagedllm::sum_f32(scratch, n);
  }
  return logf(total);
}

// NaN test on the bits (-ffast-math lets the compiler assume x == x)
inline bool is_nan(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b & 0x7fffffffu) > 0x7f800000u;
}

float row_max(const float* x, int64_t V) {
  float m = -INFINITY;
  for (int64_t j = 0; j < V; ++j) {
    if (is_nan(x[j])) return x[j];   // NaN: the normaliser is NaN, as torch's
    m = x[j] > m ? x[j] : m;
  }
  return m;
}

}  // namespace

std::vector<at::Tensor> topk_rows(at::Tensor x, int64_t k, std::optional<at::Tensor> chosen, bool lse) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "topk_rows: x must be a contiguous float32 CPU tensor [N, V]");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 0 && k <= V, "topk_rows: k = ", k, " must be in [0, V = ", V, "]");
  TORCH_CHECK(V < (int64_t{1} << 31), "topk_rows: rows longer than 2^31 - 1");
  auto vals = at::empty({N, k}, x.options());
  auto idx = at::empty({N, k}, x.options().dtype(at::kLong));
  at::Tensor ranks;
  const int64_t* cp = nullptr;
  if (chosen) {
    TORCH_CHECK(chosen->dim() == 1 && chosen->size(0) == N && chosen->scalar_type() == at::kLong &&
                    chosen->is_contiguous() && chosen->device().is_cpu(),
                "topk_rows: chosen must be a contiguous int64 CPU tensor [N]");
    cp = chosen->data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(cp[i] >= 0 && cp[i] < V, "topk_rows: chosen[", i, "] = ", cp[i], " is outside [0, ", V, ")");
    ranks = at::empty({N}, idx.options());
  }
  const float* xp = x.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  int64_t* rp = cp ? ranks.data_ptr<int64_t>() : nullptr;
  at::Tensor shift, log_sum;
  float *sp = nullptr, *lp = nullptr;
  if (lse) {
    shift = at::empty({N}, x.options());
    log_sum = at::empty({N}, x.options());
    sp = shift.data_ptr<float>();
    lp = log_sum.data_ptr<float>();
  }
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    std::vector<Cand> buf;
    buf.reserve(std::max<int64_t>(2 * k, k + 64) + 1);
    std::vector<float> scratch(lse ? kExpChunk : 0);
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = xp + r * V;
      topk_row(row, V, k, cp ? cp[r] : -1, buf, vp + r * k, ip + r * k, rp ? rp + r : nullptr);
      if (lse) {
        // the top value is the maximum (a NaN, if any, ranks first and makes it NaN)
        const float m = k > 0 ? vp[r * k] : row_max(row, V);
        sp[r] = m;
        lp[r] = (is_nan(m) || V == 0) ? m : log_sum_exp_shifted(row, V, m, scratch.data());
      }
    }
  });
  std::vector<at::Tensor> out{vals, idx};
  if (cp) out.push_back(ranks);
  if (lse) {
    out.push_back(shift);
    out.push_back(log_sum);
  }
  return out;
}

std::vector<at::Tensor> token_presence(at::Tensor history, at::Tensor prompt_len, at::Tensor length,
                                          int64_t vocab_size) {
  TORCH_CHECK(history.dim() == 2 && history.scalar_type() == at::kLong && history.device().is_cpu(),
              "token_presence: history must be an int64 CPU tensor [P, L]");
  const int64_t P = history.size(0), L = history.size(1);
  auto h = history.contiguous();
  auto pl = prompt_len.to(at::kLong).contiguous(), ln = length.to(at::kLong).contiguous();
  TORCH_CHECK(pl.numel() == P && ln.numel() == P, "token_presence: prompt_len and length need P = ", P, " values");
  const int64_t* hp = h.data_ptr<int64_t>();
  const int64_t* plp = pl.data_ptr<int64_t>();
  const int64_t* lnp = ln.data_ptr<int64_t>();
  for (int64_t i = 0; i < P; ++i) {
    TORCH_CHECK(lnp[i] >= 0 && lnp[i] <= L, "token_presence: length[", i, "] = ", lnp[i], " is outside [0, ", L, "]");
    for (int64_t j = 0; j < lnp[i]; ++j)
      TORCH_CHECK(hp[i * L + j] >= 0 && hp[i * L + j] < vocab_size, "token_presence: history[", i, ", ", j,
                  "] = ", hp[i * L + j], " is outside the vocabulary [0, ", vocab_size, ")");
  }
  // per row: its distinct tokens, ascending, and each one's count in the output
  std::vector<std::vector<int64_t>> toks(P);
  std::vector<std::vector<float>> counts(P);
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> seen(vocab_size, 0);   // 1 + output count; 0 = not seen
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t* row = hp + i * L;
      auto& t = toks[i];
      for (int64_t j = 0; j < lnp[i]; ++j) {
        int32_t& s = seen[row[j]];
        if (s == 0) {
          t.push_back(row[j]);
          s = 1;
        }
        s += (j >= plp[i]);
      }
      std::sort(t.begin(), t.end());
      auto& c = counts[i];
      c.reserve(t.size());
      for (int64_t tok : t) {
        c.push_back(static_cast<float>(seen[tok] - 1));
        seen[tok] = 0;
      }
    }
  });
  int64_t M = 0;
  for (const auto& t : toks) M += static_cast<int64_t>(t.size());
  auto opts = at::TensorOptions().dtype(at::kLong);
  auto rows = at::empty({M}, opts), tokens = at::empty({M}, opts);
  auto cnt = at::empty({M}, opts.dtype(at::kFloat));
  int64_t* rp = rows.data_ptr<int64_t>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* cp = cnt.data_ptr<float>();
  for (int64_t i = 0, o = 0; i < P; ++i) {
    for (size_t j = 0; j < toks[i].size(); ++j, ++o) {
      rp[o] = i;
      tp[o] = toks[i][j];
      cp[o] = counts[i][j];
    }
  }
  return {rows, tokens, cnt};
}
