// Linear layers whose weights stay in GGUF's block formats Q8_0, Q4_0 and Q4_1 (ggml's
// ggml-common.h block_q8_0 / block_q4_0 / block_q4_1; 32 weights per block along the
// input dimension K):
//   Q8_0: fp16 d, int8 q[32]                 (34 bytes)  w = d * q
//   Q4_0: fp16 d, uint8 qs[16]               (18 bytes)  w = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, uint8 qs[16]       (20 bytes)  w = d * q + m
// where, for the 4-bit formats, byte j of qs holds element j in its low nibble and
// element j + 16 in its high nibble. A weight row n is K/32 consecutive blocks.
//
// The arithmetic is llama.cpp's CPU scheme (ggml_vec_dot_q4_1_q8_1 and friends), written
// afresh:
//  1. Each activation row is quantized per 32-element block b: amax = max |x_i|,
//     d_x = amax * (1/127), q_i = round_half_even(x_i / d_x) (computed as x_i * (1/d_x),
//     0 when d_x == 0), clamped to [-127, 127]; the block also keeps S = sum q_i (int)
//     and s_x = d_x * S (Q8_1's s, for Q4_1).
//  2. Per (row, column, block), the integer dot I = sum_i qw_i * q_i is exact in int32
//     (Q4_0: sum (qw_i - 8) q_i, computed as sum qw_i q_i - 8 S).
//  3. acc = fma(d_w * d_x, float(I), acc) over the blocks b = 0, 1, ... in order from
//     acc = 0; Q4_1 also accm = fma(m_w, s_x, accm) in a second sum from 0 (two chains
//     of dependent fma instead of one twice as long), and acc = acc + accm after the last
//     block; the output is acc (+ bias), stored as float32 or rounded to bfloat16
//     (vec.h's from_f32).
// Step 3's float operations are the same, in the same order, in the AVX2 path and the
// portable scalar path (explicit fma in both), so the two agree bit for bit when the
// compiler keeps them as written; the tests allow float rounding between them anyway.
// Every output element depends only on its own row of x and column of w, through a
// reduction whose order is fixed by K alone: rows are batch-invariant.
//
// AVX2 integer dots: _mm256_maddubs_epi16 multiplies unsigned by signed bytes and adds
// adjacent pairs into int16 with saturation, so the ranges must keep |pair| <= 32767:
//  * Q4_x: unsigned nibbles [0, 15] x activations [-127, 127]: |pair| <= 2*15*127 = 3810;
//  * Q8_0: |w| as unsigned [0, 128] (abs(-128) reads as 128) x sign(x, w) in [-127, 127]:
//    |pair| <= 2*128*127 = 32512. (The other way round, abs(x) x sign(w, x), would turn
//    w = -128 into +128, which int8 cannot hold.)
// Q8_0 widens each maddubs result to int32 at once (_mm256_madd_epi16 with ones); Q4_x
// first adds two maddubs results (<= 7620) and two rounds of adjacent int16 lanes
// (<= 15240, then <= 30480: no wrap) before widening. A block's dot, at most
// 32*128*127, is far inside int32.
//
// Layout of the work: columns are taken 8 at a time (a tile); a tile's weights are
// unpacked once into a small L1-resident buffer (nibbles to bytes, fp16 scales to
// float32, two columns per register: see Tile) and then reused by every row of x, each
// row giving 8 outputs (one per AVX2 lane) whose per-block integer dots are summed
// across lanes by horizontal adds. Threads (at::parallel_for) split the tiles; rows are
// taken in chunks so that the quantized activations of a chunk stay in L2.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

using pagedllm::bf16;
using pagedllm::from_f32;
using pagedllm::to_f32;

// the AVX2 path also converts fp16 scales with F16C (every AVX2 CPU has it)
#if defined(PAGEDLLM_AVX2) && defined(__F16C__)
#define BQ_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;        // weights per block
constexpr int64_t TILE = 8;       // output columns per tile (one AVX2 float lane each)
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // ggml type ids (GGMLQuantizationType)
constexpr float kInv127 = 1.0f / 127.0f;
constexpr int64_t kPrefetchTiles = 2;  // how far ahead unpack_tile prefetches w
// below this many rows no tile is unpacked (row_times_packed): at 4 rows and more the
// unpacked tile is faster (4 rows: 10.3 vs 11.5 ms for SmolLM2's 120 layer products)
constexpr int64_t kDirectRows = 4;

int64_t block_bytes(int64_t fmt) {
  switch (fmt) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: return -1;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Activations of M rows quantized per block (step 1 above).
struct QuantAct {
  int64_t M = 0, K = 0, nb = 0;
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, nb]  d_x
  std::vector<float> s;      // [M, nb]  s_x = d_x * S
  std::vector<int32_t> sum;  // [M, nb]  S
};

// v, hidden from the optimiser: under -ffast-math GCC would otherwise rewrite
// 1 / (amax * (1/127)) as 127 / amax, or x * (1/d) as x / d, which round differently
// (another q at a near-tie) from the torch reference's operations as written.
inline float opaque(float v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(v));
  return v;
#else
  volatile float t = v;
  return t;
#endif
}

// One block's scale from its largest magnitude, and the multiplier that quantizes it.
inline void block_scale(float amax, float& d, float& id) {
  d = opaque(amax * kInv127);
  id = opaque(d != 0.f ? 1.f / d : 0.f);
}

template <typename T>
void quantize_row_scalar(const T* x, int64_t nb, int8_t* q, float* d, float* s, int32_t* sum) {
  for (int64_t b = 0; b < nb; ++b) {
    const T* xb = x + b * QK;
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(to_f32(xb[i])));
    float db, id;
    block_scale(amax, db, id);
    int32_t total = 0;
    for (int i = 0; i < QK; ++i) {
      float v = std::nearbyint(to_f32(xb[i]) * id);   // round half to even
      v = std::min(127.f, std::max(-127.f, v));
      const int32_t qi = static_cast<int32_t>(v);
      q[b * QK + i] = static_cast<int8_t>(qi);
      total += qi;
    }
    d[b] = db;
    s[b] = db * static_cast<float>(total);
    sum[b] = total;
  }
}

#ifdef BQ_AVX2
inline int32_t hsum_epi32(__m256i v) {
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1));
  return _mm_cvtsi128_si32(a);
}

inline float hmax_ps(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

template <typename T>
void quantize_row_avx2(const T* x, int64_t nb, int8_t* q, float* d, float* s, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; ++b) {
    const T* xb = x + b * QK;
    __m256 v[4];
    for (int k = 0; k < 4; ++k) v[k] = pagedllm::load8_avx(xb + 8 * k);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    float db, id;
    block_scale(hmax_ps(m), db, id);
    const __m256 vid = _mm256_set1_ps(id);
    __m256i iq[4];
    for (int k = 0; k < 4; ++k) {
      __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm256_min_ps(hi, _mm256_max_ps(lo, r));
      iq[k] = _mm256_cvtps_epi32(r);
    }
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(iq[0], iq[1]), _mm256_add_epi32(iq[2], iq[3]));
    // int32 -> int8 (no saturation: |q| <= 127); packs works per 128-bit half, so the
    // 4-byte groups come out as 0,2,4,6,1,3,5,7 and are put back in order.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), _mm256_permutevar8x32_epi32(p, order));
    const int32_t t = hsum_epi32(total);
    d[b] = db;
    s[b] = db * static_cast<float>(t);
    sum[b] = t;
  }
}
#endif

template <typename T>
QuantAct quantize_act(const T* x, int64_t M, int64_t K, int64_t x_stride, bool portable) {
  (void)portable;  // without AVX2 there is one path
  QuantAct a;
  a.M = M;
  a.K = K;
  a.nb = K / QK;
  a.q.resize(M * K);
  a.d.resize(M * a.nb);
  a.s.resize(M * a.nb);
  a.sum.resize(M * a.nb);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* q = a.q.data() + r * K;
      float* d = a.d.data() + r * a.nb;
      float* s = a.s.data() + r * a.nb;
      int32_t* sm = a.sum.data() + r * a.nb;
#ifdef BQ_AVX2
      if (!portable) {
        quantize_row_avx2(x + r * x_stride, a.nb, q, d, s, sm);
        continue;
      }
#endif
      quantize_row_scalar(x + r * x_stride, a.nb, q, d, s, sm);
    }
  });
  return a;
}

// Integer dot of one weight block (raw bytes after its scale(s)) with 32 activations.
template <int FMT>
inline int32_t block_dot_scalar(const uint8_t* qs, const int8_t* xq, int32_t xsum) {
  int32_t acc = 0;
  if (FMT == kQ8_0) {
    const int8_t* w = reinterpret_cast<const int8_t*>(qs);
    for (int i = 0; i < QK; ++i) acc += static_cast<int32_t>(w[i]) * xq[i];
  } else {
    for (int j = 0; j < QK / 2; ++j)
      acc += static_cast<int32_t>(qs[j] & 0x0F) * xq[j] + static_cast<int32_t>(qs[j] >> 4) * xq[j + QK / 2];
    if (FMT == kQ4_0) acc -= 8 * xsum;
  }
  return acc;
}

// The portable path: out[r, n] for all rows and columns, one element at a time.
template <int FMT, typename T>
void gemm_scalar(const QuantAct& a, const uint8_t* w, int64_t N, const float* bias, T* out, int64_t out_stride) {
  const int64_t nb = a.nb, bpb = block_bytes(FMT), row_bytes = nb * bpb;
  const int64_t off = FMT == kQ4_1 ? 4 : 2;
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / std::max<int64_t>(a.M * a.K / QK, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * row_bytes;
      for (int64_t r = 0; r < a.M; ++r) {
        const int8_t* xq = a.q.data() + r * a.K;
        const float* dx = a.d.data() + r * nb;
        const float* sx = a.s.data() + r * nb;
        const int32_t* xs = a.sum.data() + r * nb;
        float acc = 0.f, accm = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = wr + b * bpb;
          const int32_t isum = block_dot_scalar<FMT>(blk + off, xq + b * QK, xs[b]);
          acc = std::fma(half_at(blk) * dx[b], static_cast<float>(isum), acc);
          if (FMT == kQ4_1) accm = std::fma(half_at(blk + 2), sx[b], accm);
        }
        if (FMT == kQ4_1) acc = acc + accm;
        if (bias) acc = acc + bias[n];
        out[r * out_stride + n] = from_f32<T>(acc);
      }
    }
  });
}

#ifdef BQ_AVX2
// A tile of TILE = 8 columns unpacked for the AVX2 dot products. Columns are paired
// (c, c + 4) for c = 0..3, each pair in two 32-byte registers per block:
//   lo = [column c elements 0-15 | column c+4 elements 0-15]
//   hi = [column c elements 16-31 | column c+4 elements 16-31]
// so one 16-byte half of the activations, broadcast to both 128-bit halves, multiplies
// two columns at once, each 128-bit half then holding one column's partial sums; two
// rounds of horizontal adds give the 8 columns' sums in lane order 0..7 (tile_sums).
struct Tile {
  std::vector<uint8_t> w;    // [nb][4 pairs][lo, hi][32]: Q4_x: nibbles as bytes 0..15; Q8_0: int8 q
  std::vector<float> dw;     // [nb][TILE]: d_w
  std::vector<float> mw;     // [nb][TILE]: Q4_1 only: m_w
  std::vector<uint32_t> head;  // [nb][TILE]: each block's first 4 bytes (fp16 d, then m or data)
  explicit Tile(int64_t nb)
      : w(nb * TILE * QK), dw(nb * TILE), mw(nb * TILE), head(nb * TILE) {}
};

// The 8 columns' fp16 scales of one block from each column's first 4 bytes (dm, lane j =
// column j): d of the 8 columns in the low 128 bits, then (Q4_1) m, in column order.
template <int FMT>
inline __m256i block_scales(__m256i dm) {
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  const __m256i mbits = FMT == kQ4_1 ? _mm256_srli_epi32(dm, 16) : _mm256_setzero_si256();
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(dm, low16), mbits), 0xd8);
}

// Column pair (c, c + 4) of one block as Tile lays it out, from the packed quants qa
// (column c) and qc (column c + 4): lo = elements 0-15 of both, hi = elements 16-31.
template <int FMT>
inline void load_pair(const uint8_t* qa, const uint8_t* qc, __m256i& lo, __m256i& hi) {
  if (FMT == kQ8_0) {
    lo = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(qc), reinterpret_cast<const __m128i*>(qa));
    hi = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(qc + 16), reinterpret_cast<const __m128i*>(qa + 16));
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i q = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(qc), reinterpret_cast<const __m128i*>(qa));
    lo = _mm256_and_si256(q, low4);
    hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
  }
}

// Unpack columns n0 .. n0+7 (those past N repeat column n0: computed, never stored).
template <int FMT>
void unpack_tile(Tile& t, const uint8_t* w, int64_t n0, int64_t N, int64_t nb) {
  const int64_t bpb = block_bytes(FMT), row_bytes = nb * bpb;
  const int64_t off = FMT == kQ4_1 ? 4 : 2;
  const uint8_t* col[TILE];
  for (int64_t j = 0; j < TILE; ++j) col[j] = w + (n0 + j < N ? n0 + j : n0) * row_bytes;
  // the scales' bytes, column by column (a gather per block costs more on Zen 3)
  for (int64_t j = 0; j < TILE; ++j)
    for (int64_t b = 0; b < nb; ++b) std::memcpy(&t.head[b * TILE + j], col[j] + b * bpb, 4);
  // This tile reads its 8 rows block by block, 8 streams at once, which the hardware
  // prefetchers follow poorly (one-row decode ran at a third of the memory bandwidth):
  // fetch the tile kPrefetchTiles ahead (the next rows of w), a block's share at a time.
  const int64_t ahead = (n0 + kPrefetchTiles * TILE) * row_bytes, total = N * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t o = b * TILE * bpb; o < (b + 1) * TILE * bpb; o += 64)
      if (ahead + o < total) _mm_prefetch(reinterpret_cast<const char*>(w + ahead + o), _MM_HINT_T0);
    // the first 4 bytes of each column's block: fp16 d, then fp16 m (Q4_1) or data
    const __m256i h = block_scales<FMT>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.head.data() + b * TILE)));
    _mm256_storeu_ps(t.dw.data() + b * TILE, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
    if (FMT == kQ4_1) _mm256_storeu_ps(t.mw.data() + b * TILE, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    for (int64_t c = 0; c < TILE / 2; ++c) {
      const uint8_t* qa = col[c] + b * bpb + off;             // column c
      const uint8_t* qc = col[c + TILE / 2] + b * bpb + off;  // column c + 4
      uint8_t* dst = t.w.data() + (b * TILE / 2 + c) * 2 * QK;
      __m256i lo, hi;
      load_pair<FMT>(qa, qc, lo, hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + QK), hi);
    }
  }
}

// One column pair's block with one activation block (its halves xlo, xhi, each broadcast
// to both 128-bit halves). Q8_0: per 128-bit half, 4 int32 partial sums of that column's
// dot (|pair| <= 2 * 128 * 127 in each maddubs, so two of them could overflow int16: they
// are widened first). Q4_x: per 128-bit half, 8 int16 partial sums of 4 products each
// (|pair| <= 2 * 15 * 127 = 3810, so a lane holds at most 7620).
template <int FMT>
inline __m256i pair_dot_w(__m256i wlo, __m256i whi, __m256i xlo, __m256i xhi, __m256i ones) {
  if (FMT == kQ8_0) {
    // |w| read as unsigned (abs(-128) is 0x80 = 128), the sign moved onto x
    const __m256i alo = _mm256_abs_epi8(wlo), ahi = _mm256_abs_epi8(whi);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(alo, _mm256_sign_epi8(xlo, wlo)), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(ahi, _mm256_sign_epi8(xhi, whi)), ones));
  }
  (void)ones;
  return _mm256_add_epi16(_mm256_maddubs_epi16(wlo, xlo), _mm256_maddubs_epi16(whi, xhi));
}

// pair_dot_w of an unpacked pair (wp: Tile's lo, hi).
template <int FMT>
inline __m256i pair_dot(const uint8_t* wp, __m256i xlo, __m256i xhi, __m256i ones) {
  return pair_dot_w<FMT>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + QK)), xlo, xhi, ones);
}

// The 8 columns' integer dots, lane j = column j, from the 4 pairs' pair_dot.
template <int FMT>
inline __m256i tile_sums(__m256i v0, __m256i v1, __m256i v2, __m256i v3, __m256i ones) {
  if (FMT == kQ8_0)
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  // int16 lanes: two rounds of adjacent sums (<= 15240, then <= 30480: no wrap), then
  // madd widens the last pair of each column to int32
  return _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(v0, v1), _mm256_hadd_epi16(v2, v3)), ones);
}

// One row of x times a tile: 8 outputs (before bias).
template <int FMT>
inline __m256 row_times_tile(const Tile& t, const int8_t* xq, const float* dx, const float* sx,
                             const int32_t* xs, int64_t nb) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + b * QK)));
    const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + b * QK + 16)));
    const uint8_t* wb = t.w.data() + b * TILE * QK;
    __m256i isum = tile_sums<FMT>(pair_dot<FMT>(wb, xlo, xhi, ones),         // columns 0 | 4
                                  pair_dot<FMT>(wb + 64, xlo, xhi, ones),    // 1 | 5
                                  pair_dot<FMT>(wb + 128, xlo, xhi, ones),   // 2 | 6
                                  pair_dot<FMT>(wb + 192, xlo, xhi, ones),   // 3 | 7
                                  ones);
    if (FMT == kQ4_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * xs[b]));
    const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(t.dw.data() + b * TILE), _mm256_set1_ps(dx[b]));
    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), acc);
    if (FMT == kQ4_1) accm = _mm256_fmadd_ps(_mm256_loadu_ps(t.mw.data() + b * TILE), _mm256_set1_ps(sx[b]), accm);
  }
  return FMT == kQ4_1 ? _mm256_add_ps(acc, accm) : acc;
}

// One row of x times columns n0 .. n0+7 read straight from the packed rows of w, for
// the few-row products of decode (M < kDirectRows), where unpacking a tile for one or two
// rows costs more than it saves: the same lane layout, integer dots and float operations
// in the same order as row_times_tile, so each output is bitwise the same on either path.
// A tile's blocks (8 x nb x bytes) stay in L1 for the rows after the first; the first row
// prefetches the tile kPrefetchTiles ahead a block's share at a time, as unpack_tile does
// (a whole tile's prefetches at once, or none, ran at half the bandwidth: 6-9 GB/s).
template <int FMT>
inline __m256 row_times_packed(const uint8_t* const* col, const int8_t* xq, const float* dx,
                               const float* sx, const int32_t* xs, int64_t nb, const uint8_t* pf = nullptr) {
  const int64_t bpb = block_bytes(FMT);
  const int64_t off = FMT == kQ4_1 ? 4 : 2;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * bpb;
    // a block's share of the tile ahead (8 rows x bpb bytes of the next rows of w)
    if (pf)
      for (int64_t u = 0; u < TILE * bpb; u += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + b * TILE * bpb + u), _MM_HINT_T0);
    uint32_t hw[TILE];
    for (int64_t j = 0; j < TILE; ++j) std::memcpy(&hw[j], col[j] + o, 4);
    const __m256i h = block_scales<FMT>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hw)));
    const __m256 dw = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + b * QK)));
    const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + b * QK + 16)));
    __m256i v[TILE / 2];
    for (int64_t c = 0; c < TILE / 2; ++c) {
      __m256i wlo, whi;
      load_pair<FMT>(col[c] + o + off, col[c + TILE / 2] + o + off, wlo, whi);
      v[c] = pair_dot_w<FMT>(wlo, whi, xlo, xhi, ones);
    }
    __m256i isum = tile_sums<FMT>(v[0], v[1], v[2], v[3], ones);
    if (FMT == kQ4_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * xs[b]));
    const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx[b]));
    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), acc);
    if (FMT == kQ4_1)
      accm = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), _mm256_set1_ps(sx[b]), accm);
  }
  return FMT == kQ4_1 ? _mm256_add_ps(acc, accm) : acc;
}

template <int FMT, typename T>
void gemm_avx2(const QuantAct& a, const uint8_t* w, int64_t N, const float* bias, T* out, int64_t out_stride) {
  const int64_t nb = a.nb, M = a.M;
  const int64_t ntiles = (N + TILE - 1) / TILE;
  // rows per pass over the tiles: their quantized activations (~K bytes a row) fit in L2
  const int64_t row_chunk = std::max<int64_t>(16, (128 * 1024) / std::max<int64_t>(a.K, 1));
  // enough multiply-adds per task to be worth a thread
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(TILE * a.K * M, 1));
  const int64_t row_bytes = nb * block_bytes(FMT);
  const bool direct = M < kDirectRows;
  at::parallel_for(0, ntiles, grain, [&](int64_t t0, int64_t t1) {
    Tile tile(direct ? 0 : nb);
    for (int64_t r0 = 0; r0 < M; r0 += row_chunk) {
      const int64_t r1 = std::min(M, r0 + row_chunk);
      for (int64_t ti = t0; ti < t1; ++ti) {
        const int64_t n0 = ti * TILE;
        const int64_t cols = std::min(TILE, N - n0);
        const uint8_t* col[TILE];
        const uint8_t* pf = nullptr;   // direct: the tile kPrefetchTiles ahead (the next rows of w)
        if (direct) {
          for (int64_t j = 0; j < TILE; ++j) col[j] = w + (n0 + j < N ? n0 + j : n0) * row_bytes;
          const int64_t ahead = (n0 + kPrefetchTiles * TILE) * row_bytes;
          if (ahead + TILE * row_bytes <= N * row_bytes) pf = w + ahead;
        } else {
          unpack_tile<FMT>(tile, w, n0, N, nb);
        }
        __m256 bv = _mm256_setzero_ps();
        alignas(32) float bb[TILE] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (bias) {
          for (int64_t j = 0; j < cols; ++j) bb[j] = bias[n0 + j];
          bv = _mm256_load_ps(bb);
        }
        for (int64_t r = r0; r < r1; ++r) {
          // the first row fetches the tile ahead
          __m256 acc = direct ? row_times_packed<FMT>(col, a.q.data() + r * a.K, a.d.data() + r * nb,
                                                      a.s.data() + r * nb, a.sum.data() + r * nb, nb,
                                                      r == r0 ? pf : nullptr)
                              : row_times_tile<FMT>(tile, a.q.data() + r * a.K, a.d.data() + r * nb,
                                                    a.s.data() + r * nb, a.sum.data() + r * nb, nb);
          if (bias) acc = _mm256_add_ps(acc, bv);
          T* o = out + r * out_stride + n0;
          if (cols == TILE) {
            pagedllm::store8_avx(o, acc);
          } else {
            alignas(32) float tmp[TILE];
            _mm256_store_ps(tmp, acc);
            for (int64_t j = 0; j < cols; ++j) o[j] = from_f32<T>(tmp[j]);
          }
        }
      }
    }
  });
}
#endif

template <int FMT, typename T>
void run(const QuantAct& a, const uint8_t* w, int64_t N, const float* bias, T* out, int64_t out_stride,
         bool portable) {
  (void)portable;
#ifdef BQ_AVX2
  if (!portable) return gemm_avx2<FMT, T>(a, w, N, bias, out, out_stride);
#endif
  gemm_scalar<FMT, T>(a, w, N, bias, out, out_stride);
}

template <typename T>
void dispatch(int64_t fmt, const QuantAct& a, const uint8_t* w, int64_t N, const float* bias, T* out,
              int64_t out_stride, bool portable) {
  switch (fmt) {
    case kQ4_0: return run<kQ4_0, T>(a, w, N, bias, out, out_stride, portable);
    case kQ4_1: return run<kQ4_1, T>(a, w, N, bias, out, out_stride, portable);
    default: return run<kQ8_0, T>(a, w, N, bias, out, out_stride, portable);
  }
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.device().is_cpu() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK_VALUE(x.size(1) % QK == 0, "x's K = ", x.size(1), " must be a multiple of 32");
}

template <typename T>
QuantAct quantize(const at::Tensor& x, bool portable) {
  return quantize_act(x.data_ptr<T>(), x.size(0), x.size(1), x.stride(0), portable);
}

}  // namespace

at::Tensor block_quant_linear(std::optional<at::Tensor> out_arg, at::Tensor x, at::Tensor w, int64_t fmt,
                                 std::optional<at::Tensor> bias, bool portable, bool out_float32) {
  check_x(x);
  const int64_t bpb = block_bytes(fmt);
  TORCH_CHECK_VALUE(bpb > 0, "fmt = ", fmt, " is not a supported block format (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
                    "w must be a contiguous uint8 CPU tensor [N, K/32 * bytes_per_block]");
  const int64_t N = w.size(0);
  // allocated here when not given: torch.empty from Python costs ~3 us a call, a
  // decode step makes ~120 of these products
  const at::ScalarType out_type = out_float32 ? at::kFloat : x.scalar_type();
  at::Tensor out = out_arg.has_value() && out_arg->defined() ? *out_arg : at::empty({M, N}, x.options().dtype(out_type));
  TORCH_CHECK_VALUE(w.size(1) == K / QK * bpb, "w has ", w.size(1), " bytes a row; K = ", K, " needs ",
                    K / QK * bpb);
  TORCH_CHECK_VALUE(out.scalar_type() == out_type && out.dim() == 2 && out.size(0) == M &&
                        out.size(1) == N && out.stride(1) == 1,
                    "out must be [M, N] in x's dtype (float32 with out_float32) with contiguous rows");
  std::vector<float> bf;
  if (bias.has_value() && bias->defined()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK_VALUE(b.device().is_cpu() && b.dim() == 1 && b.size(0) == N &&
                          (b.scalar_type() == at::kFloat || b.scalar_type() == at::kBFloat16),
                      "bias must be a float32 or bfloat16 CPU tensor [N]");
    const at::Tensor bc = b.to(at::kFloat).contiguous();
    bf.assign(bc.data_ptr<float>(), bc.data_ptr<float>() + N);
  }
  if (M == 0 || N == 0) return out;
  const float* bp = bf.empty() ? nullptr : bf.data();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const QuantAct a = x.scalar_type() == at::kFloat ? quantize<float>(x, portable) : quantize<bf16>(x, portable);
  if (out_type == at::kFloat) dispatch(fmt, a, wp, N, bp, out.data_ptr<float>(), out.stride(0), portable);
  else dispatch(fmt, a, wp, N, bp, out.data_ptr<bf16>(), out.stride(0), portable);
  return out;
}

std::vector<at::Tensor> block_quant_quantize_act(at::Tensor x, bool portable) {
  check_x(x);
  const QuantAct a = x.scalar_type() == at::kFloat ? quantize<float>(x, portable) : quantize<bf16>(x, portable);
  const auto M = a.M, nb = a.nb;
  at::Tensor q = at::empty({M, a.K}, at::kChar), d = at::empty({M, nb}, at::kFloat),
                sum = at::empty({M, nb}, at::kInt);
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(d.data_ptr<float>(), a.d.data(), a.d.size() * sizeof(float));
  std::memcpy(sum.data_ptr<int32_t>(), a.sum.data(), a.sum.size() * sizeof(int32_t));
  return {q, d, sum};
}

std::string block_quant_isa() {
#ifdef BQ_AVX2
  return "AVX2";
#else
  return "scalar";
#endif
}
