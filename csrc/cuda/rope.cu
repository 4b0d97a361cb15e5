// RoPE (rotate-half) on q and k at positions pos..pos+T-1, fused with the K/V cache write.
#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

__device__ __forceinline__ float to_f(half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }

// One block per (b, t, head) over Hq query heads then Hkv key heads; threads over rotation pairs.
template <typename C>
__global__ void rope_kernel(RopeArgs a) {
    const int64_t heads = a.hq + a.hkv;
    const int64_t item = blockIdx.x;
    const int64_t h = item % heads, bt = item / heads, t = bt % a.t, b = bt / a.t;
    const int64_t p = (a.pos_dev ? *a.pos_dev : a.pos) + t;
    if (p < 0 || p >= a.max_pos) return;  // only a device-side position can be out of range here
    const int64_t half_d = a.d / 2;
    const C* c = static_cast<const C*>(a.cos) + p * a.cos_stride;
    const C* s = static_cast<const C*>(a.sin) + p * a.sin_stride;
    const half* src;
    half* dst;
    if (h < a.hq) {
        src = static_cast<const half*>(a.q) + b * a.q_sb + t * a.q_st + h * a.q_sh;
        dst = static_cast<half*>(a.q_out) + ((b * a.t + t) * a.hq + h) * a.d;
    } else {
        const int64_t hk = h - a.hq;
        src = static_cast<const half*>(a.k) + b * a.k_sb + t * a.k_st + hk * a.k_sh;
        dst = static_cast<half*>(a.k_cache) + b * a.kc_sb + hk * a.kc_sh + p * a.kc_ss;
        const half* vs = static_cast<const half*>(a.v) + b * a.v_sb + t * a.v_st + hk * a.v_sh;
        half* vd = static_cast<half*>(a.v_cache) + b * a.vc_sb + hk * a.vc_sh + p * a.vc_ss;
        for (int64_t i = threadIdx.x; i < a.d; i += blockDim.x) vd[i] = vs[i];
    }
    for (int64_t i = threadIdx.x; i < half_d; i += blockDim.x) {
        const float x0 = __half2float(src[i]), x1 = __half2float(src[i + half_d]);
        const float a0 = x0 * to_f(c[i]), b0 = -x1 * to_f(s[i]);
        const float a1 = x1 * to_f(c[i + half_d]), b1 = x0 * to_f(s[i + half_d]);
        dst[i] = __float2half(a0 + b0);
        dst[i + half_d] = __float2half(a1 + b1);
    }
}

}  // namespace

void rope_cache_write(const RopeArgs& a) {
    require(a.d >= 2 && a.d % 2 == 0, "rope_cache_write needs an even head dimension");
    require(a.cs_dtype == F16 || a.cs_dtype == F32, "rope_cache_write: cos/sin must be float16 or float32");
    const int64_t items = a.b * a.t * (a.hq + a.hkv);
    require(items <= 2147483647LL, "rope_cache_write: too many heads x tokens for one launch");
    if (items == 0) return;
    use_device(a.device);
    const int64_t pairs = a.d / 2;
    const int threads = static_cast<int>(pairs >= 128 ? 128 : (pairs + 31) / 32 * 32);
    if (a.cs_dtype == F16)
        rope_kernel<half><<<static_cast<unsigned>(items), threads, 0, as_stream(a.stream)>>>(a);
    else
        rope_kernel<float><<<static_cast<unsigned>(items), threads, 0, as_stream(a.stream)>>>(a);
    KB_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace kb
