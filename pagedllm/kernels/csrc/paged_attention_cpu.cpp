// Paged attention for the CPU over one flattened batch (PagedAttention, Kwon et al. 2023):
// every request's query tokens (one for a decode; a prompt, a prompt chunk on top of a
// cached prefix, or several speculative tokens otherwise) attend causally over the
// request's cached tokens, read in place through its block table: no gather into
// contiguous copies, no per-request call from Python. Query j of a request with
// context c (tokens cached before this step) sees keys 0 .. c + j, or with a sliding
// window w (a local layer) keys c + j - w + 1 .. c + j only: the keys before the window
// are never read (their blocks may have been released), and an item starts at the
// window of its first query rounded down to a multiple of 8 keys, so that each key keeps
// its lane of the 8-lane sums whatever the tiling (the keys of that rounding and of later
// queries' windows get a zero weight, which adds exact zeros; the rounding's keys read
// the first key of the window in their place, so no value outside it is ever loaded).
//
// q and out are float32 or bfloat16 (the model's dtype); the K/V cache is float32,
// bfloat16, fp8 E4M3 or fp8 E5M2, independently of q (``--kv-cache-dtype``), with one
// scale per tensor for K and for V (a cached value is element * scale; vLLM's k_scale and
// v_scale). Cache elements widen to float32 exactly as they load (vec.h: load8_raw), the
// scales are folded into the softmax scale (K) and the final 1 / sum (V), so the loops are
// the same for every cache type. Scores, softmax and the weighted sum of V in float32;
// out rounded once.
//
// Work items: (request, kv heads, query rows). A decode request is one item covering all
// its kv heads when there are many requests (each token's K/V row, all kv heads, is
// streamed once), one item per kv head when there are few. A request with several
// queries is split into items of one kv head and up to kQueryTile queries, longest first,
// dealt to the threads in turn (later queries see more keys). Per (query, head) row:
//   1. scores s_t = (q . k_t) * scale for t < L (L = c + j + 1), 8 keys at a time, each
//      dot product accumulated over head_dim in one fixed order;
//   2. p_t = exp(s_t - max s), sum in a fixed 8-lane order (vec.h);
//   3. out = (sum_t p_t v_t) / sum_t p_t, t in order.
// Every step depends only on that row's query and the request's cached K/V, never on the
// item it ran in, the other requests, the chunking of the prompt, or whether the keys
// were cached by an earlier step: attention is batch-invariant by construction.
//
// Two implementations of a row's maths, chosen at compile time per head size:
//  * AVX2+FMA, head_dim a multiple of 64 (bfloat16 and fp8 loads widened in registers,
//    fp8 through F16C): up to 3 heads of a kv head at once against 8 keys, folded by a
//    horizontal-add tree, 4 keys at a time; V summed a tile of keys (~12 KB of V rows;
//    for a decode ~6 KB and at least 16 keys; kept in L1) at a time for every row of the
//    item, 32 dims a pass in registers (24 for fp8 caches at 3 heads a kv head);
//    on a CPU with AVX-512 (F, BW, DQ, VL) the same two loops run in 16-lane vectors with
//    the same arithmetic, so the same bits: two keys' 8-lane score sums side by side, and
//    16 dims of V a vector (all 64 dims of 3 heads in one pass, in 32 registers);
//    on a CPU with AVX512-BF16, a bfloat16 model over a bfloat16 cache takes its scores
//    from VDPBF16PS instead (scores8_rows_dpbf16: bf16 pairs, no widening; other bits
//    than the float32 FMAs, the same for every item), unless AMX scores apply;
//  * generic (any head_dim or CPU): the same maths with GCC vector types.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <math.h>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(PAGEDLLM_AVX512)
#define PAGEDLLM_ATTN_DPBF16 1
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define PAGEDLLM_AMX_ATTN 1
#include <immintrin.h>
#endif

using pagedllm::bf16;
using pagedllm::from_f32;
using pagedllm::hsum8;
using pagedllm::fp8e4m3;
using pagedllm::fp8e5m2;
using pagedllm::load8;
using pagedllm::load8_raw;
using pagedllm::raw_f32;
using pagedllm::to_f32;
using pagedllm::v8;

namespace {

constexpr int64_t kQueryTile = 16;

// TQ: q and out (float or bf16); TC: the K/V cache (float, bf16, fp8e4m3, fp8e5m2).
template <typename TQ, typename TC>
struct Args {
  const TQ* q; const TC* k; const TC* v; TQ* out;
  const int32_t* bt; const int32_t* qsl; const int32_t* sl;
  int64_t nh, nkv, g, hd, mb, bs, k_slot, k_head, v_slot, v_head, q_tok;
  int64_t window;  // sliding window in keys, 0 = the whole context
  float scale;   // softmax scale * k_scale * kRawScale<TC>: applied to q . raw k
  float vscale;  // v_scale * kRawScale<TC>: applied with 1 / sum to sum p * raw v
  bool amx = false;  // scores by AMX tile products (scores_amx; bf16 q and cache only)
  bool dpbf16 = false;  // scores by VDPBF16PS (scores8_rows_dpbf16; bf16 q and cache only)
};

// paged_attention_set_dpbf16: whether a bf16 model over a bf16 cache takes its scores from
// VDPBF16PS where the CPU has AVX512-BF16 (scores8_rows_dpbf16); PAGEDLLM_AVX512_BF16=0 turns
// it off with the VDPBF16PS linears. Read once a call, so every item of a call agrees.
std::atomic<bool> g_dpbf16_scores{true};

// paged_attention_set_amx: whether a bf16 model over a bf16 cache may take its scores from
// AMX tiles (where the CPU has AMX-BF16); PAGEDLLM_AMX=0 turns it off with the linears.
std::atomic<bool> g_amx_scores{true};

// Whether the AVX2 path can read cache type TC (fp8 needs F16C; every AVX2 CPU has it).
template <typename TC> constexpr bool kAvxCache = true;
#ifndef PAGEDLLM_FP8_AVX
template <> constexpr bool kAvxCache<fp8e4m3> = false;
template <> constexpr bool kAvxCache<fp8e5m2> = false;
#endif

constexpr int64_t kPrefetchKeys = 16;     // how far ahead the score loop fetches K rows
// V bytes summed per tile (they stay in L1): a tile serves every row of an item. A decode
// item has few rows, so its tiles are smaller: the tile two on is fetched while one is
// summed, and a smaller fetch a kv head at a time keeps fewer loads outstanding at once
// (decode 1.04-1.49x from memory on the AMD EPYC, docs/benchmarks.md); items with many
// queries reuse a bigger tile more.
constexpr int64_t kValueTileBytes = 12288;
constexpr int64_t kDecodeValueTileBytes = 6144;

// Prefetch the cache lines of [p, p + bytes) into L1.
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

struct Item {
  int32_t req, kh0, kh1, j0, j1;  // request, kv heads [kh0, kh1), queries [j0, j1)
};

#ifdef PAGEDLLM_AVX2
// exp(x) of 8 lanes for the softmax numerators (x = s - max <= 0): Cephes' expf (S. L.
// Moshier, Cephes Math Library, expf.c): n = round(x log2 e), r = x - n ln 2 (ln 2 in two
// parts), exp(r) ~ 1 + r + r^2 P(r) (P of degree 5), times 2^n through the exponent
// bits; about 1 ulp. Lanes below -87.33 (2^n would leave the normal range; -inf: a key
// outside a window) give 0. A lane's result depends on that lane only, so a score's
// numerator does not depend on where it falls in the row, and scalar glibc expf (~25 %
// of a prompt's attention time) is no longer called.
inline __m256 exp8_avx(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}
#endif

#ifdef PAGEDLLM_AVX512
// exp8_avx on 16 lanes, the same operations in the same order (so the same bits a lane).
inline __m512 exp16_avx512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654f);
  const __m512 xc = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), y);
}
#endif

// Softmax numerators in place over s[0, L): s[i] = exp(s[i] - max); returns 1 / sum. With
// AVX2 every element goes through exp8_avx (AVX-512: exp16_avx512), the last partial
// vector through a padded copy (a masked load).
inline float softmax_numerators(float* s, int64_t L) {
  float m = -INFINITY;
  for (int64_t i = 0; i < L; ++i) m = std::max(m, s[i]);
#if defined(PAGEDLLM_AVX512)
  const __m512 mv = _mm512_set1_ps(m);
  int64_t i = 0;
  for (; i + 16 <= L; i += 16) _mm512_storeu_ps(s + i, exp16_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv)));
  if (i < L) {   // the last lanes; the others compute exp(m - m)
    const __mmask16 k = static_cast<__mmask16>((1u << (L - i)) - 1);
    _mm512_mask_storeu_ps(s + i, k, exp16_avx512(_mm512_sub_ps(_mm512_mask_loadu_ps(mv, k, s + i), mv)));
  }
#elif defined(PAGEDLLM_AVX2)
  const __m256 mv = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + 8 <= L; i += 8) _mm256_storeu_ps(s + i, exp8_avx(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv)));
  if (i < L) {
    alignas(32) float t[8];
    for (int u = 0; u < 8; ++u) t[u] = i + u < L ? s[i + u] : m;
    _mm256_store_ps(t, exp8_avx(_mm256_sub_ps(_mm256_load_ps(t), mv)));
    for (int64_t u = 0; i + u < L; ++u) s[i + u] = t[u];
  }
#else
  for (int64_t i = 0; i < L; ++i) s[i] = expf(s[i] - m);
#endif
  return 1.f / pagedllm::sum_f32(s, L);
}

// Per-thread scratch.
struct Scratch {
  std::vector<float> scores;
  std::vector<int64_t> slots;
  std::vector<float> acc;   // weighted sums of V, one hd row per (query, head) row
  std::vector<float> inv;   // 1 / softmax sum (times v_scale) per row
  std::vector<uint16_t> qb;  // scores_amx: the item's queries as AMX B tiles
  std::vector<int64_t> colrow;  // scores_amx: each B column's score row offset
  bool tiles = false;        // scores_amx: this thread's tile configuration is loaded
};

#ifdef PAGEDLLM_AVX2
using pagedllm::load8_avx;
using pagedllm::load8_raw_avx;
using pagedllm::store8_avx;

// Sum each of 4 vectors: returns {sum(x0), sum(x1), sum(x2), sum(x3)}, each by the tree
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of its lanes.
inline __m128 fold4(__m256 x0, __m256 x1, __m256 x2, __m256 x3) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x0, x1), _mm256_hadd_ps(x2, x3));
  // [s0l s1l s2l s3l | s0h s1h s2h s3h]: the low and high halves of each lane sum
  return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}

// Scores of G query heads that share one kv head (GQA) against 8 keys,
// s[r][u] = q_r . k_u * scale, 4 keys at a time. Each K vector loaded feeds G FMAs
// (G*4 accumulators in registers, folded and stored before the next 4 keys, so nothing
// spills). Every (head, key) dot product runs over d in one order and folds by one tree
// (fold4), whatever G is: a head's result does not depend on how many heads were computed
// with it.
template <int G, typename TQ, typename TC>
__attribute__((noinline)) void scores8_rows_avx(const TQ* const* qs, const TC* const* kr, int64_t off, int64_t hd,
                             float scale, float* const* s) {
  const __m128 sc = _mm_set1_ps(scale);
  for (int half = 0; half < 2; ++half) {
    __m256 c[G][4];
    for (int r = 0; r < G; ++r)
      for (int u = 0; u < 4; ++u) c[r][u] = _mm256_setzero_ps();
    const TC* k0 = kr[half * 4] + off;
    const TC* k1 = kr[half * 4 + 1] + off;
    const TC* k2 = kr[half * 4 + 2] + off;
    const TC* k3 = kr[half * 4 + 3] + off;
    for (int64_t d = 0; d < hd; d += 8) {
      // G*4 accumulators + G query vectors + one key vector: 16 registers at G = 3
      // (loading the four key vectors first spilled accumulators to the stack)
      __m256 qv[G];
      for (int r = 0; r < G; ++r) {
        qv[r] = load8_avx(qs[r] + d);
        // keep it in a register (GCC otherwise reloads it for every FMA), except for fp8
        // caches, whose widening holds a mask register: there the 17th register would
        // spill an accumulator into every iteration
        if constexpr (sizeof(TC) >= 2) asm("" : "+x"(qv[r]));
      }
      const TC* ku[4] = {k0, k1, k2, k3};
      for (int u = 0; u < 4; ++u) {
        __m256 x = load8_raw_avx(ku[u] + d);
        if constexpr (sizeof(TC) >= 2) asm("" : "+x"(x));   // one load, not one per FMA
        for (int r = 0; r < G; ++r) c[r][u] = _mm256_fmadd_ps(qv[r], x, c[r][u]);
      }
    }
    for (int r = 0; r < G; ++r)
      _mm_storeu_ps(s[r] + 4 * half, _mm_mul_ps(fold4(c[r][0], c[r][1], c[r][2], c[r][3]), sc));
  }
}

// One pass of a tile of the weighted sums of V over dims [d0, d0 + 8 * NV):
// acc_r[d] += p_r[t] * v_t[d] for t in [0, n), in order, for the G heads that share kv
// head vh. Per key the G weights are broadcast first, then each V vector, loaded once,
// feeds G FMAs: G*NV accumulators + G broadcasts + 1 V vector stay in registers (16 at
// G = 3, NV = 4: two passes of 32 dims for head_dim 64, where loading the NV V vectors
// first had room for NV = 3 only, three passes of 24, 24 and 16 dims, the last with 6
// FMA chains). More spilled an accumulator to the stack, which put a store-to-load round
// trip into every iteration.
template <int G, int NV, typename TC>
inline void accumulate_pass_avx(const float* const* p, const int64_t* slots, int64_t n, const TC* vh,
                                int64_t v_slot, int64_t d0, float* const* acc) {
  __m256 c[G * NV];
#pragma GCC unroll 16
  for (int i = 0; i < G * NV; ++i) c[i] = _mm256_loadu_ps(acc[i / NV] + d0 + 8 * (i % NV));
  for (int64_t t = 0; t < n; ++t) {
    const TC* vr = vh + slots[t] * v_slot + d0;
    __m256 pt[G];
#pragma GCC unroll 4
    for (int r = 0; r < G; ++r) pt[r] = _mm256_broadcast_ss(p[r] + t);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m256 x = load8_raw_avx(vr + 8 * v);
#pragma GCC unroll 4
      for (int r = 0; r < G; ++r) c[r * NV + v] = _mm256_fmadd_ps(pt[r], x, c[r * NV + v]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < G * NV; ++i) _mm256_storeu_ps(acc[i / NV] + d0 + 8 * (i % NV), c[i]);
}

// One tile of the weighted sums of V for G heads (acc rows are hd floats in the scratch),
// in passes of 8 * kValueVectors dims, then 16 and 8. The tile's V rows stay in L1
// across the passes, and the accumulators go back to the scratch between passes and
// tiles, which changes no bits: each (head, dim) sum is one FMA chain over t in order.
// fp8 caches keep 3 vectors a pass at G = 3: their widening holds a mask register, and
// 4 measured no faster.
template <int G, typename TC> constexpr int kValueVectors = (G == 3 && sizeof(TC) == 1) ? 3 : 4;

template <int G, typename TC>
__attribute__((noinline)) void accumulate_rows_avx(const float* const* p, const int64_t* slots, int64_t n,
                                                   const TC* vh, int64_t v_slot, int64_t hd, float* const* acc) {
  constexpr int NV = kValueVectors<G, TC>;
  int64_t d0 = 0;
  for (; d0 + 8 * NV <= hd; d0 += 8 * NV) accumulate_pass_avx<G, NV>(p, slots, n, vh, v_slot, d0, acc);
  for (; d0 + 16 <= hd; d0 += 16) accumulate_pass_avx<G, 2>(p, slots, n, vh, v_slot, d0, acc);
  for (; d0 < hd; d0 += 8) accumulate_pass_avx<G, 1>(p, slots, n, vh, v_slot, d0, acc);
}
#endif

#ifdef PAGEDLLM_AVX512
// The two functions above on AVX-512 with the same arithmetic, so the same bits:
//  * scores: each 16-lane accumulator holds two keys' 8-lane accumulators side by side
//    (keys 2p and 2p + 1), the query's 8 dims repeated in both halves, so every lane is
//    the same FMA chain over d as in scores8_rows_avx and the halves fold by fold4;
//  * weighted sums of V: 16 dims a vector, each lane one FMA chain over t in order, as
//    before; with 32 registers all 64 dims of G = 3 heads fit in one pass.
template <int G, typename TQ, typename TC>
__attribute__((noinline)) void scores8_rows_avx512(const TQ* const* qs, const TC* const* kr, int64_t off,
                                                   int64_t hd, float scale, float* const* s) {
  __m512 c[G][4];
  for (int r = 0; r < G; ++r)
    for (int p = 0; p < 4; ++p) c[r][p] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8) {
    __m512 qv[G];
    for (int r = 0; r < G; ++r) qv[r] = _mm512_broadcast_f32x8(load8_avx(qs[r] + d));
    for (int p = 0; p < 4; ++p) {
      const __m512 x = pagedllm::load8x2_raw_avx512(kr[2 * p] + off + d, kr[2 * p + 1] + off + d);
      for (int r = 0; r < G; ++r) c[r][p] = _mm512_fmadd_ps(qv[r], x, c[r][p]);
    }
  }
  const __m128 sc = _mm_set1_ps(scale);
  for (int r = 0; r < G; ++r)
    for (int half = 0; half < 2; ++half) {
      const __m512 a = c[r][2 * half], b = c[r][2 * half + 1];
      const __m128 f = fold4(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1),
                             _mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
      _mm_storeu_ps(s[r] + 4 * half, _mm_mul_ps(f, sc));
    }
}

#ifdef PAGEDLLM_ATTN_DPBF16
// acc + the pair dot products of a and b (bfloat16 pairs) per float32 lane: VDPBF16PS as
// _mm512_dpbf16_ps, written out so that GCC updates acc in its register.
inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// {sum of c[0]'s 16 lanes, ..., sum of c[7]'s}: 128-bit quarters summed across pairs of
// vectors, then across pairs of those, then the 4 lanes within each quarter; one fixed tree
// per lane, so a key's score does not depend on the keys summed beside it.
inline __m256 lane_sums8(const __m512 (&c)[8]) {
  __m512 p[4];
  for (int i = 0; i < 4; ++i)   // quarters (x0 + x2, x1 + x3) of c[2i] | of c[2i + 1]
    p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xEE));
  // quarter j: key j's 4 partial sums (a: keys 0-3, b: keys 4-7)
  const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], 0x88), _mm512_shuffle_f32x4(p[0], p[1], 0xDD));
  const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(p[2], p[3], 0x88), _mm512_shuffle_f32x4(p[2], p[3], 0xDD));
  // quarter j: (a0 + a2, b0 + b2, a1 + a3, b1 + b3), then lanes 0 and 1 the whole sums
  __m512 t = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, t));
}

// scores8_rows for a bfloat16 model over a bfloat16 cache on a CPU with AVX512-BF16: each
// (head, key) dot product is one VDPBF16PS chain over head_dim in 32-dim steps from zero
// (pairs of exact bf16 products, Intel SDM VDPBF16PS; subnormal inputs and results are
// flushed to zero, so a score made only of subnormal products is 0 where the float32 path
// keeps it), its 16 lanes then summed by lane_sums8, times the scale. No widening of q or
// K, and half the multiply instructions of the AVX-512 FMA path (one per 32 dims of a key
// against two per 16): ~2.5x fewer instructions for the scores in all. Every item of a
// call takes it (Args::dpbf16, decided once a call), so a row's bits still depend only
// on its query and the keys.
template <int G>
__attribute__((noinline)) void scores8_rows_dpbf16(const bf16* const* qs, const bf16* const* kr, int64_t off,
                                                   int64_t hd, float scale, float* const* s) {
  __m512 c[G][8];
  for (int r = 0; r < G; ++r)
    for (int u = 0; u < 8; ++u) c[r][u] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; d += 32) {
    __m512i qv[G];
    for (int r = 0; r < G; ++r) qv[r] = _mm512_loadu_si512(qs[r] + d);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      const __m512i x = _mm512_loadu_si512(kr[u] + off + d);
#pragma GCC unroll 4
      for (int r = 0; r < G; ++r) c[r][u] = dpbf16(c[r][u], qv[r], x);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int r = 0; r < G; ++r) _mm256_storeu_ps(s[r], _mm256_mul_ps(lane_sums8(c[r]), sc));
}
#endif

template <int G, int NV, typename TC>
inline void accumulate_pass_avx512(const float* const* p, const int64_t* slots, int64_t n, const TC* vh,
                                   int64_t v_slot, int64_t d0, float* const* acc) {
  __m512 c[G * NV];
#pragma GCC unroll 16
  for (int i = 0; i < G * NV; ++i) c[i] = _mm512_loadu_ps(acc[i / NV] + d0 + 16 * (i % NV));
  for (int64_t t = 0; t < n; ++t) {
    const TC* vr = vh + slots[t] * v_slot + d0;
    __m512 pt[G];
#pragma GCC unroll 4
    for (int r = 0; r < G; ++r) pt[r] = _mm512_set1_ps(p[r][t]);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m512 x = pagedllm::load16_raw_avx512(vr + 16 * v);
#pragma GCC unroll 4
      for (int r = 0; r < G; ++r) c[r * NV + v] = _mm512_fmadd_ps(pt[r], x, c[r * NV + v]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < G * NV; ++i) _mm512_storeu_ps(acc[i / NV] + d0 + 16 * (i % NV), c[i]);
}

template <int G, typename TC>
__attribute__((noinline)) void accumulate_rows_avx512(const float* const* p, const int64_t* slots, int64_t n,
                                                      const TC* vh, int64_t v_slot, int64_t hd, float* const* acc) {
  for (int64_t d0 = 0; d0 < hd; d0 += 64)   // hd is a multiple of 64 on this path
    accumulate_pass_avx512<G, 4>(p, slots, n, vh, v_slot, d0, acc);
}
#endif

// The generic versions of the two functions above (any head_dim).
template <typename TQ, typename TC>
inline void scores8_generic(const TQ* qj, const TC* const* kr, int64_t off, int64_t hd, float scale,
                            float* s) {
  for (int u = 0; u < 8; ++u) {
    const TC* kk = kr[u] + off;
    v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= hd; d += 8) acc += load8(qj + d) * load8_raw(kk + d);
    float x = hsum8(acc);
    for (; d < hd; ++d) x += to_f32(qj[d]) * raw_f32(kk[d]);
    s[u] = x * scale;
  }
}

template <typename TC>
inline void accumulate_generic(const float* p, const int64_t* slots, int64_t n, const TC* vh,
                               int64_t v_slot, int64_t hd, float* acc) {
  for (int64_t t = 0; t < n; ++t) {
    const TC* vr = vh + slots[t] * v_slot;
    const float pt = p[t];
    for (int64_t d = 0; d < hd; ++d) acc[d] += pt * raw_f32(vr[d]);
  }
}

#ifdef PAGEDLLM_AMX_ATTN
// Scores by AMX-BF16 tile products (Intel Architecture Instruction Set Extensions
// Programming Reference, "Intel AMX", TDPBF16PS), for a bf16 model over a bf16 cache:
// S^T = K Q^T a kv head at a time. A tile: 16 keys of one block (16 cache rows of 32 dims,
// read in place at the slot stride); B tile: 16 (query, head) rows of the item as the
// columns, in the VNNI pair layout (row r holds, per column n, dims 2r and 2r + 1 of the
// 32); C: 16 keys x 16 columns in float32. Each score is one chain of TDPBF16PS over
// head_dim in 32-dim steps from zero (every bf16 product exact in float32), then times
// the scale, as the vector paths' dot product is: a column's result depends on its own
// query and the keys only, never on the other columns of the tile (padding columns are
// zeros), nor on the item's query count. So decodes, prompt chunks, speculative
// verification and cached prefixes all give the same bits, and every item on a CPU with
// AMX-BF16 takes this path. Keys past the item's last (a partial last tile) compute
// scores that are never read. Needs head_dim % 32 == 0 and block_size % 16 == 0 (a tile's
// 16 keys lie in one block), and no sliding window (the tiles start at key 0).
// Tiles: 0-2 accumulators (three column groups of 16 per A tile), 4 A, 5-7 B.

// Up to three column groups (NG) of one key tile: c[gi] receives 16 keys x 16 columns.
template <int NG>
inline void key_tile_scores(const bf16* krow, int64_t k_stride_bytes, const uint16_t* qb, int64_t kbn,
                            float (*c)[256]) {
  _tile_zero(0);
  if constexpr (NG > 1) _tile_zero(1);
  if constexpr (NG > 2) _tile_zero(2);
  for (int64_t kb = 0; kb < kbn; ++kb) {
    _tile_loadd(4, krow + 32 * kb, k_stride_bytes);
    _tile_loadd(5, qb + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NG > 1) {
      _tile_loadd(6, qb + (kbn + kb) * 512, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NG > 2) {
      _tile_loadd(7, qb + (2 * kbn + kb) * 512, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  if constexpr (NG > 1) _tile_stored(1, c[1], 64);
  if constexpr (NG > 2) _tile_stored(2, c[2], 64);
}

// The scores of an item (as the vector paths write them: row r of sc.scores, keys from 0,
// row stride Lp), for keys [0, Lw).
template <typename TQ, typename TC>
void scores_amx(const Args<TQ, TC>& a, const Item& it, Scratch& sc, int64_t q0, int64_t Lw, int64_t Lp) {
  if (!sc.tiles) {
    amx_load_tile_config();   // every tile 16 rows x 64 bytes, as the AMX linears use them
    sc.tiles = true;
  }
  const int64_t g = a.g, hd = a.hd, kbn = hd / 32, nkh = it.kh1 - it.kh0, nq = it.j1 - it.j0;
  const int64_t cols = nq * g, groups = (cols + 15) / 16;   // columns a kv head, 16 a group
  // qb[((kh - kh0) * groups + group) * kbn + kb]: one 16 x 32 B tile (512 bf16)
  sc.qb.assign(nkh * groups * kbn * 512, 0);
  for (int64_t kh = it.kh0; kh < it.kh1; ++kh)
    for (int64_t col = 0; col < cols; ++col) {
      const int64_t j = it.j0 + col / g, hh = col % g;
      const uint16_t* qr = reinterpret_cast<const uint16_t*>(a.q + (q0 + j) * a.q_tok + (kh * g + hh) * hd);
      uint16_t* t = sc.qb.data() + ((kh - it.kh0) * groups + col / 16) * kbn * 512 + 2 * (col % 16);
      for (int64_t kb = 0; kb < kbn; ++kb)
        for (int64_t r = 0; r < 16; ++r) {
          t[kb * 512 + r * 32] = qr[32 * kb + 2 * r];
          t[kb * 512 + r * 32 + 1] = qr[32 * kb + 2 * r + 1];
        }
    }
  // score row of each column, kv head kh0 (+ (kh - kh0) * g * Lp for the others)
  sc.colrow.resize(cols);
  for (int64_t col = 0; col < cols; ++col) sc.colrow[col] = ((col / g) * nkh * g + col % g) * Lp;
  const int32_t* brow = a.bt + it.req * a.mb;
  const int64_t kstride = a.k_slot * static_cast<int64_t>(sizeof(TC));
  const __m512i key_idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
  const __m512 scale = _mm512_set1_ps(a.scale);
  const int64_t head_bytes = hd * static_cast<int64_t>(sizeof(TC));
  alignas(64) float c[3][256];
  for (int64_t kh = it.kh0; kh < it.kh1; ++kh) {
    const bf16* kbase = reinterpret_cast<const bf16*>(a.k) + kh * a.k_head;
    for (int64_t t0 = 0; t0 < Lw; t0 += 16) {
      const bf16* krow = kbase + (static_cast<int64_t>(brow[t0 / a.bs]) * a.bs + t0 % a.bs) * a.k_slot;
      if (t0 + 16 < Lw) {   // the next tile's K rows of this head (a decode's come from memory)
        const int64_t t1 = t0 + 16;
        const char* nrow = reinterpret_cast<const char*>(
            kbase + (static_cast<int64_t>(brow[t1 / a.bs]) * a.bs + t1 % a.bs) * a.k_slot);
        for (int u = 0; u < 16; ++u) prefetch_span(nrow + u * kstride, head_bytes);
      }
      const __mmask16 keys = static_cast<__mmask16>((1u << std::min<int64_t>(16, Lw - t0)) - 1);
      float* srow = sc.scores.data() + (kh - it.kh0) * g * Lp + t0;
      for (int64_t g0 = 0; g0 < groups; g0 += 3) {
        const int ng = static_cast<int>(std::min<int64_t>(3, groups - g0));
        const uint16_t* qb = sc.qb.data() + ((kh - it.kh0) * groups + g0) * kbn * 512;
        if (ng == 3) key_tile_scores<3>(krow, kstride, qb, kbn, c);
        else if (ng == 2) key_tile_scores<2>(krow, kstride, qb, kbn, c);
        else key_tile_scores<1>(krow, kstride, qb, kbn, c);
        // column n of c[gi] (its 16 keys, 16 floats apart) times the scale, into its row
        for (int gi = 0; gi < ng; ++gi)
          for (int64_t n = 0, col = (g0 + gi) * 16; n < 16 && col < cols; ++n, ++col)
            _mm512_mask_storeu_ps(srow + sc.colrow[col], keys,
                                  _mm512_mul_ps(_mm512_i32gather_ps(key_idx, c[gi] + n, 4), scale));
      }
    }
  }
}
#endif

template <typename TQ, typename TC>
void attend(const Args<TQ, TC>& a, const Item& it, Scratch& sc) {
  const int64_t n = it.req;
  const int64_t q0 = a.qsl[n], qlen = a.qsl[n + 1] - q0;
  const int64_t ctx = a.sl[n] - qlen;
  const int64_t g = a.g, hd = a.hd, bs = a.bs;
  const int64_t nq = it.j1 - it.j0;
  const int64_t Lmax = ctx + it.j1;             // keys the last query of the item sees
  // the first query's first key (0 without a window), and the item's first key: that,
  // rounded down to a multiple of 8
  const int64_t W0 = a.window > 0 ? std::max<int64_t>(0, ctx + it.j0 + 1 - a.window) : 0;
  const int64_t T0 = W0 - W0 % 8;
  const int64_t Lw = Lmax - T0;                 // keys of the item, from T0
  const int64_t Lp = (Lw + 7) / 8 * 8;          // score row stride: whole 8-key chunks
  const int64_t nkh = it.kh1 - it.kh0;
  const int64_t rows = nq * nkh * g;            // (query, head) rows of this item
#ifdef PAGEDLLM_AVX2
  const bool avx = hd % 64 == 0 && kAvxCache<TC>;
#else
  const bool avx = false;
#endif
  sc.scores.resize(rows * Lp);
  // key index (from T0) -> cache slot, once per item; the padding repeats the last key
  sc.slots.resize(Lp);
  const int32_t* brow = a.bt + n * a.mb;
  for (int64_t t = T0; t < Lmax; ++t) sc.slots[t - T0] = static_cast<int64_t>(brow[t / bs]) * bs + t % bs;
  for (int64_t t = Lw; t < Lp; ++t) sc.slots[t] = sc.slots[Lw - 1];
  // The keys of the rounding down to T0 lie before every query's window: their blocks
  // may have been released (the null block, never written: any bits, NaN included, and
  // 0 * NaN is NaN). They get a zero weight, so they read the first key of the first
  // query's window instead (live, finite): the same exact zeros, from memory that holds
  // a key. As the torch backend pads with the request's own keys.
  for (int64_t t = 0; t < W0 - T0; ++t) sc.slots[t] = sc.slots[W0 - T0];
  const int64_t* slots = sc.slots.data();
  // bytes of one key's V slice for this item's kv heads
  const int64_t v_span = ((it.kh1 - it.kh0 - 1) * a.v_head + hd) * static_cast<int64_t>(sizeof(TC));
  // row r = ((j - j0) * nkh + (kh - kh0)) * g + hh
  auto qrow = [&](int64_t j, int64_t kh, int64_t hh) {
    return a.q + (q0 + j) * a.q_tok + (kh * g + hh) * hd;
  };
  // ---- 1. scores, 8 keys at a time: K rows read once per chunk for all rows ----
  bool scored = false;
#ifdef PAGEDLLM_AMX_ATTN
  if constexpr (std::is_same_v<TQ, bf16> && std::is_same_v<TC, bf16>)
    if (a.amx) {
      scores_amx(a, it, sc, q0, Lw, Lp);
      scored = true;
    }
#endif
  const int64_t k_head_bytes = hd * static_cast<int64_t>(sizeof(TC));
  for (int64_t t0 = 0; t0 < Lw && !scored; t0 += 8) {
    const TC* kr[8];
    for (int64_t u = 0; u < 8; ++u) kr[u] = a.k + slots[t0 + u] * a.k_slot;
    // the K rows of the chunk kPrefetchKeys ahead (a decode's keys come from memory: one
    // row slice per key, strided by the slot, which the hardware prefetchers miss), one kv
    // head's slices before that head's scores, so that the loads in flight at a time stay
    // few (the first query that sees this chunk issues them)
    bool fetch = t0 + kPrefetchKeys < Lw;
    for (int64_t j = it.j0; j < it.j1; ++j) {
      if (T0 + t0 >= ctx + j + 1) continue;   // past this query's causal limit
      for (int64_t kh = it.kh0; kh < it.kh1; ++kh) {
        if (fetch)
          for (int64_t u = 0; u < 8; ++u)
            prefetch_span(a.k + slots[t0 + kPrefetchKeys + u] * a.k_slot + kh * a.k_head, k_head_bytes);
        const int64_t r0 = ((j - it.j0) * nkh + (kh - it.kh0)) * g;
#ifdef PAGEDLLM_AVX2
        if constexpr (kAvxCache<TC>) if (avx) {
          // the g heads of this kv head, up to 3 at a time
          for (int64_t hh = 0; hh < g; hh += 3) {
            const TQ* qs[3];
            float* ss[3];
            const int64_t G = std::min<int64_t>(3, g - hh);
            for (int64_t r = 0; r < G; ++r) {
              qs[r] = qrow(j, kh, hh + r);
              ss[r] = sc.scores.data() + (r0 + hh + r) * Lp + t0;
            }
#ifdef PAGEDLLM_ATTN_DPBF16
            if constexpr (std::is_same_v<TQ, bf16> && std::is_same_v<TC, bf16>) if (a.dpbf16) {
              if (G == 3) scores8_rows_dpbf16<3>(qs, kr, kh * a.k_head, hd, a.scale, ss);
              else if (G == 2) scores8_rows_dpbf16<2>(qs, kr, kh * a.k_head, hd, a.scale, ss);
              else scores8_rows_dpbf16<1>(qs, kr, kh * a.k_head, hd, a.scale, ss);
              continue;
            }
#endif
#ifdef PAGEDLLM_AVX512
            if (G == 3) scores8_rows_avx512<3>(qs, kr, kh * a.k_head, hd, a.scale, ss);
            else if (G == 2) scores8_rows_avx512<2>(qs, kr, kh * a.k_head, hd, a.scale, ss);
            else scores8_rows_avx512<1>(qs, kr, kh * a.k_head, hd, a.scale, ss);
#else
            if (G == 3) scores8_rows_avx<3>(qs, kr, kh * a.k_head, hd, a.scale, ss);
            else if (G == 2) scores8_rows_avx<2>(qs, kr, kh * a.k_head, hd, a.scale, ss);
            else scores8_rows_avx<1>(qs, kr, kh * a.k_head, hd, a.scale, ss);
#endif
          }
          continue;
        }
#endif
        for (int64_t hh = 0; hh < g; ++hh)
          scores8_generic(qrow(j, kh, hh), kr, kh * a.k_head, hd, a.scale,
                          sc.scores.data() + (r0 + hh) * Lp + t0);
      }
      fetch = false;
    }
  }
  // ---- 2. softmax numerators in place, and 1 / sum, per row ----
  sc.inv.resize(rows);
  for (int64_t j = it.j0; j < it.j1; ++j) {
    const int64_t L = ctx + j + 1 - T0;          // this query's keys, from T0
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, L - a.window) : 0;   // before its window
    const int64_t r0 = (j - it.j0) * nkh * g;
    for (int64_t r = r0; r < r0 + nkh * g; ++r) {
      float* p = sc.scores.data() + r * Lp;
      for (int64_t t = 0; t < lo; ++t) p[t] = -INFINITY;
      sc.inv[r] = softmax_numerators(p, L) * a.vscale;   // vscale 1 for float32/bf16 caches
    }
  }
  // ---- 3. weighted sums of V, a tile of keys at a time for every row of the item ----
  // Each tile's V rows (all the item's kv heads) are read from memory once and used by
  // every row while they are in L1; the tile two on is fetched meanwhile,
  // and the first ones while the softmax above ran.
  sc.acc.assign(rows * hd, 0.f);
  // keys a tile: ~kValueTileBytes of V rows (32 keys of SmolLM2's 3 kv heads in bf16;
  // 16 for a decode, and no fewer: with float32 rows 8-key tiles made the sums' passes
  // 0.8x as fast when K/V were already in cache, and were level from memory)
  const int64_t tile_bytes = nq == 1 ? kDecodeValueTileBytes : kValueTileBytes;
  const int64_t tile = std::clamp<int64_t>(tile_bytes / std::max<int64_t>(v_span, 1), nq == 1 ? 16 : 8, 64);
  const int64_t ahead = 2 * tile;
  const int64_t v_head_bytes = hd * static_cast<int64_t>(sizeof(TC));
  for (int64_t t = 0; t < std::min(Lw, ahead); ++t)
    prefetch_span(a.v + slots[t] * a.v_slot + it.kh0 * a.v_head, v_span);
  for (int64_t t0 = 0; t0 < Lw; t0 += tile) {
    // the tile two on, one kv head's slices before that head's sums (as the scores above)
    bool fetch = t0 + ahead < Lw;
    for (int64_t j = it.j0; j < it.j1; ++j) {
      const int64_t L = ctx + j + 1 - T0;
      if (t0 >= L) continue;                       // past this query's causal limit
      const int64_t n_t = std::min(L, t0 + tile) - t0;
      for (int64_t kh = it.kh0; kh < it.kh1; ++kh) {
        if (fetch)
          for (int64_t t = t0 + ahead; t < std::min(Lw, t0 + ahead + tile); ++t)
            prefetch_span(a.v + slots[t] * a.v_slot + kh * a.v_head, v_head_bytes);
        const TC* vh = a.v + kh * a.v_head;
        const int64_t r0 = ((j - it.j0) * nkh + (kh - it.kh0)) * g;
        for (int64_t hh = 0; hh < g; hh += 3) {
          const int64_t G = std::min<int64_t>(3, g - hh);
          const float* ps[3];
          float* accs[3];
          for (int64_t r = 0; r < G; ++r) {
            ps[r] = sc.scores.data() + (r0 + hh + r) * Lp + t0;
            accs[r] = sc.acc.data() + (r0 + hh + r) * hd;
          }
#ifdef PAGEDLLM_AVX2
          if constexpr (kAvxCache<TC>) if (avx) {
#ifdef PAGEDLLM_AVX512
            if (G == 3) accumulate_rows_avx512<3>(ps, slots + t0, n_t, vh, a.v_slot, hd, accs);
            else if (G == 2) accumulate_rows_avx512<2>(ps, slots + t0, n_t, vh, a.v_slot, hd, accs);
            else accumulate_rows_avx512<1>(ps, slots + t0, n_t, vh, a.v_slot, hd, accs);
#else
            if (G == 3) accumulate_rows_avx<3>(ps, slots + t0, n_t, vh, a.v_slot, hd, accs);
            else if (G == 2) accumulate_rows_avx<2>(ps, slots + t0, n_t, vh, a.v_slot, hd, accs);
            else accumulate_rows_avx<1>(ps, slots + t0, n_t, vh, a.v_slot, hd, accs);
#endif
            continue;
          }
#endif
          for (int64_t r = 0; r < G; ++r)
            accumulate_generic(ps[r], slots + t0, n_t, vh, a.v_slot, hd, accs[r]);
        }
      }
      fetch = false;
    }
  }
  // ---- 4. out = acc / sum, rounded once ----
  for (int64_t j = it.j0; j < it.j1; ++j)
    for (int64_t kh = it.kh0; kh < it.kh1; ++kh)
      for (int64_t hh = 0; hh < g; ++hh) {
        const int64_t r = ((j - it.j0) * nkh + (kh - it.kh0)) * g + hh;
        const float* acc = sc.acc.data() + r * hd;
        TQ* o = a.out + ((q0 + j) * a.nh + kh * g + hh) * hd;
        const float inv = sc.inv[r];
#ifdef PAGEDLLM_AVX2
        if constexpr (kAvxCache<TC>) if (avx) {
          const __m256 iv = _mm256_set1_ps(inv);
          for (int64_t d = 0; d < hd; d += 8) store8_avx(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), iv));
          continue;
        }
#endif
        for (int64_t d = 0; d < hd; ++d) o[d] = from_f32<TQ>(acc[d] * inv);
      }
}

template <typename TQ, typename TC>
void run(const Args<TQ, TC>& a, int64_t num_reqs) {
  // Plan the work items (cheap: one per decode, or per kv head and query tile).
  std::vector<Item> items;
  int64_t decodes = 0;
  for (int64_t n = 0; n < num_reqs; ++n) decodes += (a.qsl[n + 1] - a.qsl[n]) == 1;
  const int64_t threads = at::get_num_threads();
  const bool split_decode_heads = decodes < 2 * threads;
  for (int64_t n = 0; n < num_reqs; ++n) {
    const int32_t qlen = a.qsl[n + 1] - a.qsl[n];
    if (qlen == 0) continue;
    if (qlen == 1 && !split_decode_heads) {
      items.push_back({static_cast<int32_t>(n), 0, static_cast<int32_t>(a.nkv), 0, 1});
      continue;
    }
    for (int32_t kh = 0; kh < a.nkv; ++kh)
      for (int32_t j0 = 0; j0 < qlen; j0 += kQueryTile)
        items.push_back({static_cast<int32_t>(n), kh, kh + 1, j0,
                         static_cast<int32_t>(std::min<int64_t>(qlen, j0 + kQueryTile))});
  }
  // Longest items first, dealt in turn to the threads, so that a long prompt's last tiles
  // do not finish alone at the end of the step.
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
    const int64_t cx = (a.sl[x.req] - (a.qsl[x.req + 1] - a.qsl[x.req]) + x.j1) * (x.j1 - x.j0) * (x.kh1 - x.kh0);
    const int64_t cy = (a.sl[y.req] - (a.qsl[y.req + 1] - a.qsl[y.req]) + y.j1) * (y.j1 - y.j0) * (y.kh1 - y.kh0);
    return cx > cy;
  });
  // Items dealt round-robin (thread t takes items t, t + n, ...), through ATen's thread
  // pool like torch's own ops.
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, count));
  at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t w = t; w < count; w += nt) attend(a, items[w], sc);
#ifdef PAGEDLLM_AMX_ATTN
    if (sc.tiles) _tile_release();
#endif
  });
}

template <typename TQ, typename TC>
void launch(at::Tensor out, at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
            at::Tensor block_table, at::Tensor query_start_loc, at::Tensor seq_lens,
            int64_t num_reqs, int64_t block_size, double scale, double k_scale, double v_scale,
            int64_t window) {
  Args<TQ, TC> a;
  a.window = window;
  a.nh = q.size(1); a.hd = q.size(2); a.nkv = key_cache.size(1);
  a.q_tok = q.stride(0);
  a.g = a.nh / a.nkv; a.mb = block_table.size(1); a.bs = block_size;
  a.k_slot = key_cache.stride(0); a.k_head = key_cache.stride(1);
  a.v_slot = value_cache.stride(0); a.v_head = value_cache.stride(1);
  a.q = q.data_ptr<TQ>(); a.k = key_cache.data_ptr<TC>(); a.v = value_cache.data_ptr<TC>();
  a.out = out.data_ptr<TQ>(); a.bt = block_table.data_ptr<int32_t>();
  a.qsl = query_start_loc.data_ptr<int32_t>(); a.sl = seq_lens.data_ptr<int32_t>();
  a.scale = static_cast<float>(scale * k_scale * pagedllm::kRawScale<TC>);
  a.vscale = static_cast<float>(v_scale * pagedllm::kRawScale<TC>);
  a.amx = paged_attention_amx_applies(q.scalar_type(), key_cache.scalar_type(), a.hd, block_size, window);
  a.dpbf16 = !a.amx && paged_attention_dpbf16_applies(q.scalar_type(), key_cache.scalar_type(), a.hd);
  run(a, num_reqs);
}

template <typename TQ>
void launch_for_cache(at::Tensor out, at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                      at::Tensor block_table, at::Tensor query_start_loc, at::Tensor seq_lens,
                      int64_t num_reqs, int64_t block_size, double scale, double k_scale, double v_scale,
                      int64_t window) {
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      return launch<TQ, float>(out, q, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                               num_reqs, block_size, scale, k_scale, v_scale, window);
    case at::kBFloat16:
      return launch<TQ, bf16>(out, q, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                              num_reqs, block_size, scale, k_scale, v_scale, window);
    case at::kFloat8_e4m3fn:
      return launch<TQ, fp8e4m3>(out, q, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                 num_reqs, block_size, scale, k_scale, v_scale, window);
    case at::kFloat8_e5m2:
      return launch<TQ, fp8e5m2>(out, q, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                 num_reqs, block_size, scale, k_scale, v_scale, window);
    default:
      TORCH_CHECK(false, "the caches must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
  }
}

}  // namespace

void paged_attention_set_amx(bool on) { g_amx_scores = on; }

void paged_attention_set_dpbf16(bool on) { g_dpbf16_scores = on; }

bool paged_attention_dpbf16_applies(at::ScalarType q_dtype, at::ScalarType cache_dtype, int64_t head_dim) {
#ifdef PAGEDLLM_ATTN_DPBF16
  return g_dpbf16_scores && q_dtype == at::kBFloat16 && cache_dtype == at::kBFloat16 && head_dim % 64 == 0;
#else
  return false;
#endif
}

bool paged_attention_amx_applies(at::ScalarType q_dtype, at::ScalarType cache_dtype, int64_t head_dim,
                                 int64_t block_size, int64_t sliding_window) {
#ifdef PAGEDLLM_AMX_ATTN
  return g_amx_scores && q_dtype == at::kBFloat16 && cache_dtype == at::kBFloat16 && head_dim % 32 == 0 &&
         block_size % 16 == 0 && sliding_window == 0 && amx_bf16_available();
#else
  return false;
#endif
}

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                     at::Tensor value_cache, at::Tensor block_table,
                     at::Tensor query_start_loc, at::Tensor seq_lens, int64_t block_size,
                     double scale, double k_scale, double v_scale, int64_t sliding_window) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0 = none)");
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == dt, "q and out must have the same dtype");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "the K and V caches must have the same dtype");
  TORCH_CHECK(pagedllm::positive_finite(k_scale) && pagedllm::positive_finite(v_scale),
              "k_scale and v_scale must be finite and > 0");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && key_cache.dim() == 3 && value_cache.dim() == 3,
              "q/out [T, heads, dim], caches [slots, kv_heads, dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "each token's q heads must be contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous, q's shape");
  TORCH_CHECK(key_cache.stride(2) == 1 && value_cache.stride(2) == 1, "cache rows must be contiguous");
  TORCH_CHECK(key_cache.size(2) == q.size(2) && value_cache.size(2) == q.size(2) &&
              value_cache.size(1) == key_cache.size(1), "head shapes disagree");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(), "block_table int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous(),
              "query_start_loc int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens int32");
  TORCH_CHECK(q.size(1) % key_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == B + 1 && block_table.size(0) >= B, "batch sizes disagree");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == q.size(0), "query_start_loc must run from 0 to T");
  const int64_t slots = key_cache.size(0), mb = block_table.size(1);
  for (int64_t n = 0; n < B; ++n) {
    const int64_t qlen = qsl[n + 1] - qsl[n];
    TORCH_CHECK(qlen >= 0 && sl[n] >= qlen, "request ", n, ": seq_len ", sl[n], " < query length ", qlen);
    TORCH_CHECK((sl[n] + block_size - 1) / block_size <= mb, "request ", n, ": block table too short");
    const int32_t* row = block_table.data_ptr<int32_t>() + n * mb;
    for (int64_t b = 0; b < (sl[n] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(row[b] >= 0 && (row[b] + 1) * block_size <= slots, "request ", n, ": block ",
                  row[b], " out of range");
  }
  if (dt == at::kFloat)
    launch_for_cache<float>(out, q, key_cache, value_cache, block_table, query_start_loc, seq_lens, B,
                            block_size, scale, k_scale, v_scale, sliding_window);
  else
    launch_for_cache<bf16>(out, q, key_cache, value_cache, block_table, query_start_loc, seq_lens, B,
                           block_size, scale, k_scale, v_scale, sliding_window);
}
