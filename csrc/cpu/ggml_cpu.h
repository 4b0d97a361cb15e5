// CPU kernels on GGML block formats (kobold_backend._ext_cpu): raw pointers, shapes in elements, dtype codes from
// kb_common.h, block type codes from ggml_blocks.h. The caller checks that K is a multiple of the block size and
// that each weight row holds row_bytes bytes.
#pragma once

#include <cstdint>

namespace kb {
namespace cpu {

struct GgmlGemvArgs {
    int type;              // ggml_type id
    const uint8_t* w;      // [N, row_bytes] blocks as stored
    int64_t row_bytes, n, k;
    const void* x;         // [M, K] (x_dtype), row stride x_stride
    int x_dtype;
    int64_t x_stride, m;
    const void* bias;      // [N] (bias_dtype) or null
    int bias_dtype;
    void* out;             // [M, N] contiguous (out_dtype)
    int out_dtype;
    int threads;
};

// out = x @ dequant(w).T + bias for 1..8 rows of x, fp32 accumulation.
void ggml_gemv(const GgmlGemvArgs& a);

// out [N, K] (out_dtype) = dequant(w).
void ggml_dequantize(int type, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k, void* out, int out_dtype,
                     int threads);

}  // namespace cpu
}  // namespace kb
