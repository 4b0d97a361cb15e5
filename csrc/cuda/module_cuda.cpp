// pybind11 binding of kobold_backend._ext_cuda: plain integers (device pointers, shapes, strides, dtype
// codes, device index, cudaStream_t) in; no libtorch, so one build serves every torch of its CUDA major.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "kb_common.h"
#include "ops_cuda.h"
#include "ops_exl2.h"

// The digest of the sources this module was built from (build.py passes it; ops/native.py compares it).
#ifndef KB_SOURCES
#define KB_SOURCES "unknown"
#endif

namespace py = pybind11;
namespace kc = kb::cuda;

namespace {

template <typename T>
T* ptr(std::uintptr_t p) {
    return reinterpret_cast<T*>(p);
}

kc::Workspace workspace(py::tuple ws) {
    return kc::Workspace{ptr<float>(ws[0].cast<std::uintptr_t>()), ws[1].cast<int64_t>(),
                         ptr<uint32_t>(ws[2].cast<std::uintptr_t>()), ws[3].cast<int64_t>()};
}

int64_t at(py::tuple t, size_t i) { return t[i].cast<int64_t>(); }

py::dict fingerprint() {
    const kc::BuildInfo info = kc::build_info();
    py::dict d;
    d["kind"] = "cuda";
    d["version"] = KB_VERSION;
    d["sources"] = KB_SOURCES;
    d["cuda_version"] = std::to_string(info.cuda_version / 1000) + "." + std::to_string(info.cuda_version % 1000 / 10);
    py::list archs;
    size_t start = 0;
    while (start < info.archs.size()) {
        size_t end = info.archs.find(' ', start);
        if (end == std::string::npos) end = info.archs.size();
        if (end > start) archs.append(info.archs.substr(start, end - start));
        start = end + 1;
    }
    d["archs"] = archs;
    d["compiler"] = "nvcc " + info.nvcc + " / " + info.host_compiler;
    return d;
}

}  // namespace

PYBIND11_MODULE(_ext_cuda, m) {
    m.doc() = "kobold_backend CUDA kernels (raw pointers; see kobold_backend/ops/native.py)";
    m.def("fingerprint", &fingerprint);
    m.def("driver_version", &kc::driver_version);
    m.def("runtime_version", &kc::runtime_version);
    m.def("device_count", &kc::device_count);

    m.def("gptq_gemv", [](std::uintptr_t x, int64_t x_stride, int64_t rows, int64_t k, std::uintptr_t perm,
                          std::uintptr_t qweight, int64_t n, std::uintptr_t scales, std::uintptr_t zeros,
                          int64_t group_size, int64_t groups, std::uintptr_t bias, std::uintptr_t out, py::tuple ws,
                          int variant, int device, std::uintptr_t stream) {
        kc::GemvArgs a{ptr<const void>(x), x_stride, rows, k, ptr<const int64_t>(perm), ptr<const uint32_t>(qweight),
                       n, ptr<const void>(scales), ptr<const void>(zeros), group_size, groups,
                       ptr<const void>(bias), ptr<void>(out), workspace(ws), device, stream, variant};
        py::gil_scoped_release release;
        kc::gptq_gemv(a);
    });

    m.def("gptq_mma", [](std::uintptr_t x, int64_t x_stride, int64_t rows, int64_t k, std::uintptr_t qweight,
                         int64_t n, std::uintptr_t scales, std::uintptr_t zeros, int64_t group_size, int64_t groups,
                         std::uintptr_t bias, std::uintptr_t out, std::uintptr_t partial, int64_t splits, int device,
                         std::uintptr_t stream) {
        kc::MmaArgs a{ptr<const void>(x), x_stride, rows, k, ptr<const uint32_t>(qweight), n, ptr<const void>(scales),
                      ptr<const void>(zeros), group_size, groups, ptr<const void>(bias), ptr<void>(out),
                      ptr<float>(partial), splits, device, stream};
        py::gil_scoped_release release;
        kc::gptq_mma(a);
    });

    m.def("exl2_gemv", [](std::uintptr_t x, int64_t x_stride, int64_t rows, int64_t k, std::uintptr_t perm,
                          std::uintptr_t q_weight, int64_t n, int64_t n_stored, std::uintptr_t q_scale,
                          std::uintptr_t q_scale_max, std::uintptr_t chunks, std::uintptr_t chunk_groups,
                          std::uintptr_t bias, std::uintptr_t out, py::tuple ws, int device, std::uintptr_t stream) {
        kc::Exl2Args a{ptr<const void>(x), x_stride, rows, k, ptr<const int64_t>(perm), ptr<const uint32_t>(q_weight),
                       n, n_stored, ptr<const uint32_t>(q_scale), ptr<const void>(q_scale_max),
                       ptr<const int32_t>(chunks), ptr<const int32_t>(chunk_groups), ptr<const void>(bias),
                       ptr<void>(out), workspace(ws), device, stream};
        py::gil_scoped_release release;
        kc::exl2_gemv(a);
    });

    m.def("exl2_dequantize", [](int64_t k, std::uintptr_t perm, std::uintptr_t q_weight, int64_t n, int64_t n_stored,
                                std::uintptr_t q_scale, std::uintptr_t q_scale_max, std::uintptr_t chunks,
                                std::uintptr_t chunk_groups, std::uintptr_t out, int device, std::uintptr_t stream) {
        kc::Exl2Args a{nullptr, 0, 0, k, ptr<const int64_t>(perm), ptr<const uint32_t>(q_weight), n, n_stored,
                       ptr<const uint32_t>(q_scale), ptr<const void>(q_scale_max), ptr<const int32_t>(chunks),
                       ptr<const int32_t>(chunk_groups), nullptr, ptr<void>(out), kc::Workspace{nullptr, 0, nullptr, 0},
                       device, stream};
        py::gil_scoped_release release;
        kc::exl2_dequantize(a);
    });

    m.def(
        "gptq_dequantize",
        [](std::uintptr_t qweight, int64_t k, int64_t n, std::uintptr_t scales, std::uintptr_t zeros,
           int64_t group_size, int64_t groups, std::uintptr_t out, int device, std::uintptr_t stream) {
            kc::gptq_dequantize(ptr<const uint32_t>(qweight), k, n, ptr<const void>(scales), ptr<const void>(zeros),
                                group_size, groups, ptr<void>(out), device, stream);
        },
        py::call_guard<py::gil_scoped_release>());

    m.def(
        "rms_norm",
        [](std::uintptr_t x, int64_t x_stride, std::uintptr_t residual, int64_t r_stride, int64_t rows, int64_t d,
           std::uintptr_t weight, int w_dtype, float eps, std::uintptr_t y, std::uintptr_t residual_out, int device,
           std::uintptr_t stream) {
            kc::rms_norm(ptr<const void>(x), x_stride, ptr<const void>(residual), r_stride, rows, d,
                         ptr<const void>(weight), w_dtype, eps, ptr<void>(y), ptr<void>(residual_out), device,
                         stream);
        },
        py::call_guard<py::gil_scoped_release>());

    m.def("rope_cache_write", [](std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, py::tuple qs, py::tuple ks,
                                 py::tuple vs, int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t d,
                                 std::uintptr_t cos, std::uintptr_t sin, int cs_dtype, int64_t cos_stride,
                                 int64_t sin_stride, int64_t pos, std::uintptr_t pos_dev, int64_t max_pos,
                                 std::uintptr_t k_cache, std::uintptr_t v_cache, py::tuple kcs, py::tuple vcs,
                                 std::uintptr_t q_out, int device, std::uintptr_t stream) {
        kc::RopeArgs a{ptr<const void>(q), ptr<const void>(k), ptr<const void>(v),
                       at(qs, 0), at(qs, 1), at(qs, 2), at(ks, 0), at(ks, 1), at(ks, 2), at(vs, 0), at(vs, 1), at(vs, 2),
                       b, t, hq, hkv, d, ptr<const void>(cos), ptr<const void>(sin), cs_dtype, cos_stride, sin_stride,
                       pos, ptr<const int64_t>(pos_dev), max_pos, ptr<void>(k_cache), ptr<void>(v_cache),
                       at(kcs, 0), at(kcs, 1), at(kcs, 2), at(vcs, 0), at(vcs, 1), at(vcs, 2),
                       ptr<void>(q_out), device, stream};
        py::gil_scoped_release release;
        kc::rope_cache_write(a);
    });

    m.def("decode_attention", [](std::uintptr_t q, int64_t q_sb, int64_t q_sh, int64_t b, int64_t hq, int64_t hkv,
                                 int64_t d, std::uintptr_t k_cache, std::uintptr_t v_cache, py::tuple kcs,
                                 py::tuple vcs, int64_t seq_len, std::uintptr_t pos_dev, float scale,
                                 std::uintptr_t out, py::tuple ws, int device, std::uintptr_t stream) {
        kc::AttnArgs a{ptr<const void>(q), q_sb, q_sh, b, hq, hkv, d, ptr<const void>(k_cache),
                       ptr<const void>(v_cache), at(kcs, 0), at(kcs, 1), at(kcs, 2), at(vcs, 0), at(vcs, 1),
                       at(vcs, 2), seq_len, ptr<const int64_t>(pos_dev), scale, ptr<void>(out), workspace(ws),
                       device, stream};
        py::gil_scoped_release release;
        kc::decode_attention(a);
    });

    m.def("kvq_decode_attention", [](std::uintptr_t q, int q_f16, int out_f16, int64_t q_sb, int64_t q_sh,
                                     int64_t b, int64_t hq,
                                     int64_t hkv, int64_t d, std::uintptr_t kd, std::uintptr_t ks, std::uintptr_t vd,
                                     std::uintptr_t vs, py::tuple kds, py::tuple kss, py::tuple vds, py::tuple vss,
                                     int k_bits, int v_bits, int64_t seq_len, std::uintptr_t pos_dev, float scale,
                                     int64_t window, float softcap, std::uintptr_t out, py::tuple ws, int device,
                                     std::uintptr_t stream) {
        kc::KvqAttnArgs a{ptr<const void>(q), q_f16, out_f16, q_sb, q_sh, b, hq, hkv, d, ptr<const void>(kd), ptr<const void>(ks),
                          ptr<const void>(vd), ptr<const void>(vs), at(kds, 0), at(kds, 1), at(kds, 2), at(kss, 0),
                          at(kss, 1), at(kss, 2), at(vds, 0), at(vds, 1), at(vds, 2), at(vss, 0), at(vss, 1),
                          at(vss, 2), k_bits, v_bits, seq_len, ptr<const int64_t>(pos_dev), scale, window, softcap,
                          ptr<void>(out), workspace(ws), device, stream};
        py::gil_scoped_release release;
        kc::kvq_decode_attention(a);
    });

    m.def("kvq_rope_write", [](std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, py::tuple qs, py::tuple ks,
                               py::tuple vs, int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t d,
                               std::uintptr_t cos, std::uintptr_t sin, int cs_dtype, int64_t cos_stride,
                               int64_t sin_stride, int64_t pos, std::uintptr_t pos_dev, int64_t max_pos,
                               std::uintptr_t kd, std::uintptr_t kscale, std::uintptr_t vd, std::uintptr_t vscale,
                               py::tuple kds, py::tuple kss, py::tuple vds, py::tuple vss, int k_bits, int v_bits,
                               std::uintptr_t q_out, int device, std::uintptr_t stream) {
        kc::KvqWriteArgs a{ptr<const void>(q), ptr<const void>(k), ptr<const void>(v),
                           at(qs, 0), at(qs, 1), at(qs, 2), at(ks, 0), at(ks, 1), at(ks, 2), at(vs, 0), at(vs, 1),
                           at(vs, 2), b, t, hq, hkv, d, ptr<const void>(cos), ptr<const void>(sin), cs_dtype,
                           cos_stride, sin_stride, pos, ptr<const int64_t>(pos_dev), max_pos, ptr<void>(kd),
                           ptr<void>(kscale), ptr<void>(vd), ptr<void>(vscale), at(kds, 0), at(kds, 1), at(kds, 2),
                           at(kss, 0), at(kss, 1), at(kss, 2), at(vds, 0), at(vds, 1), at(vds, 2), at(vss, 0),
                           at(vss, 1), at(vss, 2), k_bits, v_bits, ptr<void>(q_out), device, stream};
        py::gil_scoped_release release;
        kc::kvq_rope_write(a);
    });

    m.def(
        "silu_mul",
        [](std::uintptr_t gate, std::uintptr_t up, int64_t n, std::uintptr_t out, int device, std::uintptr_t stream) {
            kc::silu_mul(ptr<const void>(gate), ptr<const void>(up), n, ptr<void>(out), device, stream);
        },
        py::call_guard<py::gil_scoped_release>());

    m.def("ggml_gemv", [](int type, std::uintptr_t w, int64_t row_bytes, int64_t n, int64_t k, std::uintptr_t x,
                          int64_t x_stride, int64_t rows, std::uintptr_t bias, std::uintptr_t out, int device,
                          std::uintptr_t stream) {
        kc::GgmlGemvArgs a{type, ptr<const void>(w), row_bytes, n, k, ptr<const void>(x), x_stride, rows,
                           ptr<const void>(bias), ptr<void>(out), device, stream};
        py::gil_scoped_release release;
        kc::ggml_gemv(a);
    });

    // ggml_gemv_q8 takes 1..8 rows and reads Q4_0 / Q8_0 / Q6_K rows re-laid out at load (type id | 0x100,
    // ops/ggml.py repack)
    m.def("ggml_gemv_q8", [](int type, std::uintptr_t w, int64_t row_bytes, int64_t n, int64_t k, std::uintptr_t x,
                             int64_t x_stride, int64_t rows, std::uintptr_t bias, std::uintptr_t out,
                             std::uintptr_t scratch, bool pdl, int device, std::uintptr_t stream) {
        kc::GgmlGemvArgs a{type, ptr<const void>(w), row_bytes, n, k, ptr<const void>(x), x_stride, rows,
                           ptr<const void>(bias), ptr<void>(out), device, stream};
        py::gil_scoped_release release;
        kc::ggml_gemv_q8(a, ptr<void>(scratch), pdl);
    });

    m.def(
        "ggml_dequantize",
        [](int type, std::uintptr_t w, int64_t row_bytes, int64_t n, int64_t k, std::uintptr_t out, int device,
           std::uintptr_t stream) {
            kc::ggml_dequantize(type, ptr<const void>(w), row_bytes, n, k, ptr<void>(out), device, stream);
        },
        py::call_guard<py::gil_scoped_release>());
}
