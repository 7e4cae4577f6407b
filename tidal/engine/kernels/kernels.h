// The kernels one source calls from another (each is also registered as a torch op by its own source).
#pragma once

#include <ATen/ATen.h>

namespace tidal {

// x [M, k] float32 times a Q4_1 matrix of n outputs (qmatmul.cpp)
at::Tensor q4_1_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm, int64_t n, int64_t k);

// decode attention over the paged KV cache (paged_attention.cpp)
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& positions, double scale);

}  // namespace tidal
