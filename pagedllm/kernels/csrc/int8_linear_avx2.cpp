// The integer matmul of the int8 W8A8 method (pagedllm/layers/quantization/int8.py) on
// AVX2, with the method's epilogue fused, for CPUs without AMX-INT8: exact int32 sums
// with 8-bit weights and 8-bit activations.
//
// Why: on an AVX2 CPU without VNNI, oneDNN's u8 x s8 kernel multiplies with vpmaddubsw,
// whose int16 pair sums saturate at 8 and 8 bits (int8.py's module docstring), so the
// method had to drop the weights to 7 bits there; and torch rebuilds a oneDNN primitive
// on every qlinear_pointwise call (~40 us, 4 linears x 30 layers a step for SmolLM2).
//
// Arithmetic. x arrives as uint8 u = q + zp (q in [-127, 127], the per-token quantized
// activations; zp the method's zero point) and w as int8. Two ways to the exact sums:
//  * 7-bit weights (|w| <= 63, the caller's promise): vpmaddubsw multiplies u (unsigned)
//    by w (signed) and adds adjacent pairs into int16, at most 2 x 255 x 63 = 32130: no
//    saturation; vpmaddwd with ones widens them to int32 at once. acc = sum_k u w.
//  * 8-bit weights (|w| <= 127): 2 x 255 x 127 would saturate, so the kernel takes
//    q = u - zp back (checked to lie in [-127, 127], else a ValueError) and multiplies with the
//    sign trick of ggml's AVX2 q8_0 dot (ggml-cpu quants.c, mul_sum_i8_pairs), written
//    afresh: |w| as unsigned bytes times sign(q, w) (q negated where w < 0, zeroed where
//    w == 0) is w * q, pairs within 2 x 127 x 127 = 32258; then
//    acc = sum_k q w + zp * colsum[n] = sum_k u w. One operation a pair more: slower.
// Either way acc[m, n] = sum_k u[m, k] w[n, k] exactly in int32 (|acc| <= K x 255 x 127:
// K up to 66,000), and the epilogue is the
// method's, one IEEE operation at a time (vec.h's w8a8_epilogue8, shared with quant_act.cpp):
//   out[m, n] = (((float(acc) - comp[n]) * ws[n]) * rs[m]) (+ bias[n]), rounded to the
// output dtype as vec.h's store8_avx rounds: the bits of quant_act.cpp's int8_epilogue
// over the same sums (int8.py's epilogue_ref over int8_matmul_ref), on every AVX2 CPU.
// (The VNNI path runs those operations in 16 lanes for whole tiles: w8a8_epilogue16.)
//
// With AVX512-VNNI (Zen 4/5, Intel Cascade Lake on), VPDPBUSD multiplies u (unsigned) by w
// (signed) and adds each lane's 4 products into int32 exactly (the non-saturating form), so
// acc = sum_k u w comes from one instruction a 16-column group of 4 k, for 7- and 8-bit
// weights alike, without q or the zero point's column sums: the same integers, so the
// same output bits as the AVX2 paths (the 8-bit range check is kept, so errors agree).
//
// Integer sums do not depend on their order, so every output row is bitwise independent
// of the batch, the blocking and the thread count (batch invariance by construction).
//
// Layout: w [N, K] (K % 4 == 0) is packed once at load into [ceil(N/16), K/4, 16, 4]
// int8 (pack_int8_avx2 in int8.py; columns past N are zero): for each 16-column tile and
// each group of 4 consecutive k, 64 bytes, column j's 4 weights at bytes 4j..4j+3, i.e.
// two 32-byte registers (columns 0-7, 8-15). A row's 4 activations of the group are
// broadcast to every 32-bit lane, so each lane's vpmaddubsw + vpmaddwd adds that column's
// 4 products. The micro-kernel holds 4 rows x 16 columns of int32 sums in 8 registers (with
// VNNI, 8 rows x 32 columns in 16 zmm registers) and
// walks K once; threads (at::parallel_for) split the column tiles, each taking the rows
// in chunks of ~128 KiB of activations (kept in L2) against all of its tiles.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

using pagedllm::bf16;

#if defined(PAGEDLLM_AVX2) && defined(PAGEDLLM_AVX512) && defined(__AVX512VNNI__)
#define PAGEDLLM_VNNI 1
#endif

#ifdef PAGEDLLM_AVX2
namespace {

constexpr int64_t kCols = 16;   // columns per tile
constexpr int kRows = 4;        // rows per micro-kernel call
// VNNI micro-kernel blocking: kVnniRows rows x kVnniTiles 16-column tiles of int32 sums in
// zmm registers (16 accumulators, 2 weight vectors and a broadcast: each weight vector
// loaded feeds 8 VPDPBUSD). 8 x 3 and 12 x 2 measured level, 4 x 2 slower (docs/benchmarks.md, section 16).
constexpr int kVnniRows = 8;
constexpr int kVnniTiles = 2;

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// For R rows of activations a (at stride K) and one 16-column tile wt [K/4][64 bytes],
// acc[r][0] gets columns 0-7 of the row's int32 sums, acc[r][1] columns 8-15:
//  * kSigned (8-bit weights): a = q (int8), sums of q w by the sign trick;
//  * else (7-bit weights, |w| <= 63): a = u (uint8), sums of u w by vpmaddubsw directly
//    (pairs at most 2 x 255 x 63 = 32130: no saturation), one operation fewer a product
//    pair and no pass to take q out of u.
template <bool kSigned, int R>
inline void tile_dot(const int8_t* a, int64_t K, const int8_t* wt, __m256i (&acc)[kRows][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  // local sums (kept in registers: summing into acc itself made GCC store all 8 every step)
  __m256i c[R][2];
  for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 4) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + 16 * k));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + 16 * k + 32));
    if constexpr (kSigned) {
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int r = 0; r < R; ++r) {
        const __m256i x = bcast4(a + r * K + k);
        c[r][0] = _mm256_add_epi32(c[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0)), ones));
        c[r][1] = _mm256_add_epi32(c[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1)), ones));
      }
    } else {
      for (int r = 0; r < R; ++r) {
        const __m256i x = bcast4(a + r * K + k);
        c[r][0] = _mm256_add_epi32(c[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w0), ones));
        c[r][1] = _mm256_add_epi32(c[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w1), ones));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    acc[r][0] = c[r][0];
    acc[r][1] = c[r][1];
  }
}

#ifdef PAGEDLLM_VNNI
// c + the 4-byte dot products of x (unsigned) and w (signed) per 32-bit lane: VPDPBUSD as
// _mm512_dpbusd_epi32, written out so that GCC updates c in its register (with the
// intrinsic it copied every accumulator each step, or kept them on the stack).
inline __m512i dpbusd(__m512i c, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(c) : "v"(x), "v"(w));
  return c;
}

// tile_dot's sums of u w (u uint8) with VPDPBUSD over 64-byte groups (16 columns x 4 k), for
// NT (1 .. kVnniTiles) adjacent tiles at once: R x NT accumulators, each row's 4 bytes
// broadcast once a group, each weight vector loaded once a group.
template <int R, int NT>
inline void tile_dot_vnni(const uint8_t* u, int64_t K, const int8_t* wt, __m512i (&acc)[NT][kVnniRows]) {
  __m512i c[NT][R];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < R; ++r) c[t][r] = _mm512_setzero_si512();
  const int64_t tile_bytes = K * kCols;
  for (int64_t k = 0; k < K; k += 4) {
    __m512i w[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) w[t] = _mm512_loadu_si512(wt + t * tile_bytes + 16 * k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t v;
      std::memcpy(&v, u + r * K + k, 4);
      const __m512i x = _mm512_set1_epi32(v);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) c[t][r] = dpbusd(c[t][r], x, w[t]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = c[t][r];
}
#endif

template <typename OutT>
struct Epilogue {
  OutT* out;
  int64_t ldo, N;
  int32_t zp;
  const int32_t* colsum;                // [N]
  const float *comp, *ws, *rs, *bias;   // comp, ws, bias: [N]; rs: [M]

#ifdef PAGEDLLM_VNNI
  // rows m .. m+R-1 of a whole 16-column tile (n0 + 16 <= N) from zmm sums, with zp == 0:
  // store's epilogue in 16 lanes (vec.h's w8a8_epilogue16: the same bits), the column
  // operands loaded once for the R rows and the rows stored straight to out.
  template <int R>
  void store16(const __m512i* acc, int64_t m, int64_t n0) const {
    const __m512 cp = _mm512_loadu_ps(comp + n0), w = _mm512_loadu_ps(ws + n0);
    const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = pagedllm::w8a8_epilogue16(_mm512_cvtepi32_ps(acc[r]), cp, w, _mm512_set1_ps(rs[m + r]),
                                                 bias ? &b : nullptr);
      pagedllm::store16_avx512(out + (m + r) * ldo + n0, v);
    }
  }
#endif

  // rows m .. m+R-1, columns n0 .. n0+15 (those < N stored)
  template <int R>
  void store(const __m256i (*acc)[2], int64_t m, int64_t n0) const {
    const int64_t cols = std::min(kCols, N - n0);
    const int32_t* cs = colsum + n0;
    const float *cp = comp + n0, *w = ws + n0, *b = bias ? bias + n0 : nullptr;
    // the last tile of an N not a multiple of 16: its per-column values zero-padded to 16 lanes
    alignas(32) int32_t cs_t[kCols] = {};
    alignas(32) float cp_t[kCols] = {}, w_t[kCols] = {}, b_t[kCols] = {};
    if (cols < kCols) {
      std::memcpy(cs_t, cs, cols * sizeof(int32_t));
      std::memcpy(cp_t, cp, cols * sizeof(float));
      std::memcpy(w_t, w, cols * sizeof(float));
      cs = cs_t, cp = cp_t, w = w_t;
      if (b) b = static_cast<const float*>(std::memcpy(b_t, b, cols * sizeof(float)));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(rs[m + r]);
      alignas(32) OutT tmp[kCols];
      for (int h = 0; h < 2; ++h) {
        const int64_t j = 8 * h;
        const __m256i zc = _mm256_mullo_epi32(_mm256_set1_epi32(zp),
                                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cs + j)));
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_add_epi32(acc[r][h], zc));
        pagedllm::store8_avx(tmp + j, pagedllm::w8a8_epilogue8(sums, cp + j, w + j, s, b ? b + j : nullptr));
      }
      std::memcpy(out + (m + r) * ldo + n0, tmp, cols * sizeof(OutT));
    }
  }
};

template <bool kSigned, int R, typename OutT>
inline void rows(const int8_t* a, int64_t K, const int8_t* wt, const Epilogue<OutT>& ep, int64_t m, int64_t n0) {
  __m256i acc[kRows][2];
  tile_dot<kSigned, R>(a + m * K, K, wt, acc);
  ep.template store<R>(acc, m, n0);
}

#ifdef PAGEDLLM_VNNI
// rows m .. m+R-1 against NT adjacent tiles from column n0 (a holds u; ep.zp is 0)
template <int R, int NT, typename OutT>
inline void rows_vnni(const int8_t* a, int64_t K, const int8_t* wt, const Epilogue<OutT>& ep, int64_t m,
                      int64_t n0) {
  __m512i acc[NT][kVnniRows];
  tile_dot_vnni<R, NT>(reinterpret_cast<const uint8_t*>(a) + m * K, K, wt, acc);
  for (int t = 0; t < NT; ++t) {
    const int64_t n = n0 + t * kCols;
    if (n + kCols <= ep.N && ep.zp == 0) {
      ep.template store16<R>(acc[t], m, n);
      continue;
    }
    __m256i h[kVnniRows][2];   // the last tile of an N not a multiple of 16
    for (int r = 0; r < R; ++r) {
      h[r][0] = _mm512_castsi512_si256(acc[t][r]);
      h[r][1] = _mm512_extracti64x4_epi64(acc[t][r], 1);
    }
    ep.template store<R>(h, m, n);
  }
}

// the last rows of a chunk: n (< kVnniRows) of them in one call
template <int NT, int R, typename OutT>
inline void rest_rows_vnni(const int8_t* a, int64_t K, const int8_t* wt, const Epilogue<OutT>& ep, int64_t m,
                           int64_t n, int64_t n0) {
  if constexpr (R >= 1) {
    if (n == R) return rows_vnni<R, NT>(a, K, wt, ep, m, n0);
    rest_rows_vnni<NT, R - 1>(a, K, wt, ep, m, n, n0);
  }
}

// rows m0 .. m1-1 against NT adjacent tiles: kVnniRows at a time, then the rest in one call
template <int NT, typename OutT>
inline void tiles_vnni(const int8_t* a, int64_t K, const int8_t* wt, const Epilogue<OutT>& ep, int64_t m0,
                       int64_t m1, int64_t n0) {
  int64_t m = m0;
  for (; m + kVnniRows <= m1; m += kVnniRows) rows_vnni<kVnniRows, NT>(a, K, wt, ep, m, n0);
  rest_rows_vnni<NT, kVnniRows - 1>(a, K, wt, ep, m, m1 - m, n0);
}

// the last tiles of a thread's range: n (< kVnniTiles) of them together
template <int NT = kVnniTiles - 1, typename OutT>
inline void rest_tiles_vnni(const int8_t* a, int64_t K, const int8_t* wt, const Epilogue<OutT>& ep, int64_t m0,
                            int64_t m1, int64_t n, int64_t n0) {
  if constexpr (NT >= 1) {
    if (n == NT) return tiles_vnni<NT>(a, K, wt, ep, m0, m1, n0);
    rest_tiles_vnni<NT - 1>(a, K, wt, ep, m0, m1, n, n0);
  }
}
#endif

// ep.zp: the zero point the sums must add back (kSigned without kVnni), 0 otherwise
template <bool kSigned, bool kVnni, typename OutT>
void run(const uint8_t* u, int64_t M, int64_t K, const int8_t* w, int64_t tiles, int32_t zp,
         const Epilogue<OutT>& ep) {
  std::vector<int8_t> q;
  const int8_t* a = reinterpret_cast<const int8_t*>(u);
  if (kSigned) {   // q = u - zp, once for all tiles, each checked to lie in [-127, 127]
    if (!kVnni) q.resize(M * K);
    int32_t lo = 0, hi = 0;
    for (int64_t i = 0; i < M * K; ++i) {
      const int32_t d = static_cast<int32_t>(u[i]) - zp;
      lo = std::min(lo, d);
      hi = std::max(hi, d);
      if (!kVnni) q[i] = static_cast<int8_t>(d);
    }
    // the sign trick cannot negate -128, and values past 127 do not fit int8
    TORCH_CHECK_VALUE(lo >= -127 && hi <= 127, "avx2_int8_linear: with 8-bit weights every x - zero_point must lie in "
                      "[-127, 127] (as quantize_per_token gives), found ", lo, " .. ", hi);
    if (!kVnni) a = q.data();
  }
  // rows a chunk: ~128 KiB of activations, a whole number of micro-kernel calls
  constexpr int64_t step = kVnni ? kVnniRows : kRows;
  const int64_t mchunk = std::max<int64_t>(step, (128 * 1024 / std::max<int64_t>(K, 1)) / step * step);
  // about 256 K multiply-adds per task; decode's M = 1 still splits the tiles
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(M * K * kCols, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += mchunk) {
      const int64_t m1 = std::min(M, m0 + mchunk);
#ifdef PAGEDLLM_VNNI
      if constexpr (kVnni) {   // kVnniTiles tiles at a time, then the rest together
        int64_t t = t0;
        for (; t + kVnniTiles <= t1; t += kVnniTiles)
          tiles_vnni<kVnniTiles>(a, K, w + t * K * kCols, ep, m0, m1, t * kCols);
        rest_tiles_vnni(a, K, w + t * K * kCols, ep, m0, m1, t1 - t, t * kCols);
        continue;
      }
#endif
      for (int64_t t = t0; t < t1; ++t) {
        const int8_t* wt = w + t * K * kCols;
        int64_t m = m0;
        for (; m + kRows <= m1; m += kRows) rows<kSigned, kRows>(a, K, wt, ep, m, t * kCols);
        switch (m1 - m) {
          case 3: rows<kSigned, 3>(a, K, wt, ep, m, t * kCols); break;
          case 2: rows<kSigned, 2>(a, K, wt, ep, m, t * kCols); break;
          case 1: rows<kSigned, 1>(a, K, wt, ep, m, t * kCols); break;
          default: break;
        }
      }
    }
  });
}

}  // namespace
#endif

bool avx2_int8_available() {
#ifdef PAGEDLLM_AVX2
  return true;
#else
  return false;
#endif
}

bool avx2_int8_vnni() {
#ifdef PAGEDLLM_VNNI
  return true;
#else
  return false;
#endif
}

at::Tensor avx2_int8_linear(at::Tensor x, at::Tensor w_packed, at::Tensor colsum, int64_t zero_point,
                               at::Tensor compensation, at::Tensor weight_scales, at::Tensor row_scales,
                               std::optional<at::Tensor> bias, bool out_bfloat16, bool seven_bit_weights) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kByte && x.is_contiguous(),
                    "avx2_int8_linear: x must be a contiguous uint8 CPU tensor [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK_VALUE(w_packed.device().is_cpu() && w_packed.dim() == 4 && w_packed.scalar_type() == at::kChar &&
                        w_packed.is_contiguous() && w_packed.size(2) == 16 && w_packed.size(3) == 4,
                    "avx2_int8_linear: w_packed must be a contiguous int8 [ceil(N/16), K/4, 16, 4] tensor");
  TORCH_CHECK_VALUE(w_packed.size(1) * 4 == K, "avx2_int8_linear: x has ", K, " columns, the weight ",
                    w_packed.size(1) * 4);
  TORCH_CHECK_VALUE(zero_point >= 0 && zero_point <= 255, "avx2_int8_linear: zero_point must be in [0, 255], got ",
                    zero_point);
  const int64_t tiles = w_packed.size(0), padded = tiles * 16;
  TORCH_CHECK_VALUE(colsum.device().is_cpu() && colsum.scalar_type() == at::kInt && colsum.is_contiguous() &&
                        colsum.dim() == 1,
                    "avx2_int8_linear: colsum must be a contiguous int32 CPU tensor [N]");
  const int64_t N = colsum.numel();
  TORCH_CHECK_VALUE(N <= padded && N > padded - 16, "avx2_int8_linear: colsum has ", N,
                    " columns, the packed weight ", padded, " (ceil(N/16) tiles of 16)");
  auto vec_ok = [](const at::Tensor& t, int64_t n) {
    return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 &&
           t.size(0) == n;
  };
  TORCH_CHECK_VALUE(vec_ok(compensation, N) && vec_ok(weight_scales, N),
                    "avx2_int8_linear: compensation and weight_scales must be contiguous float32 CPU tensors [N]");
  TORCH_CHECK_VALUE(vec_ok(row_scales, M), "avx2_int8_linear: row_scales must be a contiguous float32 CPU tensor [M]");
  if (bias.has_value())
    TORCH_CHECK_VALUE(vec_ok(*bias, N), "avx2_int8_linear: bias must be a contiguous float32 CPU tensor [N]");
  auto out = at::empty({M, N}, x.options().dtype(out_bfloat16 ? at::kBFloat16 : at::kFloat));
  if (M == 0 || N == 0) return out;
#ifdef PAGEDLLM_AVX2
  const uint8_t* up = x.data_ptr<uint8_t>();
  const int8_t* wp = w_packed.data_ptr<int8_t>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
#ifdef PAGEDLLM_VNNI
  constexpr bool vnni = true;
#else
  constexpr bool vnni = false;
#endif
  const int32_t zp = static_cast<int32_t>(zero_point), add_zp = seven_bit_weights || vnni ? 0 : zp;
  auto go = [&](auto* o) {
    using OutT = std::remove_pointer_t<decltype(o)>;
    const Epilogue<OutT> ep{o, N, N, add_zp, colsum.data_ptr<int32_t>(), compensation.data_ptr<float>(),
                            weight_scales.data_ptr<float>(), row_scales.data_ptr<float>(), b};
    if (seven_bit_weights) run<false, vnni>(up, M, K, wp, tiles, zp, ep);
    else run<true, vnni>(up, M, K, wp, tiles, zp, ep);
  };
  if (out_bfloat16) go(reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()));
  else go(out.data_ptr<float>());
  return out;
#else
  TORCH_CHECK(false, "avx2_int8_linear: the kernels were built without AVX2 (not this CPU)");
#endif
}
