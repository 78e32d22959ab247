// bfloat16 linear layers with AVX512-BF16 (VDPBF16PS), for CPUs that have it without
// AMX (AMD Zen 4/5, Intel Cooper Lake), batch-invariant by construction, with a float32
// or a bfloat16 output.
//
// Arithmetic (Intel SDM, VDPBF16PS; AMD implements the same instruction): for each float32
// lane, acc += a[2i+1] * b[2i+1] + a[2i] * b[2i], products of bfloat16 exact in float32,
// denormal inputs and outputs flushed to zero. For out = x @ w.T:
//   acc[m][n] = 0; for p = 0 .. K/2 - 1 in order: acc = VDPBF16PS(acc, x[m, 2p:2p+2],
//   w[n, 2p:2p+2]); out = acc + bias[n] as float32, or rounded once to bfloat16 (vec.h's
//   round_bf16x16, nearest-even).
// Every output element is that one chain whatever M, the blocking or the thread count, so
// a row's bits never depend on the batch it came in.
//
// Layout: the weight w [N, K] packed as for AMX (pack_amx_tiles, layers/linear.py),
// [N/16, K/32, 16, 32] bf16, which is [N/16, K/2] 64-byte vectors: vector (nb, p) holds
// the pair (w[16nb + n, 2p], w[16nb + n, 2p + 1]) for the 16 columns n of block nb,
// exactly VDPBF16PS's second operand. A micro-kernel computes MR rows (<= 6) by NR column
// blocks (<= 4, 64 columns) in 24 accumulators; each pair step loads NR weight vectors
// and broadcasts one 32-bit x pair per row. Threads (at::parallel_for) split the
// 16-column blocks into equal runs; each thread runs its run, 64 columns at a time, over
// chunks of about 256 KiB of x rows, so a group's weights (64 * K * 2 bytes) are re-read
// from L2 for each block of rows.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512BF16__) && defined(PAGEDLLM_AVX512)
#define PAGEDLLM_AVX512_BF16 1
#include <immintrin.h>
#endif

using pagedllm::bf16;

#ifdef PAGEDLLM_AVX512_BF16
namespace {

constexpr int kMaxRows = 6;    // MR: rows of a micro-kernel
constexpr int kMaxBlocks = 4;  // NR: 16-column blocks of a micro-kernel

// acc[i][j] for rows x[0 .. MR), column blocks w[0 .. NR) (w: block 0's first vector,
// blocks wstride bytes apart), over kp pairs; with pf, also prefetches into L2 the same
// lines of the pfn blocks from pf on (the next group's weights).
template <int MR, int NR>
inline void micro(const bf16* x, int64_t ldx, const char* w, int64_t wstride, int64_t kp,
                  __m512 (&acc)[kMaxRows][kMaxBlocks], const char* pf = nullptr, int pfn = 0) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh b[NR];
    for (int j = 0; j < NR; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * wstride + p * 64);
    if (pf) for (int j = 0; j < pfn; ++j) _mm_prefetch(pf + j * wstride + p * 64, _MM_HINT_T1);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
}

template <int MR, int NR, typename OutT>
inline void tile(const bf16* x, int64_t K, const char* w, int64_t kp, const float* bias, OutT* out,
                 int64_t ldo, const char* pf, int pfn) {
  __m512 acc[kMaxRows][kMaxBlocks];
  micro<MR, NR>(x, K, w, kp * 64, kp, acc, pf, pfn);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      __m512 v = acc[i][j];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
      pagedllm::store16_avx512(out + i * ldo + 16 * j, v);
    }
}

// The micro-kernel for rows (1 .. MR) and blocks (1 .. NR) known only at run time.
template <int NR, typename OutT>
inline void tile_rows(int rows, const bf16* x, int64_t K, const char* w, int64_t kp, const float* bias,
                      OutT* out, int64_t ldo, const char* pf, int pfn) {
  switch (rows) {
    case 1: return tile<1, NR>(x, K, w, kp, bias, out, ldo, pf, pfn);
    case 2: return tile<2, NR>(x, K, w, kp, bias, out, ldo, pf, pfn);
    case 3: return tile<3, NR>(x, K, w, kp, bias, out, ldo, pf, pfn);
    case 4: return tile<4, NR>(x, K, w, kp, bias, out, ldo, pf, pfn);
    case 5: return tile<5, NR>(x, K, w, kp, bias, out, ldo, pf, pfn);
    default: return tile<6, NR>(x, K, w, kp, bias, out, ldo, pf, pfn);
  }
}

template <typename OutT>
inline void tile_any(int rows, int blocks, const bf16* x, int64_t K, const char* w, int64_t kp,
                     const float* bias, OutT* out, int64_t ldo, const char* pf, int pfn) {
  switch (blocks) {
    case 1: return tile_rows<1>(rows, x, K, w, kp, bias, out, ldo, pf, pfn);
    case 2: return tile_rows<2>(rows, x, K, w, kp, bias, out, ldo, pf, pfn);
    case 3: return tile_rows<3>(rows, x, K, w, kp, bias, out, ldo, pf, pfn);
    default: return tile_rows<4>(rows, x, K, w, kp, bias, out, ldo, pf, pfn);
  }
}

template <typename OutT>
void run(const bf16* x, int64_t M, int64_t K, const char* w, int64_t N, const float* bias, OutT* out) {
  const int64_t kp = K / 2, nblocks = N / 16, block_bytes = kp * 64;
  const int64_t mchunk = std::max<int64_t>(kMaxRows, (256 * 1024 / std::max<int64_t>(2 * K, 1)) / kMaxRows * kMaxRows);
  // about 128 K multiply-adds per task; decode's M = 1 still splits
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(M * K * 16, 1));
  // The first row tile of a group prefetches the next group's weights into L2 as it goes:
  // 1.05-1.13x at M = 8-64 where a block is 18 KiB (K = 576), 0.96-0.99x at 48 KiB (K = 1536),
  // whose longer streams the hardware prefetcher already covers (docs/benchmarks.md, 16).
  const bool prefetch = block_bytes <= 32 * 1024;
  // Threads take equal runs of 16-column blocks (not of whole 64-column groups: N = 576 is
  // 9 groups, 5 against 4 on two threads), each run in groups of up to kMaxBlocks.
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += mchunk) {
      const int64_t m1 = std::min(M, m0 + mchunk);
      for (int64_t b = b0; b < b1; b += kMaxBlocks) {
        const int blocks = static_cast<int>(std::min<int64_t>(kMaxBlocks, b1 - b));
        const char* wg = w + b * block_bytes;
        const int64_t n0 = b * 16;
        const float* bg = bias ? bias + n0 : nullptr;
        // the next group of this run, prefetched by the first row tile
        const int64_t next = b + kMaxBlocks;
        const char* pf = prefetch && next < b1 ? w + next * block_bytes : nullptr;
        const int pfn = pf ? static_cast<int>(std::min<int64_t>(kMaxBlocks, b1 - next)) : 0;
        for (int64_t m = m0; m < m1; m += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m1 - m));
          const bool first = m == m0;
          tile_any(rows, blocks, x + m * K, K, wg, kp, bg, out + m * N + n0, N, first ? pf : nullptr,
                   first ? pfn : 0);
        }
      }
    }
  });
}

}  // namespace
#endif

bool avx512_bf16_available() {
#ifdef PAGEDLLM_AVX512_BF16
  return true;
#else
  return false;
#endif
}

at::Tensor avx512_bf16_linear(at::Tensor x, at::Tensor w_packed, std::optional<at::Tensor> bias,
                                 bool out_float32) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
                    "avx512_bf16_linear: x must be a contiguous bfloat16 CPU tensor [M, K]");
  TORCH_CHECK_VALUE(w_packed.dim() == 4 && w_packed.scalar_type() == at::kBFloat16 && w_packed.is_contiguous() &&
                        w_packed.size(2) == 16 && w_packed.size(3) == 32,
                    "avx512_bf16_linear: w_packed must be a contiguous bfloat16 [N/16, K/32, 16, 32] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0) * 16;
  TORCH_CHECK_VALUE(w_packed.size(1) * 32 == K, "avx512_bf16_linear: x has ", K, " columns, the weight ",
                    w_packed.size(1) * 32);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK_VALUE(b.numel() == N, "avx512_bf16_linear: bias has ", b.numel(), " elements, expected ", N);
  }
  auto out = at::empty({M, N}, x.options().dtype(out_float32 ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return out;
#ifdef PAGEDLLM_AVX512_BF16
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const bf16* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
  const char* wp = static_cast<const char*>(w_packed.data_ptr());
  if (out_float32) run(xp, M, K, wp, N, bp, out.data_ptr<float>());
  else run(xp, M, K, wp, N, bp, reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()));
  return out;
#else
  TORCH_CHECK(false, "avx512_bf16_linear: the kernels were built without AVX512-BF16 (not this CPU)");
#endif
}
