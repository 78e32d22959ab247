#include <torch/extension.h>

#include "ops.h"

// Every kernel runs with the GIL released (py::gil_scoped_release), as torch's own ops do:
// they touch no Python object, and a server runs its HTTP event loop in other threads of
// the same process, which would otherwise stall for the whole kernel (a prompt's
// attention: milliseconds per layer).

namespace {
// The scalar type of a torch dtype passed from Python (q_dtype, cache_dtype); a ValueError-
// style error naming them otherwise.
at::ScalarType scalar_type_of(const py::object& d) {
  TORCH_CHECK(THPDtype_Check(d.ptr()), "q_dtype and cache_dtype must be torch dtypes");
  return reinterpret_cast<THPDtype*>(d.ptr())->scalar_type;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Causal paged attention over a flattened batch (q/out float32 or bfloat16; caches float32, "
        "bfloat16, float8_e4m3fn or float8_e5m2, a cached value being element * k_scale or v_scale), "
        "written into out",
        py::arg("out"), py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_size"), py::arg("scale"),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0, py::arg("sliding_window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention_amx_applies",
        [](py::object q_dtype, py::object cache_dtype, int64_t head_dim, int64_t block_size,
           int64_t sliding_window) {
          return paged_attention_amx_applies(scalar_type_of(q_dtype), scalar_type_of(cache_dtype), head_dim,
                                             block_size, sliding_window);
        },
        "Whether paged_attention takes its scores from AMX-BF16 tiles: bf16 q over a bf16 cache, "
        "head_dim % 32 == 0, block_size % 16 == 0, no sliding window, AMX-BF16 present and not turned off",
        py::arg("q_dtype"), py::arg("cache_dtype"), py::arg("head_dim"), py::arg("block_size"),
        py::arg("sliding_window") = 0);
  m.def("paged_attention_set_amx", &paged_attention_set_amx,
        "Let paged_attention use AMX-BF16 for its scores where it applies (on by default; PAGEDLLM_AMX=0: off)",
        py::arg("on"));
  m.def("paged_attention_dpbf16_applies",
        [](py::object q_dtype, py::object cache_dtype, int64_t head_dim) {
          return paged_attention_dpbf16_applies(scalar_type_of(q_dtype), scalar_type_of(cache_dtype), head_dim);
        },
        "Whether paged_attention takes its scores from VDPBF16PS when AMX scores do not apply: bf16 q over a "
        "bf16 cache, head_dim % 64 == 0, AVX512-BF16 present and not turned off",
        py::arg("q_dtype"), py::arg("cache_dtype"), py::arg("head_dim"));
  m.def("paged_attention_set_dpbf16", &paged_attention_set_dpbf16,
        "Let paged_attention use VDPBF16PS for its scores where it applies (on by default; "
        "PAGEDLLM_AVX512_BF16=0: off)",
        py::arg("on"));
  m.def("reshape_and_cache", &reshape_and_cache,
        "Write K/V rows [T, kv_heads, head_dim] into the paged cache at slot_mapping, as key / k_scale "
        "and value / v_scale in the caches' dtype",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0, py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :d]) * x[:, d:]",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x; x = rms_norm(residual) * weight (both in place)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_embedding", &rotary_embedding,
        "Rotate-half RoPE in place on x [T, heads, head_dim] with cos/sin [T, head_dim/2]",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize_per_token", &quantize_per_token,
        "Per-row symmetric int8 quantization of x [M, K] (times smooth [K] rounded to x's dtype, if given) "
        "into uint8 out (q + zero_point) and float32 scales [M]",
        py::arg("out"), py::arg("scales"), py::arg("x"), py::arg("qmax"), py::arg("zero_point"),
        py::arg("smooth") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("int8_epilogue", &int8_epilogue,
        "out = (acc - compensation[n]) * weight_scales[n] * row_scales[m] (+ bias[n]) in out's dtype",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_quant_linear", &block_quant_linear,
        "out = x @ dequant(w).T (+ bias) with w in GGUF blocks (fmt: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8), "
        "x quantized per 32-block to int8; portable = the scalar path; out None: a new [M, N] tensor "
        "in x's dtype (float32 with out_float32); returns out",
        py::arg("out"), py::arg("x"), py::arg("w"), py::arg("fmt"), py::arg("bias") = py::none(),
        py::arg("portable") = false, py::arg("out_float32") = false, py::call_guard<py::gil_scoped_release>());
  m.def("block_quant_quantize_act", &block_quant_quantize_act,
        "x [M, K] -> (q int8 [M, K], d float32 [M, K/32], sum int32 [M, K/32]) as block_quant_linear quantizes it",
        py::arg("x"), py::arg("portable") = false, py::call_guard<py::gil_scoped_release>());
  m.def("block_quant_isa", &block_quant_isa, "\"AVX2\" or \"scalar\": the path block_quant_linear runs");
  m.def("amx_bf16_available", &amx_bf16_available,
        "Whether amx_bf16_linear runs here: built with AMX-TILE/AMX-BF16 and the process granted AMX state");
  m.def("amx_bf16_linear", &amx_bf16_linear,
        "out = x @ w.T (+ bias) on AMX, x bfloat16 [M, K], w packed [N/16, K/32, 16, 32] "
        "(K % 32 == 0, N % 16 == 0); out bfloat16, or float32 with out_float32; batch-invariant rows",
        py::arg("x"), py::arg("w_packed"), py::arg("bias") = py::none(), py::arg("out_float32") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("avx512_bf16_available", &avx512_bf16_available,
        "Whether avx512_bf16_linear runs here: built with AVX512-BF16 (VDPBF16PS)");
  m.def("avx512_bf16_linear", &avx512_bf16_linear,
        "out = x @ w.T (+ bias) with VDPBF16PS, x bfloat16 [M, K], w packed as for AMX [N/16, K/32, 16, 32] "
        "(K % 32 == 0, N % 16 == 0); out bfloat16, or float32 with out_float32; batch-invariant rows",
        py::arg("x"), py::arg("w_packed"), py::arg("bias") = py::none(), py::arg("out_float32") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_int8_available", &amx_int8_available,
        "Whether amx_u8s8_matmul runs here: built with AMX-INT8 and the process granted AMX state");
  m.def("amx_u8s8_matmul", &amx_u8s8_matmul,
        "float32 [M, N] exact integer sums x @ w.T of uint8 x [M, K] and int8 w packed [N/16, K/64, 16, 64] "
        "(K % 64 == 0, N % 16 == 0) on AMX (float(int32), rounded once)",
        py::arg("x"), py::arg("w_packed"), py::call_guard<py::gil_scoped_release>());
  m.def("amx_int8_linear", &amx_int8_linear,
        "amx_u8s8_matmul with int8_epilogue fused: out = (((float(acc) - compensation[n]) * weight_scales[n]) * "
        "row_scales[m]) (+ bias[n]), bfloat16 or float32, the same bits as the two calls",
        py::arg("x"), py::arg("w_packed"), py::arg("compensation"), py::arg("weight_scales"),
        py::arg("row_scales"), py::arg("bias") = py::none(), py::arg("out_bfloat16") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("avx2_int8_available", &avx2_int8_available, "Whether avx2_int8_linear runs here: built with AVX2 and FMA");
  m.def("avx2_int8_vnni", &avx2_int8_vnni, "Whether avx2_int8_linear sums with AVX512-VNNI (VPDPBUSD)");
  m.def("avx2_int8_linear", &avx2_int8_linear,
        "The int8 W8A8 linear on AVX2: exact int32 sums acc = x @ w.T of uint8 x [M, K] (q + zero_point) and "
        "int8 w packed [ceil(N/16), K/4, 16, 4] (K % 4 == 0; colsum int32 [N] = each weight row's sum), then "
        "out = (((float(acc) - compensation[n]) * weight_scales[n]) * row_scales[m]) (+ bias[n]), bfloat16 or "
        "float32: the bits of int8_epilogue over the same sums. seven_bit_weights: the caller guarantees |w| <= 63 "
        "(then a faster path that multiplies the uint8 x directly); else x - zero_point must lie in [-127, 127] "
        "(a ValueError otherwise)",
        py::arg("x"), py::arg("w_packed"), py::arg("colsum"), py::arg("zero_point"), py::arg("compensation"),
        py::arg("weight_scales"), py::arg("row_scales"), py::arg("bias") = py::none(),
        py::arg("out_bfloat16") = false, py::arg("seven_bit_weights") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("topk_rows", &topk_rows,
        "The k largest values of each row of float32 x [N, V] (descending; ties by ascending index; NaN "
        "above +inf) and their indices int64 [N, k]; with chosen (int64 [N]) also each row's rank of "
        "x[row, chosen[row]]: 1 + the count of larger values (int64 [N]); with lse also each row's maximum m "
        "and log sum exp(x - m) (float32 [N] each; log_softmax = (x - m) - log_sum). Returned in that order",
        py::arg("x"), py::arg("k"), py::arg("chosen") = py::none(), py::arg("lse") = false, py::call_guard<py::gil_scoped_release>());
  m.def("token_presence", &token_presence,
        "The (row, token) pairs seen in history[i, :length[i]] (int64 [P, L]), sorted by row then token, "
        "with each one's count at positions >= prompt_len[i] (float32): three tensors [M]",
        py::arg("history"), py::arg("prompt_len"), py::arg("length"), py::arg("vocab_size"),
        py::call_guard<py::gil_scoped_release>());
  py::class_<StackLinear>(m, "StackLinear",
                          "One linear layer as DecoderStack calls it: the kernel its LinearMethod runs per layer, "
                          "with the same operands (decoder_stack.cpp)")
      .def_static("block", &StackLinear::block,
                  "GGUF blocks: packed uint8 weight [N, K/32 * bytes_per_block], fmt the ggml type id, bias [N] "
                  "or None (block_quant_linear)",
                  py::arg("weight"), py::arg("fmt"), py::arg("bias") = py::none())
      .def_static("int8_avx2", &StackLinear::int8_avx2,
                  "int8 W8A8 on AVX2: quantize_per_token(x, qmax, zero_point, smooth) then avx2_int8_linear with "
                  "w_packed, colsum, compensation, weight_scales, bias (float32 [N] or None), seven_bit_weights",
                  py::arg("w_packed"), py::arg("colsum"), py::arg("compensation"), py::arg("weight_scales"),
                  py::arg("smooth"), py::arg("qmax"), py::arg("zero_point"), py::arg("seven_bit_weights"),
                  py::arg("bias") = py::none())
      .def_static("int8_amx", &StackLinear::int8_amx,
                  "int8 W8A8 on AMX-INT8: quantize_per_token(x, qmax, zero_point, smooth) then amx_int8_linear with "
                  "w_packed (int8 [N/16, K/64, 16, 64]), compensation, weight_scales, bias (float32 [N] or None)",
                  py::arg("w_packed"), py::arg("compensation"), py::arg("weight_scales"), py::arg("smooth"),
                  py::arg("qmax"), py::arg("zero_point"), py::arg("bias") = py::none())
      .def_static("bf16_tiled", &StackLinear::bf16_tiled,
                  "bf16 weight in AMX B-tile order [N/16, K/32, 16, 32]: avx512_bf16_linear, or amx_bf16_linear "
                  "when amx, bf16 out; bias [N] or None",
                  py::arg("w_packed"), py::arg("amx"), py::arg("bias") = py::none())
      .def("__call__", &StackLinear::operator(), "x [T, K] -> [T, N] in x's dtype", py::arg("x"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("kind", &StackLinear::kind)
      .def_property_readonly("out_features", &StackLinear::out_features);
  py::class_<DecoderStack>(m, "DecoderStack",
                           "A Llama-family decoder stack run as one call: the kernels of the per-layer path in "
                           "its order (decoder_stack.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, double, double>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rms_norm_eps"), py::arg("attn_scale"))
      .def("add_layer", &DecoderStack::add_layer,
           "Append a layer: norm weights [hidden], its four linears (StackLinear: q|k|v, o, gate|up, down), "
           "the layer's K/V caches [slots, kv_heads, head_dim] and scales",
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("key_cache"), py::arg("value_cache"), py::arg("k_scale"), py::arg("v_scale"))
      .def("forward", &DecoderStack::forward,
           "h: layer 0's normed input, residual: the embeddings (updated in place), both [T, hidden]; "
           "returns [last MLP output, residual]",
           py::arg("h"), py::arg("residual"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"),
           py::arg("block_table"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_size"),
           py::arg("sliding_window"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &DecoderStack::num_layers);
}
