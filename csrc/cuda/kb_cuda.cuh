// Device-side helpers shared by the .cu files: error checking that throws with the failing call,
// device selection for the statically linked runtime, cached device attributes, and fp16 utilities.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kb_common.h"

#define KB_CUDA_CHECK(expr)                                                                          \
    do {                                                                                             \
        const cudaError_t kb_err_ = (expr);                                                          \
        if (kb_err_ != cudaSuccess)                                                                  \
            throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(kb_err_) + " (" + \
                                     cudaGetErrorString(kb_err_) + ") from " #expr " at " __FILE__  \
                                     ":" + std::to_string(__LINE__));                                \
    } while (0)

// After a <<<...>>> launch: configuration errors surface here, not from the launch itself.
#define KB_CHECK_LAUNCH() KB_CUDA_CHECK(cudaGetLastError())

namespace kb {
namespace cuda {

// Makes `device` current for this thread in this module's runtime (torch's runtime is separate).
void use_device(int device);

// Multiprocessor count of `device`, cached.
int sm_count(int device);

inline cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

inline unsigned int blocks_for(int64_t items, int threads, int64_t cap = 65535LL * 32) {
    int64_t b = (items + threads - 1) / threads;
    if (b < 1) b = 1;
    if (b > cap) b = cap;
    return static_cast<unsigned int>(b);
}

inline bool aligned(const void* p, std::uintptr_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// Lets `kernel` launch with `dynamic` bytes of dynamic shared memory: past 48 KB of static + dynamic shared memory a
// kernel must opt in, and the kernel's own static arrays count towards that limit (a launch with 46 KB dynamic and
// 5 KB static fails with "invalid argument" otherwise).
template <typename Kernel>
inline void allow_dynamic_smem(Kernel kernel, size_t dynamic) {
    cudaFuncAttributes attr;
    KB_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    if (dynamic + attr.sharedSizeBytes > 48 * 1024)
        KB_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(dynamic)));
}

__device__ __forceinline__ half2 u32_as_half2(uint32_t v) {
    half2 h;
    *reinterpret_cast<uint32_t*>(&h) = v;
    return h;
}

}  // namespace cuda
}  // namespace kb
