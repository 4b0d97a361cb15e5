// Build information, driver/runtime queries and per-thread device selection for the statically linked
// CUDA runtime of kobold_backend._ext_cuda.
#include <mutex>
#include <string>

#include "kb_cuda.cuh"
#include "ops_cuda.h"

#ifndef KB_CUDA_ARCHS
#define KB_CUDA_ARCHS "unknown"
#endif

namespace kb {
namespace cuda {

BuildInfo build_info() {
    BuildInfo info;
    info.cuda_version = CUDART_VERSION;
    info.archs = KB_CUDA_ARCHS;
    info.nvcc = std::to_string(__CUDACC_VER_MAJOR__) + "." + std::to_string(__CUDACC_VER_MINOR__) + "." +
                std::to_string(__CUDACC_VER_BUILD__);
#if defined(__clang__)
    info.host_compiler = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    info.host_compiler = std::string("gcc ") + __VERSION__;
#elif defined(_MSC_VER)
    info.host_compiler = "msvc " + std::to_string(_MSC_VER);
#else
    info.host_compiler = "unknown";
#endif
    return info;
}

int driver_version() {
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess) v = 0;
    return v;
}

int runtime_version() {
    int v = 0;
    KB_CUDA_CHECK(cudaRuntimeGetVersion(&v));
    return v;
}

int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no device" error of this runtime
        n = 0;
    }
    return n;
}

void use_device(int device) {
    thread_local int current = -1;
    if (device != current) {
        KB_CUDA_CHECK(cudaSetDevice(device));
        current = device;
    }
}

int sm_count(int device) {
    constexpr int kMaxDevices = 256;
    static int cache[kMaxDevices] = {};
    static std::mutex lock;
    require(device >= 0 && device < kMaxDevices, "device index out of range");
    std::lock_guard<std::mutex> guard(lock);
    if (cache[device] == 0) {
        int n = 0;
        KB_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
        cache[device] = n > 0 ? n : 1;
    }
    return cache[device];
}

}  // namespace cuda
}  // namespace kb
