// pybind11 binding of kobold_backend._ext_cpu: plain integers (data pointers, shapes, strides, dtype
// codes) in, nothing out; kobold_backend/ops/native.py allocates tensors and passes their addresses.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "ggml_cpu.h"
#include "kb_common.h"
#include "ops_cpu.h"

// The digest of the sources this module was built from (build.py passes it; ops/native.py compares it).
#ifndef KB_SOURCES
#define KB_SOURCES "unknown"
#endif

namespace py = pybind11;
using kb::cpu::AttnArgs;
using kb::cpu::GemvArgs;
using kb::cpu::KvqAttnArgs;
using kb::cpu::RopeArgs;

namespace {

template <typename T>
T* ptr(std::uintptr_t p) {
    return reinterpret_cast<T*>(p);
}

std::string compiler() {
#if defined(__clang__)
    return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    return std::string("gcc ") + __VERSION__;
#elif defined(_MSC_VER)
    return "msvc " + std::to_string(_MSC_VER);
#else
    return "unknown";
#endif
}

py::dict fingerprint() {
    py::dict d;
    d["kind"] = "cpu";
    d["version"] = KB_VERSION;
    d["sources"] = KB_SOURCES;
    d["cuda_version"] = py::none();
    d["archs"] = py::list();
    d["compiler"] = compiler();
#if defined(_OPENMP)
    d["openmp"] = _OPENMP;
#else
    d["openmp"] = 0;
#endif
    return d;
}

}  // namespace

PYBIND11_MODULE(_ext_cpu, m) {
    m.doc() = "kobold_backend CPU kernels (raw pointers; see kobold_backend/ops/native.py)";
    m.def("fingerprint", &fingerprint);

    m.def(
        "gptq_gemv",
        [](std::uintptr_t x, int x_dtype, int64_t x_stride, int64_t rows, int64_t k, std::uintptr_t perm,
           std::uintptr_t qweight, int64_t n, std::uintptr_t scales, std::uintptr_t zeros, int sz_dtype,
           int64_t group_size, int64_t groups, std::uintptr_t bias, int bias_dtype, std::uintptr_t out,
           int out_dtype, int threads) {
            GemvArgs a{ptr<const void>(x), x_dtype, x_stride, rows, k, ptr<const int64_t>(perm),
                       ptr<const int32_t>(qweight), n, ptr<const void>(scales), ptr<const void>(zeros),
                       sz_dtype, group_size, groups, ptr<const void>(bias), bias_dtype, ptr<void>(out),
                       out_dtype, threads};
            kb::cpu::gptq_gemv(a);
        },
        py::call_guard<py::gil_scoped_release>());

    m.def(
        "gptq_dequantize",
        [](std::uintptr_t qweight, int64_t k, int64_t n, std::uintptr_t scales, std::uintptr_t zeros, int sz_dtype,
           int64_t group_size, int64_t groups, std::uintptr_t out, int threads) {
            kb::cpu::gptq_dequantize(ptr<const int32_t>(qweight), k, n, ptr<const void>(scales),
                                     ptr<const void>(zeros), sz_dtype, group_size, groups, ptr<void>(out),
                                     threads);
        },
        py::call_guard<py::gil_scoped_release>());

    m.def(
        "rms_norm",
        [](std::uintptr_t x, int64_t x_stride, std::uintptr_t residual, int64_t r_stride, int dtype, int64_t rows,
           int64_t d, std::uintptr_t weight, int w_dtype, float eps, std::uintptr_t y, std::uintptr_t residual_out,
           int threads) {
            kb::cpu::rms_norm(ptr<const void>(x), x_stride, ptr<const void>(residual), r_stride, dtype, rows, d,
                              ptr<const void>(weight), w_dtype, eps, ptr<void>(y), ptr<void>(residual_out),
                              threads);
        },
        py::call_guard<py::gil_scoped_release>());

    m.def(
        "rope_cache_write",
        [](std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, int dtype, py::tuple qs, py::tuple ks,
           py::tuple vs, int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t d, std::uintptr_t cos,
           std::uintptr_t sin, int cs_dtype, int64_t cos_stride, int64_t sin_stride, int64_t pos,
           std::uintptr_t k_cache, std::uintptr_t v_cache, py::tuple kcs, py::tuple vcs, std::uintptr_t q_out,
           int threads) {
            RopeArgs a{ptr<const void>(q), ptr<const void>(k), ptr<const void>(v), dtype,
                       qs[0].cast<int64_t>(), qs[1].cast<int64_t>(), qs[2].cast<int64_t>(),
                       ks[0].cast<int64_t>(), ks[1].cast<int64_t>(), ks[2].cast<int64_t>(),
                       vs[0].cast<int64_t>(), vs[1].cast<int64_t>(), vs[2].cast<int64_t>(),
                       b, t, hq, hkv, d, ptr<const void>(cos), ptr<const void>(sin), cs_dtype, cos_stride,
                       sin_stride, pos, ptr<void>(k_cache), ptr<void>(v_cache),
                       kcs[0].cast<int64_t>(), kcs[1].cast<int64_t>(), kcs[2].cast<int64_t>(),
                       vcs[0].cast<int64_t>(), vcs[1].cast<int64_t>(), vcs[2].cast<int64_t>(),
                       ptr<void>(q_out), threads};
            py::gil_scoped_release release;
            kb::cpu::rope_cache_write(a);
        });

    m.def(
        "decode_attention",
        [](std::uintptr_t q, int dtype, int64_t q_sb, int64_t q_sh, int64_t b, int64_t hq, int64_t hkv, int64_t d,
           std::uintptr_t k_cache, std::uintptr_t v_cache, py::tuple kcs, py::tuple vcs, int64_t seq_len,
           float scale, std::uintptr_t out, int threads) {
            AttnArgs a{ptr<const void>(q), dtype, q_sb, q_sh, b, hq, hkv, d,
                       ptr<const void>(k_cache), ptr<const void>(v_cache),
                       kcs[0].cast<int64_t>(), kcs[1].cast<int64_t>(), kcs[2].cast<int64_t>(),
                       vcs[0].cast<int64_t>(), vcs[1].cast<int64_t>(), vcs[2].cast<int64_t>(),
                       seq_len, scale, ptr<void>(out), threads};
            py::gil_scoped_release release;
            kb::cpu::decode_attention(a);
        });

    m.def(
        "kvq_decode_attention",
        [](std::uintptr_t q, int64_t q_sb, int64_t q_sh, int64_t b, int64_t hq, int64_t hkv, int64_t d,
           std::uintptr_t kd, std::uintptr_t ks, std::uintptr_t vd, std::uintptr_t vs, py::tuple kds, py::tuple kss,
           py::tuple vds, py::tuple vss, int k_bits, int v_bits, int64_t seq_len, float scale, int64_t window,
           float softcap, std::uintptr_t out, int threads) {
            KvqAttnArgs a{ptr<const void>(q), q_sb, q_sh, b, hq, hkv, d, ptr<const void>(kd), ptr<const void>(ks),
                          ptr<const void>(vd), ptr<const void>(vs),
                          kds[0].cast<int64_t>(), kds[1].cast<int64_t>(), kds[2].cast<int64_t>(),
                          kss[0].cast<int64_t>(), kss[1].cast<int64_t>(), kss[2].cast<int64_t>(),
                          vds[0].cast<int64_t>(), vds[1].cast<int64_t>(), vds[2].cast<int64_t>(),
                          vss[0].cast<int64_t>(), vss[1].cast<int64_t>(), vss[2].cast<int64_t>(),
                          k_bits, v_bits, seq_len, scale, window, softcap, ptr<void>(out), threads};
            py::gil_scoped_release release;
            kb::cpu::kvq_decode_attention(a);
        });

    m.def(
        "silu_mul",
        [](std::uintptr_t gate, std::uintptr_t up, int dtype, int64_t n, std::uintptr_t out, int threads) {
            kb::cpu::silu_mul(ptr<const void>(gate), ptr<const void>(up), dtype, n, ptr<void>(out), threads);
        },
        py::call_guard<py::gil_scoped_release>());

    m.def(
        "ggml_gemv",
        [](int type, std::uintptr_t w, int64_t row_bytes, int64_t n, int64_t k, std::uintptr_t x, int x_dtype,
           int64_t x_stride, int64_t rows, std::uintptr_t bias, int bias_dtype, std::uintptr_t out, int out_dtype,
           int threads) {
            kb::cpu::GgmlGemvArgs a{type, ptr<const uint8_t>(w), row_bytes, n, k, ptr<const void>(x), x_dtype,
                                    x_stride, rows, ptr<const void>(bias), bias_dtype, ptr<void>(out), out_dtype,
                                    threads};
            kb::cpu::ggml_gemv(a);
        },
        py::call_guard<py::gil_scoped_release>());

    m.def(
        "ggml_dequantize",
        [](int type, std::uintptr_t w, int64_t row_bytes, int64_t n, int64_t k, std::uintptr_t out, int out_dtype,
           int threads) {
            kb::cpu::ggml_dequantize(type, ptr<const uint8_t>(w), row_bytes, n, k, ptr<void>(out), out_dtype, threads);
        },
        py::call_guard<py::gil_scoped_release>());
}
