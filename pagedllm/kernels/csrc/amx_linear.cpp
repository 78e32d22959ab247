// bfloat16 linear layers on Intel AMX (AMX-TILE + AMX-BF16), batch-invariant by
// construction; and the integer matmul of the int8 W8A8 method on AMX-INT8 (TDPBUSD,
// exact int32 sums, weights [N/16, K/64, 16, 64] int8), through the same walk: both read
// 64-byte tile rows, so the kernel works in bytes and a store functor decides what the
// accumulators become.
//
// Why: oneDNN's bf16 inner product picks its blocking by the row count M, and on the
// project's Intel Xeon a row's bits differ between calls of <= 32 rows and calls of 33-384
// rows (and again at other counts): the batch-invariance probe then wraps every layer in
// 16-row chunks, which costs 2-5x at 64-512 rows. Here every output element is one chain
// of TDPBF16PS over K in a fixed order from zero, whatever M, the thread count or the
// element's place in the batch: rows are batch-invariant without chunking.
//
// Arithmetic (Intel Architecture Instruction Set Extensions Programming Reference, "Intel
// AMX", TDPBF16PS): C[m][n] += sum over the 16 bf16 pairs of a 64-byte row of A and the
// matching pairs of B, the products and their sum in float32. For out = x @ w.T:
//   acc[m][n] = 0; for kb = 0 .. K/32 - 1 in order: acc += TDPBF16PS(x[m, 32kb:32kb+32],
//   w[n, 32kb:32kb+32]); out = round_bf16(acc + bias[n]) (vec.h's from_f32, nearest-even),
//   or acc + bias[n] as float32.
//
// Layout: the weight w [N, K] (K % 32 == 0, N % 16 == 0) is packed once at load into
// AMX's "VNNI" B-tile layout, [N/16, K/32, 16, 32] bf16 (pack_amx_tiles in Python,
// layers/linear.py): tile (nb, kb) row r holds, for the 16 columns n of block nb, the
// pair (w[16nb + n, 32kb + 2r], w[16nb + n, 32kb + 2r + 1]). Each call takes 32 columns
// (two B tiles) by up to 32 rows (two A tiles, x read in place at stride K) into four
// 16 x 16 float32 accumulator tiles. Threads (at::parallel_for) split the column pairs;
// each thread takes the rows in chunks of about 256 KiB of x (kept in L2) and runs every
// one of its column pairs over a chunk before the next. Rows past M in the last block come from a zero-padded
// copy of the tail (rows of a tile never mix: padding changes no real row).
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define PAGEDLLM_AMX 1
#if defined(__AMX_INT8__)
#define PAGEDLLM_AMX_INT8 1
#endif
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

using pagedllm::bf16;
using pagedllm::from_f32;

#ifdef PAGEDLLM_AMX
namespace {

// Linux gives a process AMX tile state only after it asks (arch_prctl, Documentation/
// arch/x86/xstate.rst); the grant covers all its threads.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool request_amx() {
  static std::once_flag once;
  static bool granted = false;
  std::call_once(once, [] { granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0; });
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: accumulators C[ma][nb] (tile 2 * ma + nb); 4, 5: A (rows 16ma..16ma+15);
// 6, 7: B (column blocks 2p, 2p + 1). All 16 rows x 64 bytes.
void load_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // GCC does not see that LDTILECFG reads the struct: out of line (amx_load_tile_config), -O3
  // dropped the stores of colsb and rows and loaded 0-row tiles (the next tile op: SIGILL).
  asm volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// The tile dot product for an accumulator type: float32 <- bf16 pairs (TDPBF16PS), int32
// <- u8 x s8 quads (TDPBUSD). Both read 64-byte tile rows, so one walk serves both.
#ifdef PAGEDLLM_AMX_INT8
#define PAGEDLLM_TILE_DOT(Acc, C, A, B)                          \
  do {                                                           \
    if constexpr (std::is_same_v<Acc, int32_t>) _tile_dpbusd(C, A, B); \
    else _tile_dpbf16ps(C, A, B);                                \
  } while (0)
#else
#define PAGEDLLM_TILE_DOT(Acc, C, A, B) _tile_dpbf16ps(C, A, B)
#endif

// One block: MA A tiles (16 rows each) x NB B tiles (16 columns each), over K in 64-byte
// steps (32 bf16 or 64 int8 elements). a: the block's first row (row stride lda bytes);
// b0, b1: tile (nb, 0) of the two column blocks in the packed weight (tile (nb, kb) is
// 1 KiB after (nb, kb - 1)); c: an Acc [32, 32] buffer (row stride 32) that receives the
// accumulators (float32 for bf16, int32 for u8 x s8).
// pf: null, or the start of the next column pair's weights (2 * kblocks KiB, contiguous);
// each k step then prefetches the next 2 KiB of them into L2, so the next pair's weights
// stream in while this one computes rather than after it: 1.02-1.06x for decode's 1-64
// rows on the Intel Xeon (docs/benchmarks.md, 2026-12-05 afternoon). Prefetching the A
// rows of the next block into L1 as well was slower (0.8-0.9x): with 2 x 2 tiles a block,
// the A tiles read from L2 bound prefill's tile products (~1.9 TOP/s a core, against ~4.2
// with every operand in L1; a standalone loop, same 2 x 2 blocking).
template <int MA, int NB, typename Acc>
inline void block(const char* a, int64_t lda, const char* b0, const char* b1, int64_t kblocks, Acc* c,
                  const char* pf = nullptr) {
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (MA == 2) _tile_zero(2);
  if constexpr (MA == 2 && NB == 2) _tile_zero(3);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    if (pf)
      for (int o = 0; o < 2048; o += 64) _mm_prefetch(pf + kb * 2048 + o, _MM_HINT_T1);
    _tile_loadd(4, a + kb * 64, lda);
    _tile_loadd(6, b0 + kb * 1024, 64);
    if constexpr (NB == 2) _tile_loadd(7, b1 + kb * 1024, 64);
    PAGEDLLM_TILE_DOT(Acc, 0, 4, 6);
    if constexpr (NB == 2) PAGEDLLM_TILE_DOT(Acc, 1, 4, 7);
    if constexpr (MA == 2) {
      _tile_loadd(5, a + 16 * lda + kb * 64, lda);
      PAGEDLLM_TILE_DOT(Acc, 2, 5, 6);
      if constexpr (NB == 2) PAGEDLLM_TILE_DOT(Acc, 3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  if constexpr (NB == 2) _tile_stored(1, c + 16, 128);
  if constexpr (MA == 2) _tile_stored(2, c + 16 * 32, 128);
  if constexpr (MA == 2 && NB == 2) _tile_stored(3, c + 16 * 32 + 16, 128);
}

using pagedllm::store16_avx512;   // 16 float32 as OutT (float32, or bf16 rounded by round_bf16x16)

// The stores run() calls: store(c, rows, cols, m, n0) writes rows m .. m+rows-1 and
// columns n0 .. n0+cols-1 (cols 16 or 32) of the result from the accumulators c (row
// stride 32); Acc says which accumulators (and so which tile dot product) they take.

// bf16: float32 accumulators plus bias, as OutT.
template <typename OutT>
struct StoreBias {
  using Acc = float;
  OutT* out;
  int64_t ldo;
  const float* bias;
  void operator()(const float* c, int rows, int cols, int64_t m, int64_t n0) const {
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < cols; j += 16) {
        __m512 v = _mm512_loadu_ps(c + r * 32 + j);
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + j));
        store16_avx512(out + (m + r) * ldo + n0 + j, v);
      }
  }
};

// Keeps the compiler (-ffast-math) from fusing the operations before and after it (e.g.
// a multiply and an add into an FMA), so that each rounds as quant_act.cpp's epilogue does.
inline void opaque512(__m512& v) { asm volatile("" : "+v"(v)); }

// u8 x s8: int32 accumulators -> float32 (rounded to nearest even where |acc| >= 2**24).
struct StoreAcc {
  using Acc = int32_t;
  float* out;
  int64_t ldo;
  void operator()(const int32_t* c, int rows, int cols, int64_t m, int64_t n0) const {
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < cols; j += 16)
        _mm512_storeu_ps(out + (m + r) * ldo + n0 + j, _mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * 32 + j)));
  }
};

// u8 x s8 with the W8A8 epilogue fused: out[m, n] = (((float(acc) - comp[n]) * ws[n]) *
// rs[m]) (+ bias[n]), one IEEE operation at a time, rounded to OutT: the bits of
// quant_act.cpp's int8_epilogue over the float32 sums.
template <typename OutT>
struct StoreEpilogue {
  using Acc = int32_t;
  OutT* out;
  int64_t ldo;
  const float *comp, *ws, *rs, *bias;
  void operator()(const int32_t* c, int rows, int cols, int64_t m, int64_t n0) const {
    for (int r = 0; r < rows; ++r) {
      const __m512 s = _mm512_set1_ps(rs[m + r]);
      for (int j = 0; j < cols; j += 16) {
        __m512 v = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * 32 + j)),
                                 _mm512_loadu_ps(comp + n0 + j));
        opaque512(v);
        v = _mm512_mul_ps(v, _mm512_loadu_ps(ws + n0 + j));
        opaque512(v);
        v = _mm512_mul_ps(v, s);
        if (bias) {
          opaque512(v);
          v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + j));
        }
        store16_avx512(out + (m + r) * ldo + n0 + j, v);
      }
    }
  }
};

// out = x @ w.T for x [M, row_bytes] (bf16 or uint8 elements, row_bytes a multiple of 64)
// and w packed [N/16, row_bytes/64, 16, 64 bytes], through store.
template <typename Store>
void run(const char* x, int64_t M, int64_t row_bytes, const char* w, int64_t N, const Store& store) {
  using Acc = typename Store::Acc;
  const int64_t kblocks = row_bytes / 64, nblocks = N / 16, pairs = (nblocks + 1) / 2;
  const int64_t full = M / 32 * 32, tail = M - full;
  // Rows are taken in chunks of about 256 KiB of x (a multiple of 32 rows), each chunk
  // against all of a thread's column pairs, so that a big M re-reads x from L2 rather
  // than from memory once per pair.
  const int64_t mchunk = std::max<int64_t>(32, (256 * 1024 / std::max<int64_t>(row_bytes, 1)) / 32 * 32);
  // grain: about 128 K multiply-adds of bf16 (256 K of int8) per task; decode's M = 1
  // still splits
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(M * row_bytes * 32, 1));
  at::parallel_for(0, pairs, grain, [&](int64_t p0, int64_t p1) {
    load_config();
    alignas(64) Acc c[32 * 32];
    std::vector<char> pad;
    if (tail) {   // the last rows, zero-padded to a whole tile (or two): rows of a tile never mix
      pad.assign((tail > 16 ? 32 : 16) * row_bytes, 0);
      std::memcpy(pad.data(), x + full * row_bytes, tail * row_bytes);
    }
    for (int64_t m0 = 0; m0 < M; m0 += mchunk) {
      const int64_t m1 = std::min(full, m0 + mchunk);
      const bool last = m0 + mchunk >= M;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t nb = 2 * p;
        const bool two = nb + 1 < nblocks;
        const char* b0 = w + nb * kblocks * 1024;
        const char* b1 = b0 + kblocks * 1024;
        const int cols = two ? 32 : 16;
        // the next pair's weights (contiguous after this pair's), prefetched during the
        // first block of rows that reads this pair
        const char* next = p + 1 < p1 ? b0 + 2 * kblocks * 1024 : nullptr;
        for (int64_t m = m0; m < m1; m += 32) {
          const char* pf = m == m0 ? next : nullptr;
          if (two) block<2, 2>(x + m * row_bytes, row_bytes, b0, b1, kblocks, c, pf);
          else block<2, 1>(x + m * row_bytes, row_bytes, b0, b1, kblocks, c, pf);
          store(c, 32, cols, m, nb * 16);
        }
        if (!last || !tail) continue;
        const char* pf = m0 >= m1 ? next : nullptr;   // no full block read this pair
        if (tail > 16) {
          if (two) block<2, 2>(pad.data(), row_bytes, b0, b1, kblocks, c, pf);
          else block<2, 1>(pad.data(), row_bytes, b0, b1, kblocks, c, pf);
        } else {
          if (two) block<1, 2>(pad.data(), row_bytes, b0, b1, kblocks, c, pf);
          else block<1, 1>(pad.data(), row_bytes, b0, b1, kblocks, c, pf);
        }
        store(c, static_cast<int>(tail), cols, full, nb * 16);
      }
    }
    _tile_release();
  });
}

}  // namespace
#endif

void amx_load_tile_config() {
#ifdef PAGEDLLM_AMX
  load_config();
#else
  TORCH_CHECK(false, "amx_load_tile_config: the kernels were built without AMX (not this CPU)");
#endif
}

bool amx_int8_available() {
#ifdef PAGEDLLM_AMX_INT8
  return request_amx();
#else
  return false;
#endif
}

bool amx_bf16_available() {
#ifdef PAGEDLLM_AMX
  return request_amx();
#else
  return false;
#endif
}

at::Tensor amx_bf16_linear(at::Tensor x, at::Tensor w_packed, std::optional<at::Tensor> bias,
                              bool out_float32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "amx_bf16_linear: x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK(w_packed.dim() == 4 && w_packed.scalar_type() == at::kBFloat16 && w_packed.is_contiguous() &&
                  w_packed.size(2) == 16 && w_packed.size(3) == 32,
              "amx_bf16_linear: w_packed must be a contiguous bfloat16 [N/16, K/32, 16, 32] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0) * 16;
  TORCH_CHECK(w_packed.size(1) * 32 == K, "amx_bf16_linear: x has ", K, " columns, the weight ",
              w_packed.size(1) * 32);
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "amx_bf16_linear: bias has ", b.numel(), " elements, expected ", N);
  }
  auto out = at::empty({M, N}, x.options().dtype(out_float32 ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return out;
#ifdef PAGEDLLM_AMX
  TORCH_CHECK(request_amx(), "amx_bf16_linear: the kernel has no AMX tile state (arch_prctl refused)");
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* wp = static_cast<const char*>(w_packed.data_ptr());
  if (out_float32) run(xp, M, 2 * K, wp, N, StoreBias<float>{out.data_ptr<float>(), N, bp});
  else run(xp, M, 2 * K, wp, N, StoreBias<bf16>{reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()), N, bp});
  return out;
#else
  TORCH_CHECK(false, "amx_bf16_linear: the kernels were built without AMX-BF16 (not this CPU)");
#endif
}

at::Tensor amx_u8s8_matmul(at::Tensor x, at::Tensor w_packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kByte && x.is_contiguous(),
              "amx_u8s8_matmul: x must be a contiguous uint8 [M, K] tensor");
  TORCH_CHECK(w_packed.dim() == 4 && w_packed.scalar_type() == at::kChar && w_packed.is_contiguous() &&
                  w_packed.size(2) == 16 && w_packed.size(3) == 64,
              "amx_u8s8_matmul: w_packed must be a contiguous int8 [N/16, K/64, 16, 64] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0) * 16;
  TORCH_CHECK(w_packed.size(1) * 64 == K, "amx_u8s8_matmul: x has ", K, " columns, the weight ",
              w_packed.size(1) * 64);
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
#ifdef PAGEDLLM_AMX_INT8
  TORCH_CHECK(amx_int8_available(), "amx_u8s8_matmul: no AMX tile state (arch_prctl refused)");
  run(static_cast<const char*>(x.data_ptr()), M, K, static_cast<const char*>(w_packed.data_ptr()), N,
      StoreAcc{out.data_ptr<float>(), N});
  return out;
#else
  TORCH_CHECK(false, "amx_u8s8_matmul: the kernels were built without AMX-INT8 (not this CPU)");
#endif
}

at::Tensor amx_int8_linear(at::Tensor x, at::Tensor w_packed, at::Tensor compensation,
                              at::Tensor weight_scales, at::Tensor row_scales,
                              std::optional<at::Tensor> bias, bool out_bfloat16) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kByte && x.is_contiguous(),
              "amx_int8_linear: x must be a contiguous uint8 [M, K] tensor");
  TORCH_CHECK(w_packed.dim() == 4 && w_packed.scalar_type() == at::kChar && w_packed.is_contiguous() &&
                  w_packed.size(2) == 16 && w_packed.size(3) == 64,
              "amx_int8_linear: w_packed must be a contiguous int8 [N/16, K/64, 16, 64] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0) * 16;
  TORCH_CHECK(w_packed.size(1) * 64 == K, "amx_int8_linear: x has ", K, " columns, the weight ",
              w_packed.size(1) * 64);
  for (const auto* t : {&compensation, &weight_scales})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N,
                "amx_int8_linear: compensation and weight_scales must be contiguous float32 [N]");
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.is_contiguous() && row_scales.numel() == M,
              "amx_int8_linear: row_scales must be contiguous float32 [M]");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "amx_int8_linear: bias must be contiguous float32 [N]");
    bp = bias->data_ptr<float>();
  }
  auto out = at::empty({M, N}, x.options().dtype(out_bfloat16 ? at::kBFloat16 : at::kFloat));
  if (M == 0 || N == 0) return out;
#ifdef PAGEDLLM_AMX_INT8
  TORCH_CHECK(amx_int8_available(), "amx_int8_linear: no AMX tile state (arch_prctl refused)");
  const float *c = compensation.data_ptr<float>(), *ws = weight_scales.data_ptr<float>(),
              *rs = row_scales.data_ptr<float>();
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* wp = static_cast<const char*>(w_packed.data_ptr());
  if (out_bfloat16)
    run(xp, M, K, wp, N, StoreEpilogue<bf16>{reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()), N, c, ws, rs, bp});
  else
    run(xp, M, K, wp, N, StoreEpilogue<float>{out.data_ptr<float>(), N, c, ws, rs, bp});
  return out;
#else
  TORCH_CHECK(false, "amx_int8_linear: the kernels were built without AMX-INT8 (not this CPU)");
#endif
}
