// A Llama-family decoder stack run as one call from Python: the same kernels, in the same
// order, on the same tensors as the per-layer Python path of ``models/llama.py`` with C++
// kernels everywhere (GGUF block linears, fused add + RMSNorm, RoPE, K/V write, paged
// attention, SiLU-and-mul), so every output bit is that path's. What it removes is the
// Python between the kernels: ~12 module calls, ~10 tensor views and ~4 allocations a
// layer, ~90 us of a single-stream decode layer on the project's 2-core EPYC, where the
// kernels themselves take ~170 us (docs/benchmarks.md). The idea is llama.cpp's compute
// graph and IPEX's fused decoder layers for the CPU; the layers keep their weights and
// Python path, and ``models/fused_decoder.py`` decides when this one applies.
//
// Per layer l (x, residual [T, hidden]; layer 0's first RMSNorm is done by the caller):
//   h = rms_norm(residual += x)                     (fused_add_rms_norm, l > 0)
//   qkv = h @ Wqkv.T (+ b); rope on q|k; write k, v to the cache; o = attention(q)
//   h = rms_norm(residual += o @ Wo.T)
//   x = (silu(gate) * up)(h @ Wgu.T) @ Wdown.T
#include "ops.h"

#include <ATen/record_function.h>

// A profiler range named as the Python path's ``trace`` names the kernel.
#define PAGEDLLM_RANGE(name) RECORD_FUNCTION(name, std::vector<c10::IValue>())

DecoderStack::DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           double rms_norm_eps, double attn_scale)
    : nh_(num_heads), nkv_(num_kv_heads), hd_(head_dim), eps_(rms_norm_eps), scale_(attn_scale) {
  TORCH_CHECK_VALUE(nh_ > 0 && nkv_ > 0 && nh_ % nkv_ == 0 && hd_ > 0 && hd_ % 2 == 0,
                    "DecoderStack: num_heads must be a positive multiple of num_kv_heads and head_dim even");
}

void DecoderStack::add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv, int64_t qkv_fmt,
                             std::optional<at::Tensor> qkv_bias, at::Tensor o, int64_t o_fmt,
                             at::Tensor gate_up, int64_t gate_up_fmt, at::Tensor down, int64_t down_fmt,
                             at::Tensor key_cache, at::Tensor value_cache, double k_scale, double v_scale) {
  TORCH_CHECK_VALUE(key_cache.dim() == 3 && key_cache.size(1) == nkv_ && key_cache.size(2) == hd_ &&
                        value_cache.sizes() == key_cache.sizes(),
                    "DecoderStack.add_layer: key/value caches must be [slots, num_kv_heads, head_dim]");
  layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(qkv), qkv_fmt,
                          std::move(qkv_bias), std::move(o), o_fmt, std::move(gate_up), gate_up_fmt,
                          std::move(down), down_fmt, std::move(key_cache), std::move(value_cache),
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
                        residual.is_contiguous() && residual.scalar_type() == h.scalar_type(),
                    "DecoderStack.forward: h and residual must be contiguous [T, hidden] of one dtype");
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
    at::Tensor qkv;
    {
      PAGEDLLM_RANGE("block_quant_linear");
      qkv = block_quant_linear(std::nullopt, h, L.qkv, L.qkv_fmt, L.qkv_bias, false);
    }
    TORCH_CHECK_VALUE(qkv.size(1) == all_heads * hd_, "DecoderStack: layer ", l, "'s q|k|v has ", qkv.size(1),
                      " columns, expected ", all_heads * hd_);
    at::Tensor heads = qkv.view({T, all_heads, hd_});
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
    at::Tensor o, gu, act;
    {
      PAGEDLLM_RANGE("block_quant_linear");
      o = block_quant_linear(std::nullopt, attn.view({T, nh_ * hd_}), L.o, L.o_fmt, std::nullopt, false);
    }
    {
      PAGEDLLM_RANGE("pagedllm::fused_add_rms_norm");
      fused_add_rms_norm(o, residual, L.post_norm, eps_);
    }
    {
      PAGEDLLM_RANGE("block_quant_linear");
      gu = block_quant_linear(std::nullopt, o, L.gate_up, L.gate_up_fmt, std::nullopt, false);
    }
    {
      PAGEDLLM_RANGE("pagedllm::silu_and_mul");
      act = at::empty({T, gu.size(1) / 2}, gu.options());
      silu_and_mul(act, gu);
    }
    {
      PAGEDLLM_RANGE("block_quant_linear");
      x = block_quant_linear(std::nullopt, act, L.down, L.down_fmt, std::nullopt, false);
    }
  }
  return {x, residual};
}
