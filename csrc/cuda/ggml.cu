// CUDA kernels on GGML block formats as GGUF files store them (csrc/include/ggml_blocks.h): a GEMV for 1..4 fp16
// rows (one warp per output feature, each lane decoding eight consecutive weights per step, fp32 accumulation) and
// a dequantization to fp16 for prompts (then one cuBLAS GEMM from torch).
#include "ggml_blocks.h"
#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// Eight fp16 activations (16-byte aligned) dotted with eight fp32 weights.
__device__ __forceinline__ float dot8(const half* __restrict__ x, const float (&w)[8]) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(x));
    const float2 a = __half22float2(u32_as_half2(v.x)), b = __half22float2(u32_as_half2(v.y));
    const float2 c = __half22float2(u32_as_half2(v.z)), d = __half22float2(u32_as_half2(v.w));
    float s = w[0] * a.x;
    s = fmaf(w[1], a.y, s);
    s = fmaf(w[2], b.x, s);
    s = fmaf(w[3], b.y, s);
    s = fmaf(w[4], c.x, s);
    s = fmaf(w[5], c.y, s);
    s = fmaf(w[6], d.x, s);
    s = fmaf(w[7], d.y, s);
    return s;
}

// Grid: ceil(N / kWarps) blocks; warp w of block b computes output feature b * kWarps + w for all M rows.
// Chunk f (eight weights) of the row is block f / C, part f % C (C = chunks per block); lane l takes chunks
// l, l + 32, ... so a warp reads each row front to back.
template <int T, int M>
__global__ void __launch_bounds__(kThreads) ggml_gemv_kernel(const uint8_t* __restrict__ w, int64_t row_bytes,
                                                             int n, int k, const half* __restrict__ x,
                                                             int64_t x_stride, const half* __restrict__ bias,
                                                             half* __restrict__ out) {
    using B = ggml::Block<T>;
    constexpr int C = B::elements / 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * kWarps + warp;
    if (row >= n) return;
    const uint8_t* __restrict__ wr = w + row * row_bytes;
    const int chunks = k / 8;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.f;
#pragma unroll 4
    for (int f = lane; f < chunks; f += 32) {
        float v[8];
        B::decode8(wr + (f / C) * B::bytes, f % C, v);
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] += dot8(x + m * x_stride + 8 * f, v);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float s = acc[m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        acc[m] = s;
    }
    if (lane == 0) {
        const float b = bias ? __half2float(bias[row]) : 0.f;
#pragma unroll
        for (int m = 0; m < M; ++m) out[static_cast<int64_t>(m) * n + row] = __float2half(acc[m] + b);
    }
}

template <int T>
__global__ void ggml_dequantize_kernel(const uint8_t* __restrict__ w, int64_t row_bytes, int64_t n, int64_t k,
                                       half* __restrict__ out) {
    using B = ggml::Block<T>;
    constexpr int C = B::elements / 8;
    const int64_t per_row = k / 8, total = n * per_row;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = i / per_row, f = i % per_row;
        float v[8];
        B::decode8(w + r * row_bytes + (f / C) * B::bytes, static_cast<int>(f % C), v);
        uint4 o;
        half2 h0 = __floats2half2_rn(v[0], v[1]), h1 = __floats2half2_rn(v[2], v[3]);
        half2 h2 = __floats2half2_rn(v[4], v[5]), h3 = __floats2half2_rn(v[6], v[7]);
        o.x = *reinterpret_cast<uint32_t*>(&h0);
        o.y = *reinterpret_cast<uint32_t*>(&h1);
        o.z = *reinterpret_cast<uint32_t*>(&h2);
        o.w = *reinterpret_cast<uint32_t*>(&h3);
        reinterpret_cast<uint4*>(out)[i] = o;
    }
}

struct GemvLaunch {
    const GgmlGemvArgs& a;
    template <int T, int M>
    void launch() const {
        const unsigned int blocks = static_cast<unsigned int>((a.n + kWarps - 1) / kWarps);
        ggml_gemv_kernel<T, M><<<blocks, kThreads, 0, as_stream(a.stream)>>>(
            static_cast<const uint8_t*>(a.w), a.row_bytes, static_cast<int>(a.n), static_cast<int>(a.k),
            static_cast<const half*>(a.x), a.x_stride, static_cast<const half*>(a.bias), static_cast<half*>(a.out));
    }
    template <int T>
    void run() const {
        switch (a.m) {
            case 1: launch<T, 1>(); break;
            case 2: launch<T, 2>(); break;
            case 3: launch<T, 3>(); break;
            default: launch<T, 4>(); break;
        }
    }
};

struct DequantizeLaunch {
    const uint8_t* w;
    int64_t row_bytes, n, k;
    void* out;
    int device;
    std::uintptr_t stream;
    template <int T>
    void run() const {
        const int64_t chunks = n * (k / 8);
        ggml_dequantize_kernel<T><<<blocks_for(chunks, 256, 16LL * sm_count(device)), 256, 0, as_stream(stream)>>>(
            w, row_bytes, n, k, static_cast<half*>(out));
    }
};

void check_block_args(int type, const void* w, int64_t row_bytes, int64_t n, int64_t k, const char* what) {
    const int elements = (type == ggml::Q4_K || type == ggml::Q5_K || type == ggml::Q6_K) ? 256 : 32;
    require(n > 0 && k > 0 && k % elements == 0, std::string(what) + ": K must be a positive multiple of the block");
    require(n < (1LL << 31) && k < (1LL << 31), std::string(what) + ": shape too large");
    // Q4_K/Q5_K quants are read with 8-byte loads, every other field with 2-byte loads.
    const std::uintptr_t align = (type == ggml::Q4_K || type == ggml::Q5_K) ? 8 : 2;
    require(aligned(w, align) && row_bytes % static_cast<int64_t>(align) == 0,
            std::string(what) + ": weight rows are not aligned for their block type");
}

}  // namespace

void ggml_gemv(const GgmlGemvArgs& a) {
    require(a.m >= 1 && a.m <= 4, "ggml_gemv: rows must be 1..4");
    check_block_args(a.type, a.w, a.row_bytes, a.n, a.k, "ggml_gemv");
    require(aligned(a.x, 16) && a.x_stride % 8 == 0 && a.x_stride >= a.k,
            "ggml_gemv: x rows must be 16-byte aligned");
    use_device(a.device);
    require(ggml::dispatch(a.type, GemvLaunch{a}), "ggml_gemv: unsupported block type " + std::to_string(a.type));
    KB_CHECK_LAUNCH();
}

void ggml_dequantize(int type, const void* w, int64_t row_bytes, int64_t n, int64_t k, void* out, int device,
                     std::uintptr_t stream) {
    check_block_args(type, w, row_bytes, n, k, "ggml_dequantize");
    require(aligned(out, 16), "ggml_dequantize: out must be 16-byte aligned");
    use_device(device);
    require(ggml::dispatch(type, DequantizeLaunch{static_cast<const uint8_t*>(w), row_bytes, n, k, out, device,
                                                  stream}),
            "ggml_dequantize: unsupported block type " + std::to_string(type));
    KB_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace kb
