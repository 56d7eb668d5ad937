// Python bindings of the CPU kernels (kernels/cpu_extension.py builds them into one module).

#include <torch/extension.h>

#include <optional>

void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                      at::Tensor seq_lens, at::Tensor token_idx, at::Tensor seq_idx, double scale,
                      int64_t sliding_window);
void silu_and_mul_cpu(at::Tensor out, at::Tensor x);
void fused_add_rms_norm_cpu(at::Tensor out, at::Tensor res_out, at::Tensor x, std::optional<at::Tensor> residual,
                            at::Tensor weight, double eps);
void rotary_cpu(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Paged decode attention (writes out in place)");
  m.def("silu_and_mul", &silu_and_mul_cpu, "silu(x[:, :I]) * x[:, I:] into out");
  m.def("fused_add_rms_norm", &fused_add_rms_norm_cpu, "res_out = x + residual; out = rms_norm(res_out) * weight");
  m.def("rotary", &rotary_cpu, "Rotary embedding of q and k in place");
}
