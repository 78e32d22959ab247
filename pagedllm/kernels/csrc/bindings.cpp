#include "ops.h"

// Every kernel runs with the GIL released (py::gil_scoped_release), as torch's own ops do:
// they touch no Python object, and a server runs its HTTP event loop in other threads of
// the same process, which would otherwise stall for the whole kernel (a prompt's
// attention: milliseconds per layer).

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Causal paged attention over a flattened batch (float32 or bfloat16), written into out",
        py::call_guard<py::gil_scoped_release>());
  m.def("reshape_and_cache", &reshape_and_cache,
        "Write K/V rows [T, kv_heads, head_dim] into the paged cache at slot_mapping",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :d]) * x[:, d:]",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x; x = rms_norm(residual) * weight (both in place)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_embedding", &rotary_embedding,
        "Rotate-half RoPE in place on x [T, heads, head_dim] with cos/sin [T, head_dim/2]",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize_per_token", &quantize_per_token,
        "Per-row symmetric int8 quantization of x [M, K] into uint8 out (q + zero_point) "
        "and float32 scales [M]",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_epilogue", &int8_epilogue,
        "out = (acc - compensation[n]) * weight_scales[n] * row_scales[m] (+ bias[n]) in out's dtype",
        py::call_guard<py::gil_scoped_release>());
}
