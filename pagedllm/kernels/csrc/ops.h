// Declarations of the CPU kernels bound in bindings.cpp.
#pragma once
// Only ATen's tensor type and the operators the kernels call, not <torch/extension.h>:
// the whole C++ frontend and pybind11 cost ~22 s of compiler time per file, and only
// bindings.cpp needs them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <string>
#include <vector>

// paged_attention_cpu.cpp
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                     at::Tensor value_cache, at::Tensor block_table,
                     at::Tensor query_start_loc, at::Tensor seq_lens, int64_t block_size,
                     double scale, double k_scale, double v_scale, int64_t sliding_window);
// Whether paged_attention takes its scores from AMX-BF16 tiles for these settings (a
// bf16 model over a bf16 cache, head_dim % 32 == 0, block_size % 16 == 0, no sliding
// window, a CPU with AMX-BF16 and the kernels built for it, and not turned off).
bool paged_attention_amx_applies(at::ScalarType q_dtype, at::ScalarType cache_dtype, int64_t head_dim,
                                 int64_t block_size, int64_t sliding_window);
// Turn the AMX scores on or off for the process (PAGEDLLM_AMX; on by default).
void paged_attention_set_amx(bool on);
// Whether a bf16 model over a bf16 cache may take its q.k scores from VDPBF16PS (a CPU with
// AVX512-BF16, head_dim % 64 == 0, the switch on); it does where AMX scores do not apply.
bool paged_attention_dpbf16_applies(at::ScalarType q_dtype, at::ScalarType cache_dtype, int64_t head_dim);
void paged_attention_set_dpbf16(bool on);

// cpu_ops.cpp
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                       at::Tensor value_cache, at::Tensor slot_mapping, double k_scale,
                       double v_scale);
void silu_and_mul(at::Tensor out, at::Tensor x);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor x, at::Tensor cos, at::Tensor sin);

// quant_act.cpp
void quantize_per_token(at::Tensor out, at::Tensor scales, at::Tensor x, int64_t qmax,
                        int64_t zero_point, c10::optional<at::Tensor> smooth);
void int8_epilogue(at::Tensor out, at::Tensor acc, at::Tensor compensation,
                   at::Tensor weight_scales, at::Tensor row_scales,
                   c10::optional<at::Tensor> bias);
// block_quant.cpp
at::Tensor block_quant_linear(std::optional<at::Tensor> out, at::Tensor x, at::Tensor w, int64_t fmt,
                                 std::optional<at::Tensor> bias, bool portable, bool out_float32);
std::vector<at::Tensor> block_quant_quantize_act(at::Tensor x, bool portable);
std::string block_quant_isa();
// amx_linear.cpp
bool amx_bf16_available();
// Load the tile configuration the AMX kernels use (palette 1, tiles 0-7 each 16 rows x 64
// bytes) into the calling thread; after amx_bf16_available() said yes.
void amx_load_tile_config();
at::Tensor amx_bf16_linear(at::Tensor x, at::Tensor w_packed, std::optional<at::Tensor> bias,
                              bool out_float32);
bool amx_int8_available();
at::Tensor amx_u8s8_matmul(at::Tensor x, at::Tensor w_packed);
at::Tensor amx_int8_linear(at::Tensor x, at::Tensor w_packed, at::Tensor compensation,
                              at::Tensor weight_scales, at::Tensor row_scales,
                              std::optional<at::Tensor> bias, bool out_bfloat16);
// bf16_linear_avx512.cpp
bool avx512_bf16_available();
at::Tensor avx512_bf16_linear(at::Tensor x, at::Tensor w_packed, std::optional<at::Tensor> bias,
                                 bool out_float32);
// int8_linear_avx2.cpp
bool avx2_int8_available();
// Whether avx2_int8_linear sums with AVX512-VNNI (VPDPBUSD): exact and fast at 8-bit weights.
bool avx2_int8_vnni();
at::Tensor avx2_int8_linear(at::Tensor x, at::Tensor w_packed, at::Tensor colsum, int64_t zero_point,
                               at::Tensor compensation, at::Tensor weight_scales, at::Tensor row_scales,
                               std::optional<at::Tensor> bias, bool out_bfloat16, bool seven_bit_weights);
// sample_ops.cpp
std::vector<at::Tensor> topk_rows(at::Tensor x, int64_t k, std::optional<at::Tensor> chosen, bool lse);
std::vector<at::Tensor> token_presence(at::Tensor history, at::Tensor prompt_len, at::Tensor length,
                                          int64_t vocab_size);

// decoder_stack.cpp: one linear layer as the decoder stack calls it (the kernel its
// LinearMethod runs per layer, with that method's operands), and a Llama-family decoder
// stack over such linears as one call.
class StackLinear {
 public:
  // GGUF blocks (block_quant_linear): packed uint8 [N, K/32 * bytes_per_block], fmt the ggml type.
  static StackLinear block(at::Tensor weight, int64_t fmt, std::optional<at::Tensor> bias);
  // int8 W8A8 on AVX2: quantize_per_token (x * smooth) then avx2_int8_linear.
  static StackLinear int8_avx2(at::Tensor w_packed, at::Tensor colsum, at::Tensor compensation,
                               at::Tensor weight_scales, std::optional<at::Tensor> smooth, int64_t qmax,
                               int64_t zero_point, bool seven_bit_weights, std::optional<at::Tensor> bias);
  // int8 W8A8 on AMX-INT8: quantize_per_token (x * smooth) then amx_int8_linear.
  static StackLinear int8_amx(at::Tensor w_packed, at::Tensor compensation, at::Tensor weight_scales,
                              std::optional<at::Tensor> smooth, int64_t qmax, int64_t zero_point,
                              std::optional<at::Tensor> bias);
  // bf16 in AMX B-tile order [N/16, K/32, 16, 32]: avx512_bf16_linear (amx false) or
  // amx_bf16_linear (amx true), bf16 out; bias [N] (any float dtype) or None.
  static StackLinear bf16_tiled(at::Tensor w_packed, bool amx, std::optional<at::Tensor> bias);
  at::Tensor operator()(const at::Tensor& x) const;   // x [T, K] contiguous -> [T, N] in x's dtype
  int64_t out_features() const { return n_; }
  std::string kind() const;

  // What both int8 kinds take: the activation quantizer's range and smoothing row, the
  // epilogue's per-column compensation, weight scales and bias.
  struct Int8Operands {
    at::Tensor comp, wscale;
    std::optional<at::Tensor> smooth, bias;
    int64_t qmax = 0, zp = 0;
  };

 private:
  enum class Kind { kBlock, kInt8Avx2, kInt8Amx, kBf16Avx512, kBf16Amx };
  Kind kind_ = Kind::kBlock;
  int64_t n_ = 0, k_ = 0;
  at::Tensor w_;
  int64_t fmt_ = 0;
  std::optional<at::Tensor> bias_;   // block and bf16 kinds' bias
  at::Tensor colsum_;                // int8_avx2: each weight row's sum
  bool seven_bit_ = false;           // int8_avx2: |Wq| <= 63
  Int8Operands int8_;                // both int8 kinds
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double rms_norm_eps,
               double attn_scale);
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, StackLinear qkv, StackLinear o,
                 StackLinear gate_up, StackLinear down, at::Tensor key_cache, at::Tensor value_cache,
                 double k_scale, double v_scale);
  std::vector<at::Tensor> forward(at::Tensor h, at::Tensor residual, at::Tensor cos, at::Tensor sin,
                                  at::Tensor slot_mapping, at::Tensor block_table,
                                  at::Tensor query_start_loc, at::Tensor seq_lens, int64_t block_size,
                                  int64_t sliding_window);
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    StackLinear qkv, o, gate_up, down;
    at::Tensor key_cache, value_cache;
    double k_scale, v_scale;
  };
  int64_t nh_, nkv_, hd_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};
