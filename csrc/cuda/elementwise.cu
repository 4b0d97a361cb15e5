// silu(gate) * up over fp16 vectors (half2 when aligned), rounding like torch: silu to fp16, then the product.
#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ half silu_mul_one(half g, half u) {
    const float x = __half2float(g);
    const half s = __float2half(x / (1.0f + expf(-x)));
    return __float2half(__half2float(s) * __half2float(u));
}

__global__ void silu_mul_kernel(const half* __restrict__ g, const half* __restrict__ u, half* __restrict__ o,
                                int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        o[i] = silu_mul_one(g[i], u[i]);
}

__global__ void silu_mul_kernel2(const half2* __restrict__ g, const half2* __restrict__ u, half2* __restrict__ o,
                                 int64_t n2) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n2;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const half2 a = g[i], b = u[i];
        o[i] = __halves2half2(silu_mul_one(__low2half(a), __low2half(b)), silu_mul_one(__high2half(a), __high2half(b)));
    }
}

}  // namespace

void silu_mul(const void* gate, const void* up, int64_t n, void* out, int device, std::uintptr_t stream) {
    require(n >= 0, "silu_mul: negative size");
    if (n == 0) return;
    use_device(device);
    const int sms = sm_count(device);
    if (n % 2 == 0 && aligned(gate, 4) && aligned(up, 4) && aligned(out, 4)) {
        silu_mul_kernel2<<<blocks_for(n / 2, kThreads, 8LL * sms), kThreads, 0, as_stream(stream)>>>(
            static_cast<const half2*>(gate), static_cast<const half2*>(up), static_cast<half2*>(out), n / 2);
    } else {
        silu_mul_kernel<<<blocks_for(n, kThreads, 8LL * sms), kThreads, 0, as_stream(stream)>>>(
            static_cast<const half*>(gate), static_cast<const half*>(up), static_cast<half*>(out), n);
    }
    KB_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace kb
