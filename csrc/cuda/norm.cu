// RMSNorm and fused residual add + RMSNorm over fp16 rows: one block per row, fp32 sums.
#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load_w(const half* w, int i) { return __half2float(w[i]); }
__device__ __forceinline__ float load_w(const float* w, int i) { return w[i]; }

__device__ float block_sum(float v, float* shared) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < kThreads / 32; ++i) total += shared[i];
    return total;
}

// residual_out = x + residual (rounded to fp16, as torch adds fp16 tensors); y = rms_norm(that) * w.
template <typename W>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(const half* __restrict__ x, int64_t x_stride,
                                                            const half* __restrict__ res, int64_t r_stride,
                                                            const W* __restrict__ w, half* __restrict__ y,
                                                            half* __restrict__ res_out, int d, float eps) {
    __shared__ float shared[kThreads / 32];
    const int64_t row = blockIdx.x;
    const half* xr = x + row * x_stride;
    half* yr = y + row * d;
    const half* src = xr;
    float ss = 0.0f;
    if (res) {
        const half* rr = res + row * r_stride;
        half* ro = res_out + row * d;
        for (int i = threadIdx.x; i < d; i += kThreads) {
            const half h = __float2half(__half2float(xr[i]) + __half2float(rr[i]));
            ro[i] = h;
            const float v = __half2float(h);
            ss += v * v;
        }
        src = ro;  // each thread reads back only the elements it wrote
    } else {
        for (int i = threadIdx.x; i < d; i += kThreads) {
            const float v = __half2float(xr[i]);
            ss += v * v;
        }
    }
    const float inv = rsqrtf(block_sum(ss, shared) / static_cast<float>(d) + eps);
    for (int i = threadIdx.x; i < d; i += kThreads) yr[i] = __float2half((__half2float(src[i]) * inv) * load_w(w, i));
}

}  // namespace

void rms_norm(const void* x, int64_t x_stride, const void* residual, int64_t r_stride, int64_t rows, int64_t d,
              const void* weight, int w_dtype, float eps, void* y, void* residual_out, int device,
              std::uintptr_t stream) {
    require(rows >= 0 && rows <= 2147483647LL && d >= 1 && d < (1LL << 31), "rms_norm: bad shape");
    require(!residual || residual_out, "rms_norm: a residual needs a residual_out buffer");
    require(w_dtype == F16 || w_dtype == F32, "rms_norm: the CUDA weight must be float16 or float32");
    if (rows == 0) return;
    use_device(device);
    const dim3 grid(static_cast<unsigned>(rows));
    const half* xh = static_cast<const half*>(x);
    const half* rh = static_cast<const half*>(residual);
    if (w_dtype == F16)
        rms_norm_kernel<half><<<grid, kThreads, 0, as_stream(stream)>>>(
            xh, x_stride, rh, r_stride, static_cast<const half*>(weight), static_cast<half*>(y),
            static_cast<half*>(residual_out), static_cast<int>(d), eps);
    else
        rms_norm_kernel<float><<<grid, kThreads, 0, as_stream(stream)>>>(
            xh, x_stride, rh, r_stride, static_cast<const float*>(weight), static_cast<half*>(y),
            static_cast<half*>(residual_out), static_cast<int>(d), eps);
    KB_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace kb
