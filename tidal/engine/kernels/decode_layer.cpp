// One decoder layer for a step of decodes, in C++ (torch.ops.tidal.decode_layer).
//
// The same ATen calls, in the same order, as DecoderLayer.forward in engine/model.py when every
// token is a decode (norm, QKV, rotate-half RoPE, KV write, paged attention, output projection,
// residual, norm, gate/up, SiLU * up, down, residual), so the result is bit for bit the eager
// one; what it saves is the Python between them: ~30 torch calls a layer from Python cost more
// than the arithmetic of a one-token step. Weights: each matrix's float32 weight, and where it
// has a Q4_1 copy for steps of at most max_tokens rows, that copy (empty tensors when not).
#include "kernels.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace {

// linear i of [qkv, o, gate_up, down]; shapes[3 i .. 3 i + 2] = (outputs, inputs, max_tokens)
at::Tensor linear(const at::Tensor& x, int64_t i, at::TensorList weights, at::TensorList qs, at::TensorList dm,
                  at::IntArrayRef shapes, const std::optional<at::Tensor>& bias) {
  const int64_t n = shapes[3 * i], k = shapes[3 * i + 1], max_tokens = shapes[3 * i + 2];
  if (qs[i].numel() > 0 && x.size(0) <= max_tokens) {
    at::Tensor y = tidal::q4_1_mm(x.contiguous(), qs[i], dm[i], n, k);
    return bias ? y + *bias : y;
  }
  return at::linear(x, weights[i], bias);
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return w * at::rms_norm(x, {x.size(-1)}, std::nullopt, eps);  // as RMSNorm.forward
}

at::Tensor decode_layer(const at::Tensor& h, const at::Tensor& norm1, const at::Tensor& norm2, at::TensorList weights,
                        at::TensorList qs, at::TensorList dm, at::IntArrayRef shapes,
                        const std::optional<at::Tensor>& qkv_bias, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                        const at::Tensor& block_tables, const at::Tensor& positions, int64_t num_heads,
                        int64_t num_kv_heads, double eps, double scale) {
  TORCH_CHECK(weights.size() == 4 && qs.size() == 4 && dm.size() == 4 && shapes.size() == 12,
              "decode_layer: four matrices (qkv, o, gate_up, down), each with (outputs, inputs, max_tokens)");
  TORCH_CHECK(h.dim() == 2 && k_cache.dim() == 4, "decode_layer: h must be [tokens, hidden], the caches 4-d");
  const int64_t T = h.size(0), D = k_cache.size(3), H = num_heads, KVH = num_kv_heads;
  const int64_t q_size = H * D, kv_size = KVH * D;
  at::Tensor x = norm(h, norm1, eps);
  at::Tensor qkv = linear(x, 0, weights, qs, dm, shapes, qkv_bias);
  // q and k rotated in one call, as Rotary.apply: [x1 cos - x2 sin, x2 cos + x1 sin]
  std::vector<at::Tensor> halves = qkv.narrow(1, 0, q_size + kv_size).view({T, -1, D}).chunk(2, -1);
  at::Tensor qk = at::cat({halves[0] * cos - halves[1] * sin, halves[1] * cos + halves[0] * sin}, -1);
  at::Tensor q = qk.narrow(1, 0, H), k = qk.narrow(1, H, KVH);
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, KVH, D});
  const int64_t slots_total = k_cache.size(0) * k_cache.size(1);
  k_cache.view({slots_total, KVH, D}).index_copy_(0, slots, k);
  v_cache.view({slots_total, KVH, D}).index_copy_(0, slots, v);
  at::Tensor a = tidal::paged_decode_attention(q.contiguous(), k_cache, v_cache, block_tables, positions, scale);
  at::Tensor hs = h + linear(a.view({T, q_size}), 1, weights, qs, dm, shapes, std::nullopt);
  x = norm(hs, norm2, eps);
  std::vector<at::Tensor> gu = linear(x, 2, weights, qs, dm, shapes, std::nullopt).chunk(2, -1);
  return hs + linear(at::silu(gu[0]) * gu[1], 3, weights, qs, dm, shapes, std::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal, m) {
  m.def("decode_layer(Tensor h, Tensor norm1, Tensor norm2, Tensor[] weights, Tensor[] qs, Tensor[] dm, "
        "int[] shapes, Tensor? qkv_bias, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, Tensor block_tables, Tensor positions, int num_heads, int num_kv_heads, float eps, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal, CPU, m) { m.impl("decode_layer", &decode_layer); }
