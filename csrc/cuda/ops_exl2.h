// Host-side interface of the EXL2 kernels (exllamav2's mixed 2-8 bit format, read as stored; docs/exl2.md).
// Plain C++ types only, like ops_cuda.h; pointers are device addresses, `stream` a cudaStream_t as an integer.
#pragma once

#include <cstdint>

#include "ops_cuda.h"

namespace kb {
namespace cuda {

struct Exl2Args {
    const void* x;  // [M, K] fp16, row stride x_stride (GEMV only)
    int64_t x_stride, m, k;
    const int64_t* perm;       // [K]: stored row r holds input feature perm[r]
    const uint32_t* q_weight;  // [qrows, n_stored] as stored
    int64_t n, n_stored;       // output features, stored columns (n rounded up to 32, or n)
    const uint32_t* q_scale;   // [G, n_stored / 8] 4-bit scale codes
    const void* q_scale_max;   // [G] fp16
    const int32_t* chunks;     // [K / 32, 2]: first word row and width of each 32-row chunk
    const int32_t* chunk_groups;  // [K / 32]: the group of each chunk
    const void* bias;          // [n] fp16 or null
    void* out;                 // GEMV: [M, n] fp16; dequantize: [K, n] fp16 (input-feature order)
    Workspace ws;
    int device;
    std::uintptr_t stream;
};

void exl2_gemv(const Exl2Args& a);        // M in 1..4, K % 32 == 0, n_stored % 32 == 0
void exl2_dequantize(const Exl2Args& a);  // K % 32 == 0, n_stored % 32 == 0

}  // namespace cuda
}  // namespace kb
