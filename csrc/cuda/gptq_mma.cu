// GPTQ 4-bit matrix product for 9..128 rows on the tensor cores, reading the packed weights once (a chat turn's
// new tokens, a long speculative verification): the GEMV kernels take 1..8 rows; past 128 rows (prompt chunks)
// dequantizing into one fp16 matrix for cuBLAS costs less than re-reading the packed weights per 128 rows.
//
// A block owns 64 output columns and one slice of K (split-K fills the GPU when the columns alone are too few
// tiles). Per step of 64 inputs its 128 threads load 8 packed rows x 64 columns (one 16-byte load each),
// dequantize them with the group's scale and zero ((q - z) * s in fp16, as gptq_dequantize rounds them) into
// shared memory as a [64 k][64 n] fp16 tile, stage x's [M, 64] slice beside it, and each of the 4 warps
// multiplies the x tiles by its 16 columns with 16x16x16 WMMA fragments, accumulating in fp32. The fp32 partial
// sums of each slice go to `partial` [splits, M padded to 16, N]; gptq_mma_reduce adds the slices and the bias
// into fp16 `out`.
#include <mma.h>

#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kThreads = 128;
constexpr int kBN = 64;           // output columns per block (4 warps x 16)
constexpr int kBK = 64;           // inputs per step (8 packed rows)
constexpr int kLdW = kBN + 8;     // padded row of the weight tile (halfs): spreads the fragment loads over banks
constexpr int kLdX = kBK + 8;     // padded row of the x tile

template <int MT>  // 16-row tiles of x: M <= 16 * MT
__global__ void __launch_bounds__(kThreads) gptq_mma_kernel(const half* __restrict__ x, int64_t x_stride, int m,
                                                            int k, const uint32_t* __restrict__ qweight, int n,
                                                            const half* __restrict__ scales,
                                                            const half* __restrict__ zeros, int group_size,
                                                            int k_per_split, float* __restrict__ partial) {
    __shared__ __align__(32) half w_s[kBK * kLdW];
    __shared__ __align__(32) half x_s[MT * 16 * kLdX];
    const int n0 = blockIdx.x * kBN, split = blockIdx.y, warp = threadIdx.x / 32;
    const int k_begin = split * k_per_split, k_end = min(k, k_begin + k_per_split);
    const int pr = threadIdx.x / 16, c4 = (threadIdx.x % 16) * 4;  // this thread's packed row and 4 columns
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) wmma::fill_fragment(acc[t], 0.0f);

    for (int k0 = k_begin; k0 < k_end; k0 += kBK) {
        {
            const int row = k0 / 8 + pr;  // packed row: inputs 8 * row .. 8 * row + 7, all in one group
            const uint4 q = __ldg(reinterpret_cast<const uint4*>(qweight + static_cast<int64_t>(row) * n + n0 + c4));
            const int64_t g = static_cast<int64_t>(8 * row / group_size) * n + n0 + c4;
            const uint2 s2 = __ldg(reinterpret_cast<const uint2*>(scales + g));
            const uint2 z2 = __ldg(reinterpret_cast<const uint2*>(zeros + g));
            const half2 s01 = u32_as_half2(s2.x), s23 = u32_as_half2(s2.y);
            const half2 z01 = u32_as_half2(z2.x), z23 = u32_as_half2(z2.y);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int sh = 4 * j;
                const half2 q01 = __halves2half2(__int2half_rn((q.x >> sh) & 15u), __int2half_rn((q.y >> sh) & 15u));
                const half2 q23 = __halves2half2(__int2half_rn((q.z >> sh) & 15u), __int2half_rn((q.w >> sh) & 15u));
                const half2 w01 = __hmul2(__hsub2(q01, z01), s01), w23 = __hmul2(__hsub2(q23, z23), s23);
                uint2 packed;
                packed.x = *reinterpret_cast<const uint32_t*>(&w01);
                packed.y = *reinterpret_cast<const uint32_t*>(&w23);
                *reinterpret_cast<uint2*>(w_s + (pr * 8 + j) * kLdW + c4) = packed;
            }
        }
        for (int i = threadIdx.x; i < MT * 16 * (kBK / 8); i += kThreads) {
            const int r = i / (kBK / 8), part = i % (kBK / 8);
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (r < m) v = __ldg(reinterpret_cast<const uint4*>(x + r * x_stride + k0 + part * 8));
            *reinterpret_cast<uint4*>(x_s + r * kLdX + part * 8) = v;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kBK; kk += 16) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b;
            wmma::load_matrix_sync(b, w_s + kk * kLdW + warp * 16, kLdW);
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a;
                wmma::load_matrix_sync(a, x_s + t * 16 * kLdX + kk, kLdX);
                wmma::mma_sync(acc[t], a, b, acc[t]);
            }
        }
        __syncthreads();
    }
    float* base = partial + static_cast<int64_t>(split) * (MT * 16) * n + n0 + warp * 16;
#pragma unroll
    for (int t = 0; t < MT; ++t)
        wmma::store_matrix_sync(base + static_cast<int64_t>(t) * 16 * n, acc[t], n, wmma::mem_row_major);
}

// out[r, c] = sum over slices of partial[s, r, c] (+ bias[c]) for the first m rows.
__global__ void gptq_mma_reduce(const float* __restrict__ partial, int splits, int64_t slice, int m, int n,
                                const half* __restrict__ bias, half* __restrict__ out) {
    const int64_t total = static_cast<int64_t>(m) * n;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        float s = bias ? __half2float(bias[i % n]) : 0.0f;
        for (int p = 0; p < splits; ++p) s += partial[p * slice + i];
        out[i] = __float2half(s);
    }
}

template <int MT>
void launch(const MmaArgs& a, int splits, int k_per_split) {
    const dim3 grid(static_cast<unsigned>(a.n / kBN), static_cast<unsigned>(splits));
    gptq_mma_kernel<MT><<<grid, kThreads, 0, as_stream(a.stream)>>>(
        static_cast<const half*>(a.x), a.x_stride, static_cast<int>(a.m), static_cast<int>(a.k), a.qweight,
        static_cast<int>(a.n), static_cast<const half*>(a.scales), static_cast<const half*>(a.zeros),
        static_cast<int>(a.group_size), k_per_split, a.partial);
}

}  // namespace

void gptq_mma(const MmaArgs& a) {
    require(a.m >= 1 && a.m <= kMmaMaxRows, "gptq_mma takes 1..128 rows");
    require(a.k % kBK == 0 && a.n % kBN == 0 && a.k < (1LL << 31) && a.n < (1LL << 31),
            "gptq_mma needs K and N multiples of 64");
    require(a.group_size % 8 == 0 && a.groups == (a.k + a.group_size - 1) / a.group_size,
            "gptq_mma needs a group size that is a multiple of 8 and ceil(K / group_size) groups");
    require(a.x_stride % 8 == 0 && aligned(a.x, 16) && aligned(a.qweight, 16) && aligned(a.scales, 8) &&
                aligned(a.zeros, 8) && aligned(a.partial, 32),
            "gptq_mma: x rows, weights, scales, zeros and the partial sums must be aligned");
    require(a.splits >= 1 && a.splits <= a.k / kBK, "gptq_mma: splits must be in 1..K/64");
    use_device(a.device);
    const int64_t steps = a.k / kBK;
    const int k_per_split = static_cast<int>((steps + a.splits - 1) / a.splits * kBK);
    const int splits = static_cast<int>((a.k + k_per_split - 1) / k_per_split);
    const int mt = static_cast<int>((a.m + 15) / 16);
    switch (mt) {
        case 1: launch<1>(a, splits, k_per_split); break;
        case 2: launch<2>(a, splits, k_per_split); break;
        case 3: launch<3>(a, splits, k_per_split); break;
        case 4: launch<4>(a, splits, k_per_split); break;
        case 5: launch<5>(a, splits, k_per_split); break;
        case 6: launch<6>(a, splits, k_per_split); break;
        case 7: launch<7>(a, splits, k_per_split); break;
        default: launch<8>(a, splits, k_per_split); break;
    }
    KB_CHECK_LAUNCH();
    const int64_t slice = static_cast<int64_t>(mt) * 16 * a.n;
    gptq_mma_reduce<<<blocks_for(a.m * a.n, 256, 8LL * sm_count(a.device)), 256, 0, as_stream(a.stream)>>>(
        a.partial, splits, slice, static_cast<int>(a.m), static_cast<int>(a.n), static_cast<const half*>(a.bias),
        static_cast<half*>(a.out));
    KB_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace kb
