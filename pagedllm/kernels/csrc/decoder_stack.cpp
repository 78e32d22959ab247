// A Llama-family decoder stack run as one call from Python: the same kernels, in the same
// order, on the same tensors as the per-layer Python path of ``models/llama.py`` with C++
// kernels everywhere (the linears' own kernels, fused add + RMSNorm, RoPE, K/V write,
// paged attention, SiLU-and-mul), so every output bit is that path's. What it removes is
// the Python between the kernels: ~12 module calls, ~10 tensor views and ~4 allocations a
// layer, ~90 us of a single-stream decode layer on the project's 2-core EPYC, where the
// kernels themselves take ~170 us (docs/benchmarks.md). The idea is llama.cpp's compute
// graph and IPEX's fused decoder layers for the CPU; the layers keep their weights and
// Python path, and ``models/fused_decoder.py`` decides when this one applies.
//
// A linear layer reaches the stack as a StackLinear: the kernel its LinearMethod calls per
// layer, with the same operands (each method's ``stack_linear``):
//   block      GGUF Q8_0/Q4_0/Q4_1 blocks: block_quant_linear (quantization/gguf_blocks.py);
//   int8_avx2  int8 W8A8 on AVX2: quantize_per_token (times SmoothQuant's 1/s) then
//              avx2_int8_linear, the epilogue fused (quantization/int8.py);
//   int8_amx   int8 W8A8 on AMX-INT8: the same quantizer, then amx_int8_linear.
//   bf16_avx512 / bf16_amx  bf16 weights in AMX B-tile order: avx512_bf16_linear (VDPBF16PS)
//              or amx_bf16_linear, bf16 out (layers/linear.py's _TiledBF16LinearMethod).
//
// Per layer l (x [T, hidden]; residual [T, hidden] in x's dtype or float32; layer 0's first
// RMSNorm is done by the caller):
//   h = rms_norm(residual += x)                     (fused_add_rms_norm, l > 0)
//   qkv = h @ Wqkv.T (+ b); rope on q|k; write k, v to the cache; o = attention(q)
//   h = rms_norm(residual += o @ Wo.T)
//   x = (silu(gate) * up)(h @ Wgu.T) @ Wdown.T
#include "ops.h"

#include <ATen/record_function.h>

// A profiler range named as the Python path's ``trace`` names the kernel.
#define PAGEDLLM_RANGE(name) RECORD_FUNCTION(name, std::vector<c10::IValue>())

namespace {

bool float_vector(const at::Tensor& t, int64_t n) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 &&
         t.size(0) == n;
}

}  // namespace

StackLinear StackLinear::block(at::Tensor weight, int64_t fmt, std::optional<at::Tensor> bias) {
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                        weight.is_contiguous(),
                    "StackLinear.block: weight must be a contiguous uint8 CPU tensor [N, K/32 * bytes_per_block]");
  StackLinear l;
  l.kind_ = Kind::kBlock;
  l.w_ = std::move(weight);
  l.fmt_ = fmt;
  l.n_ = l.w_.size(0);
  if (bias.has_value() && bias->defined()) l.bias_ = std::move(bias);
  return l;
}

namespace {

// The operands both int8 kinds share (quantize_per_token's range and smoothing row, the
// epilogue's vectors), checked and stored on l; `who` names the kind in the errors.
void set_int8_operands(StackLinear::Int8Operands& l, const char* who, int64_t n, int64_t k,
                       at::Tensor compensation, at::Tensor weight_scales, std::optional<at::Tensor> smooth,
                       int64_t qmax, int64_t zero_point, std::optional<at::Tensor> bias) {
  TORCH_CHECK_VALUE(float_vector(compensation, n) && float_vector(weight_scales, n), who,
                    ": compensation and weight_scales must be contiguous float32 CPU tensors [N]");
  TORCH_CHECK_VALUE(qmax >= 1 && qmax <= 127 && zero_point >= qmax && zero_point <= 255 - qmax, who,
                    ": need 1 <= qmax <= 127 and qmax <= zero_point <= 255 - qmax, got qmax ", qmax,
                    ", zero_point ", zero_point);
  if (smooth.has_value() && smooth->defined()) {
    TORCH_CHECK_VALUE(smooth->device().is_cpu() && smooth->dim() == 1 && smooth->size(0) == k &&
                          smooth->is_contiguous() &&
                          (smooth->scalar_type() == at::kFloat || smooth->scalar_type() == at::kBFloat16),
                      who, ": smooth must be a contiguous float32 or bfloat16 CPU tensor [K]");
    l.smooth = std::move(smooth);
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(float_vector(*bias, n), who, ": bias must be a contiguous float32 CPU tensor [N]");
    l.bias = std::move(bias);
  }
  l.comp = std::move(compensation);
  l.wscale = std::move(weight_scales);
  l.qmax = qmax;
  l.zp = zero_point;
}

}  // namespace

StackLinear StackLinear::int8_avx2(at::Tensor w_packed, at::Tensor colsum, at::Tensor compensation,
                                   at::Tensor weight_scales, std::optional<at::Tensor> smooth, int64_t qmax,
                                   int64_t zero_point, bool seven_bit_weights, std::optional<at::Tensor> bias) {
  TORCH_CHECK_VALUE(w_packed.device().is_cpu() && w_packed.dim() == 4 && w_packed.scalar_type() == at::kChar &&
                        w_packed.is_contiguous() && w_packed.size(2) == 16 && w_packed.size(3) == 4,
                    "StackLinear.int8_avx2: w_packed must be a contiguous int8 [ceil(N/16), K/4, 16, 4] tensor");
  TORCH_CHECK_VALUE(colsum.device().is_cpu() && colsum.scalar_type() == at::kInt && colsum.dim() == 1 &&
                        colsum.is_contiguous(),
                    "StackLinear.int8_avx2: colsum must be a contiguous int32 CPU tensor [N]");
  const int64_t n = colsum.size(0), k = w_packed.size(1) * 4, padded = w_packed.size(0) * 16;
  TORCH_CHECK_VALUE(n <= padded && n > padded - 16, "StackLinear.int8_avx2: colsum has ", n,
                    " columns, the packed weight ", padded);
  StackLinear l;
  set_int8_operands(l.int8_, "StackLinear.int8_avx2", n, k, std::move(compensation), std::move(weight_scales),
                    std::move(smooth), qmax, zero_point, std::move(bias));
  l.kind_ = Kind::kInt8Avx2;
  l.n_ = n;
  l.k_ = k;
  l.w_ = std::move(w_packed);
  l.colsum_ = std::move(colsum);
  l.seven_bit_ = seven_bit_weights;
  return l;
}

StackLinear StackLinear::int8_amx(at::Tensor w_packed, at::Tensor compensation, at::Tensor weight_scales,
                                  std::optional<at::Tensor> smooth, int64_t qmax, int64_t zero_point,
                                  std::optional<at::Tensor> bias) {
  TORCH_CHECK_VALUE(w_packed.device().is_cpu() && w_packed.dim() == 4 && w_packed.scalar_type() == at::kChar &&
                        w_packed.is_contiguous() && w_packed.size(2) == 16 && w_packed.size(3) == 64,
                    "StackLinear.int8_amx: w_packed must be a contiguous int8 [N/16, K/64, 16, 64] tensor");
  const int64_t n = w_packed.size(0) * 16, k = w_packed.size(1) * 64;
  StackLinear l;
  set_int8_operands(l.int8_, "StackLinear.int8_amx", n, k, std::move(compensation), std::move(weight_scales),
                    std::move(smooth), qmax, zero_point, std::move(bias));
  l.kind_ = Kind::kInt8Amx;
  l.n_ = n;
  l.k_ = k;
  l.w_ = std::move(w_packed);
  return l;
}

StackLinear StackLinear::bf16_tiled(at::Tensor w_packed, bool amx, std::optional<at::Tensor> bias) {
  TORCH_CHECK_VALUE(w_packed.device().is_cpu() && w_packed.dim() == 4 && w_packed.scalar_type() == at::kBFloat16 &&
                        w_packed.is_contiguous() && w_packed.size(2) == 16 && w_packed.size(3) == 32,
                    "StackLinear.bf16_tiled: w_packed must be a contiguous bfloat16 [N/16, K/32, 16, 32] tensor");
  TORCH_CHECK_VALUE(amx ? amx_bf16_available() : avx512_bf16_available(), "StackLinear.bf16_tiled: ",
                    amx ? "AMX-BF16" : "AVX512-BF16", " kernels are not available on this CPU or build");
  StackLinear l;
  l.kind_ = amx ? Kind::kBf16Amx : Kind::kBf16Avx512;
  l.n_ = w_packed.size(0) * 16;
  l.k_ = w_packed.size(1) * 32;
  l.w_ = std::move(w_packed);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == l.n_,
                      "StackLinear.bf16_tiled: bias must be a CPU tensor [N]");
    l.bias_ = std::move(bias);
  }
  return l;
}

std::string StackLinear::kind() const {
  switch (kind_) {
    case Kind::kBlock: return "block";
    case Kind::kInt8Avx2: return "int8_avx2";
    case Kind::kInt8Amx: return "int8_amx";
    case Kind::kBf16Avx512: return "bf16_avx512";
    case Kind::kBf16Amx: return "bf16_amx";
  }
  return "unknown";
}

at::Tensor StackLinear::operator()(const at::Tensor& x) const {
  if (kind_ == Kind::kBlock) {
    PAGEDLLM_RANGE("block_quant_linear");
    return block_quant_linear(std::nullopt, x, w_, fmt_, bias_, false, false);
  }
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k_, "StackLinear: x must be [T, ", k_, "]");
  if (kind_ == Kind::kBf16Avx512) {
    PAGEDLLM_RANGE("pagedllm::avx512_bf16_linear");
    return avx512_bf16_linear(x, w_, bias_, false);
  }
  if (kind_ == Kind::kBf16Amx) {
    PAGEDLLM_RANGE("pagedllm::amx_bf16_linear");
    return amx_bf16_linear(x, w_, bias_, false);
  }
  const Int8Operands& q = int8_;
  at::Tensor xq = at::empty(x.sizes(), x.options().dtype(at::kByte));
  at::Tensor row_scales = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  {
    PAGEDLLM_RANGE("pagedllm::quantize_per_token");
    quantize_per_token(xq, row_scales, x, q.qmax, q.zp, q.smooth);
  }
  const bool bf16_out = x.scalar_type() == at::kBFloat16;
  if (kind_ == Kind::kInt8Amx) {
    PAGEDLLM_RANGE("pagedllm::amx_int8_linear");
    return amx_int8_linear(xq, w_, q.comp, q.wscale, row_scales, q.bias, bf16_out);
  }
  PAGEDLLM_RANGE("pagedllm::avx2_int8_linear");
  return avx2_int8_linear(xq, w_, colsum_, q.zp, q.comp, q.wscale, row_scales, q.bias, bf16_out, seven_bit_);
}

DecoderStack::DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           double rms_norm_eps, double attn_scale)
    : nh_(num_heads), nkv_(num_kv_heads), hd_(head_dim), eps_(rms_norm_eps), scale_(attn_scale) {
  TORCH_CHECK_VALUE(nh_ > 0 && nkv_ > 0 && nh_ % nkv_ == 0 && hd_ > 0 && hd_ % 2 == 0,
                    "DecoderStack: num_heads must be a positive multiple of num_kv_heads and head_dim even");
}

void DecoderStack::add_layer(at::Tensor input_norm, at::Tensor post_norm, StackLinear qkv, StackLinear o,
                             StackLinear gate_up, StackLinear down, at::Tensor key_cache, at::Tensor value_cache,
                             double k_scale, double v_scale) {
  TORCH_CHECK_VALUE(key_cache.dim() == 3 && key_cache.size(1) == nkv_ && key_cache.size(2) == hd_ &&
                        value_cache.sizes() == key_cache.sizes(),
                    "DecoderStack.add_layer: key/value caches must be [slots, num_kv_heads, head_dim]");
  TORCH_CHECK_VALUE(qkv.out_features() == (nh_ + 2 * nkv_) * hd_, "DecoderStack.add_layer: qkv has ",
                    qkv.out_features(), " outputs, expected (num_heads + 2 * num_kv_heads) * head_dim = ",
                    (nh_ + 2 * nkv_) * hd_);
  layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o),
                          std::move(gate_up), std::move(down), std::move(key_cache), std::move(value_cache),
                          k_scale, v_scale});
}

std::vector<at::Tensor> DecoderStack::forward(at::Tensor h, at::Tensor residual, at::Tensor cos,
                                              at::Tensor sin, at::Tensor slot_mapping,
                                              at::Tensor block_table, at::Tensor query_start_loc,
                                              at::Tensor seq_lens, int64_t block_size,
                                              int64_t sliding_window) {
  PAGEDLLM_RANGE("pagedllm::decoder_stack");
  TORCH_CHECK_VALUE(!layers_.empty(), "DecoderStack.forward: no layers added");
  TORCH_CHECK_VALUE(h.dim() == 2 && h.is_contiguous() && residual.sizes() == h.sizes() &&
                        residual.is_contiguous() &&
                        (residual.scalar_type() == h.scalar_type() || residual.scalar_type() == at::kFloat),
                    "DecoderStack.forward: h and residual must be contiguous [T, hidden], the residual in h's "
                    "dtype or float32");
  const int64_t T = h.size(0);
  const int64_t q_heads = nh_, qk_heads = nh_ + nkv_, all_heads = nh_ + 2 * nkv_;
  at::Tensor x;   // the previous layer's MLP output
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    if (l > 0) {
      PAGEDLLM_RANGE("pagedllm::fused_add_rms_norm");
      fused_add_rms_norm(x, residual, L.input_norm, eps_);   // x becomes the normed rows
      h = x;
    }
    at::Tensor heads = L.qkv(h).view({T, all_heads, hd_});   // add_layer checked its width
    {
      PAGEDLLM_RANGE("pagedllm::rotary_embedding");
      rotary_embedding(heads.narrow(1, 0, qk_heads), cos, sin);
    }
    at::Tensor q = heads.narrow(1, 0, q_heads);
    at::Tensor k = heads.narrow(1, q_heads, nkv_);
    at::Tensor v = heads.narrow(1, qk_heads, nkv_);
    {
      PAGEDLLM_RANGE("pagedllm::reshape_and_cache");
      reshape_and_cache(k, v, L.key_cache, L.value_cache, slot_mapping, L.k_scale, L.v_scale);
    }
    at::Tensor attn = at::empty({T, nh_, hd_}, q.options());
    {
      PAGEDLLM_RANGE("pagedllm::paged_attention");
      paged_attention(attn, q, L.key_cache, L.value_cache, block_table, query_start_loc, seq_lens, block_size,
                      scale_, L.k_scale, L.v_scale, sliding_window);
    }
    at::Tensor o = L.o(attn.view({T, nh_ * hd_}));
    {
      PAGEDLLM_RANGE("pagedllm::fused_add_rms_norm");
      fused_add_rms_norm(o, residual, L.post_norm, eps_);
    }
    at::Tensor gu = L.gate_up(o);
    at::Tensor act = at::empty({T, gu.size(1) / 2}, gu.options());
    {
      PAGEDLLM_RANGE("pagedllm::silu_and_mul");
      silu_and_mul(act, gu);
    }
    x = L.down(act);
  }
  return {x, residual};
}
