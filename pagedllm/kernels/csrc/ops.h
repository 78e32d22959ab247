// Declarations of the CPU kernels bound in bindings.cpp.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

// paged_attention_cpu.cpp
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor key_cache,
                     torch::Tensor value_cache, torch::Tensor block_table,
                     torch::Tensor query_start_loc, torch::Tensor seq_lens, int64_t block_size,
                     double scale, double k_scale, double v_scale, int64_t sliding_window);

// cpu_ops.cpp
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping, double k_scale,
                       double v_scale);
void silu_and_mul(torch::Tensor out, torch::Tensor x);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

// quant_act.cpp
void quantize_per_token(torch::Tensor out, torch::Tensor scales, torch::Tensor x, int64_t qmax,
                        int64_t zero_point, c10::optional<torch::Tensor> smooth);
void int8_epilogue(torch::Tensor out, torch::Tensor acc, torch::Tensor compensation,
                   torch::Tensor weight_scales, torch::Tensor row_scales,
                   c10::optional<torch::Tensor> bias);
// block_quant.cpp
torch::Tensor block_quant_linear(std::optional<torch::Tensor> out, torch::Tensor x, torch::Tensor w, int64_t fmt,
                                 std::optional<torch::Tensor> bias, bool portable);
std::vector<torch::Tensor> block_quant_quantize_act(torch::Tensor x, bool portable);
std::string block_quant_isa();
// amx_linear.cpp
bool amx_bf16_available();
torch::Tensor amx_bf16_linear(torch::Tensor x, torch::Tensor w_packed, std::optional<torch::Tensor> bias,
                              bool out_float32);
bool amx_int8_available();
torch::Tensor amx_u8s8_matmul(torch::Tensor x, torch::Tensor w_packed);
torch::Tensor amx_int8_linear(torch::Tensor x, torch::Tensor w_packed, torch::Tensor compensation,
                              torch::Tensor weight_scales, torch::Tensor row_scales,
                              std::optional<torch::Tensor> bias, bool out_bfloat16);
// int8_linear_avx2.cpp
bool avx2_int8_available();
torch::Tensor avx2_int8_linear(torch::Tensor x, torch::Tensor w_packed, torch::Tensor colsum, int64_t zero_point,
                               torch::Tensor compensation, torch::Tensor weight_scales, torch::Tensor row_scales,
                               std::optional<torch::Tensor> bias, bool out_bfloat16, bool seven_bit_weights);
// sample_ops.cpp
std::vector<torch::Tensor> topk_rows(torch::Tensor x, int64_t k, std::optional<torch::Tensor> chosen, bool lse);
std::vector<torch::Tensor> token_presence(torch::Tensor history, torch::Tensor prompt_len, torch::Tensor length,
                                          int64_t vocab_size);
