// CPU kernels on GGML block formats as GGUF files store them (csrc/include/ggml_blocks.h): a GEMV for 1..8 rows
// of activations that decodes each weight block once for all rows, and a dequantization to fp32/fp16/bf16 for
// the prompt path (then one torch matmul). OpenMP over output features.
#include "ggml_cpu.h"

#include <algorithm>
#include <vector>

#include "ggml_blocks.h"
#include "kb_common.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kb {
namespace cpu {
namespace {

int clamp_threads(int threads) { return std::max(1, threads); }

float load(const void* p, int dtype, int64_t i) {
    switch (dtype) {
        case F32: return static_cast<const float*>(p)[i];
        case F16: return half_to_f32(static_cast<const uint16_t*>(p)[i]);
        default: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    }
}

void store(void* p, int dtype, int64_t i, float v) {
    switch (dtype) {
        case F32: static_cast<float*>(p)[i] = v; break;
        case F16: static_cast<uint16_t*>(p)[i] = f32_to_half(v); break;
        default: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    }
}

void check_dtype(int dtype, const char* what) {
    require(dtype == F32 || dtype == F16 || dtype == BF16, std::string(what) + ": unsupported dtype code");
}

template <int M>
struct Gemv {
    const GgmlGemvArgs& a;
    const float* xf;  // [M, K] fp32

    template <int T>
    void run() const {
        using B = ggml::Block<T>;
        const int64_t blocks = a.k / B::elements;
#pragma omp parallel for schedule(static) num_threads(clamp_threads(a.threads))
        for (int64_t n = 0; n < a.n; ++n) {
            const uint8_t* row = a.w + n * a.row_bytes;
            // eight independent partial sums per row of x, so the inner loop is one vector multiply-add
            float acc[M][8] = {};
            float w[8];
            for (int64_t blk = 0; blk < blocks; ++blk) {
                const uint8_t* b = row + blk * B::bytes;
                for (int j = 0; j < B::elements / 8; ++j) {
                    B::decode8(b, j, w);
                    const int64_t col = blk * B::elements + 8 * j;
                    for (int m = 0; m < M; ++m) {
                        const float* xm = xf + m * a.k + col;
                        for (int i = 0; i < 8; ++i) acc[m][i] += w[i] * xm[i];
                    }
                }
            }
            const float bias = a.bias ? load(a.bias, a.bias_dtype, n) : 0.f;
            for (int m = 0; m < M; ++m) {
                const float s = ((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3])) +
                                ((acc[m][4] + acc[m][5]) + (acc[m][6] + acc[m][7]));
                store(a.out, a.out_dtype, m * a.n + n, s + bias);
            }
        }
    }
};

template <int M>
void gemv_rows(const GgmlGemvArgs& a, const float* xf) {
    require(ggml::dispatch(a.type, Gemv<M>{a, xf}), "ggml_gemv: unsupported block type " + std::to_string(a.type));
}

struct Dequantize {
    const uint8_t* w;
    int64_t row_bytes, n, k;
    void* out;
    int out_dtype, threads;

    template <int T>
    void run() const {
        using B = ggml::Block<T>;
        const int64_t blocks = k / B::elements;
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
        for (int64_t r = 0; r < n; ++r) {
            float v[8];
            for (int64_t blk = 0; blk < blocks; ++blk) {
                const uint8_t* b = w + r * row_bytes + blk * B::bytes;
                for (int j = 0; j < B::elements / 8; ++j) {
                    B::decode8(b, j, v);
                    const int64_t base = r * k + blk * B::elements + 8 * j;
                    for (int i = 0; i < 8; ++i) store(out, out_dtype, base + i, v[i]);
                }
            }
        }
    }
};

}  // namespace

void ggml_gemv(const GgmlGemvArgs& a) {
    check_dtype(a.x_dtype, "ggml_gemv x");
    check_dtype(a.out_dtype, "ggml_gemv out");
    if (a.bias) check_dtype(a.bias_dtype, "ggml_gemv bias");
    require(a.m >= 1 && a.m <= 8, "ggml_gemv: rows must be 1..8");
    require(a.k > 0 && a.n > 0 && a.x_stride >= a.k, "ggml_gemv: bad shape");
    std::vector<float> xf(static_cast<size_t>(a.m * a.k));
    for (int64_t m = 0; m < a.m; ++m)
        for (int64_t c = 0; c < a.k; ++c) xf[m * a.k + c] = load(a.x, a.x_dtype, m * a.x_stride + c);
    switch (a.m) {
        case 1: gemv_rows<1>(a, xf.data()); break;
        case 2: gemv_rows<2>(a, xf.data()); break;
        case 3: gemv_rows<3>(a, xf.data()); break;
        case 4: gemv_rows<4>(a, xf.data()); break;
        case 5: gemv_rows<5>(a, xf.data()); break;
        case 6: gemv_rows<6>(a, xf.data()); break;
        case 7: gemv_rows<7>(a, xf.data()); break;
        default: gemv_rows<8>(a, xf.data()); break;
    }
}

void ggml_dequantize(int type, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k, void* out, int out_dtype,
                     int threads) {
    check_dtype(out_dtype, "ggml_dequantize out");
    require(k > 0 && n > 0, "ggml_dequantize: bad shape");
    require(ggml::dispatch(type, Dequantize{w, row_bytes, n, k, out, out_dtype, threads}),
            "ggml_dequantize: unsupported block type " + std::to_string(type));
}

}  // namespace cpu
}  // namespace kb
