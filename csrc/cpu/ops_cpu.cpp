// CPU kernels (OpenMP over rows/columns, loops written for the auto-vectoriser). The hot GPTQ loop is
// cloned per ISA level (target_clones) so one portable binary uses AVX2/AVX-512 where the CPU has them.
#include "ops_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kb_common.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && __GNUC__ >= 12
#define KB_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "avx", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
// gcc 11 has no dispatcher for the arch=x86-64-vN levels: clone on the ISA extensions instead.
#define KB_CLONES __attribute__((target_clones("avx512f", "avx2", "avx", "default")))
#else
#define KB_CLONES
#endif

namespace kb {
namespace cpu {
namespace {

// Element traits: storage type, widening load and rounding store.
struct F32T {
    using S = float;
    static float load(S v) { return v; }
    static S store(float f) { return f; }
};
struct F16T {
    using S = uint16_t;
    static float load(S v) { return half_to_f32(v); }
    static S store(float f) { return f32_to_half(f); }
};
struct BF16T {
    using S = uint16_t;
    static float load(S v) { return bf16_to_f32(v); }
    static S store(float f) { return f32_to_bf16(f); }
};

template <typename T>
inline float round_to(float f) {
    return T::load(T::store(f));
}

#define KB_DISPATCH(code, T, ...)                                                   \
    switch (code) {                                                                 \
        case F32: { using T = F32T; __VA_ARGS__; } break;                           \
        case F16: { using T = F16T; __VA_ARGS__; } break;                           \
        case BF16: { using T = BF16T; __VA_ARGS__; } break;                         \
        default: throw std::invalid_argument("unsupported dtype code " + std::to_string(code)); \
    }

// dst[i] = float(src[offset + i]) for i < count.
void load_row(const void* src, int dtype, int64_t offset, int64_t count, float* dst) {
    KB_DISPATCH(dtype, T, {
        const typename T::S* p = static_cast<const typename T::S*>(src) + offset;
        for (int64_t i = 0; i < count; ++i) dst[i] = T::load(p[i]);
    });
}

void store_row(const float* src, int64_t count, void* dst, int dtype, int64_t offset) {
    KB_DISPATCH(dtype, T, {
        typename T::S* p = static_cast<typename T::S*>(dst) + offset;
        for (int64_t i = 0; i < count; ++i) p[i] = T::store(src[i]);
    });
}

inline int clamp_threads(int threads) { return threads < 1 ? 1 : threads; }

// ---------------------------------------------------------------- GPTQ GEMV

constexpr int kColumns = 128;  // output columns per task

// acc[m][n] += sum over packed rows r in [r0, r1) and j < 8 of xs[m][8r+j] * q[8r+j][n0+n].
template <int M>
KB_CLONES void accumulate_rows(const uint32_t* qw, int64_t n_total, int64_t r0, int64_t r1, const float* xs,
                               int64_t kp, float* acc, int nb) {
    for (int64_t r = r0; r < r1; ++r) {
        const uint32_t* w = qw + r * n_total;
        float xv[M][8];
        for (int m = 0; m < M; ++m)
            for (int j = 0; j < 8; ++j) xv[m][j] = xs[m * kp + 8 * r + j];
        for (int n = 0; n < nb; ++n) {
            const uint32_t v = w[n];
            float q[8];
            for (int j = 0; j < 8; ++j) q[j] = static_cast<float>(static_cast<int32_t>((v >> (4 * j)) & 15u));
            for (int m = 0; m < M; ++m) {
                float s = acc[m * kColumns + n];
                for (int j = 0; j < 8; ++j) s += xv[m][j] * q[j];
                acc[m * kColumns + n] = s;
            }
        }
    }
}

// One block of output columns [n0, n0 + nb) for all M rows.
// Per group: y += scale * (sum_k x*q - zero * sum_k x), which needs one multiply by the scale per group.
template <int M>
void gemv_columns(const GemvArgs& a, const float* xs, const float* xsum, int64_t kp, int64_t n0, int nb) {
    alignas(64) float acc[M * kColumns];
    alignas(64) float res[M * kColumns];
    float s[kColumns], z[kColumns];
    std::fill(res, res + M * kColumns, 0.0f);
    const int64_t rows = kp / 8, rows_per_group = a.group_size / 8;
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(a.qweight) + n0;
    for (int64_t g = 0; g < a.groups; ++g) {
        const int64_t r0 = g * rows_per_group, r1 = std::min(r0 + rows_per_group, rows);
        if (r0 >= r1) break;
        std::fill(acc, acc + M * kColumns, 0.0f);
        accumulate_rows<M>(qw, a.n, r0, r1, xs, kp, acc, nb);
        load_row(a.scales, a.sz_dtype, g * a.n + n0, nb, s);
        load_row(a.zeros, a.sz_dtype, g * a.n + n0, nb, z);
        for (int m = 0; m < M; ++m) {
            const float xg = xsum[m * a.groups + g];
            for (int n = 0; n < nb; ++n) res[m * kColumns + n] += s[n] * (acc[m * kColumns + n] - z[n] * xg);
        }
    }
    if (a.bias) {
        float b[kColumns];
        load_row(a.bias, a.bias_dtype, n0, nb, b);
        for (int m = 0; m < M; ++m)
            for (int n = 0; n < nb; ++n) res[m * kColumns + n] += b[n];
    }
    for (int m = 0; m < M; ++m) store_row(res + m * kColumns, nb, a.out, a.out_dtype, m * a.n + n0);
}

template <int M>
void gemv_all(const GemvArgs& a, const float* xs, const float* xsum, int64_t kp) {
    const int64_t blocks = (a.n + kColumns - 1) / kColumns;
#pragma omp parallel for schedule(static) num_threads(clamp_threads(a.threads))
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t n0 = blk * kColumns;
        gemv_columns<M>(a, xs, xsum, kp, n0, static_cast<int>(std::min<int64_t>(kColumns, a.n - n0)));
    }
}

template <typename T>
void dequantize_t(const int32_t* qweight, int64_t k, int64_t n, const void* scales, const void* zeros,
                  int64_t group_size, void* out, int threads) {
    using S = typename T::S;
    const int64_t rows = (k + 7) / 8;
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(qweight);
    const S* sc = static_cast<const S*>(scales);
    const S* ze = static_cast<const S*>(zeros);
    S* o = static_cast<S*>(out);
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
    for (int64_t r = 0; r < rows; ++r) {
        const uint32_t* w = qw + r * n;
        for (int j = 0; j < 8 && 8 * r + j < k; ++j) {
            const int64_t kk = 8 * r + j;
            const S* s = sc + (kk / group_size) * n;
            const S* z = ze + (kk / group_size) * n;
            S* dst = o + kk * n;
            // (q - zero) is rounded to the dtype before the scale, as reference.py computes it.
            for (int64_t c = 0; c < n; ++c) {
                const float q = static_cast<float>(static_cast<int32_t>((w[c] >> (4 * j)) & 15u));
                dst[c] = T::store(round_to<T>(q - T::load(z[c])) * T::load(s[c]));
            }
        }
    }
}

// ---------------------------------------------------------------- norms, RoPE, attention, SiLU

template <typename T, typename W>
void rms_norm_t(const void* xv, int64_t x_stride, const void* rv, int64_t r_stride, int64_t rows, int64_t d,
                const void* wv, float eps, void* yv, void* rov, int threads) {
    using S = typename T::S;
    const S* x = static_cast<const S*>(xv);
    const S* r = static_cast<const S*>(rv);
    const typename W::S* w = static_cast<const typename W::S*>(wv);
    S* y = static_cast<S*>(yv);
    S* ro = static_cast<S*>(rov);
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads)) if (rows * d >= (1 << 16))
    for (int64_t i = 0; i < rows; ++i) {
        const S* xi = x + i * x_stride;
        S* yi = y + i * d;
        const S* src = xi;
        if (r) {
            const S* ri = r + i * r_stride;
            S* roi = ro + i * d;
            for (int64_t c = 0; c < d; ++c) roi[c] = T::store(T::load(xi[c]) + T::load(ri[c]));
            src = roi;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < d; ++c) {
            const float v = T::load(src[c]);
            ss += v * v;
        }
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
        for (int64_t c = 0; c < d; ++c) yi[c] = T::store((T::load(src[c]) * inv) * W::load(w[c]));
    }
}

template <typename T, typename C>
void rope_t(const RopeArgs& a) {
    using S = typename T::S;
    using CS = typename C::S;
    const int64_t half = a.d / 2;
    const int64_t heads = a.hq + a.hkv;
    const int64_t items = a.b * a.t * heads;
    const S* q = static_cast<const S*>(a.q);
    const S* k = static_cast<const S*>(a.k);
    const S* v = static_cast<const S*>(a.v);
    S* kc = static_cast<S*>(a.k_cache);
    S* vc = static_cast<S*>(a.v_cache);
    S* qo = static_cast<S*>(a.q_out);
#pragma omp parallel for schedule(static) num_threads(clamp_threads(a.threads)) if (items * a.d >= (1 << 16))
    for (int64_t it = 0; it < items; ++it) {
        const int64_t h = it % heads, bt = it / heads, t = bt % a.t, b = bt / a.t;
        const int64_t p = a.pos + t;
        const CS* c = static_cast<const CS*>(a.cos) + p * a.cos_stride;
        const CS* s = static_cast<const CS*>(a.sin) + p * a.sin_stride;
        const S* src;
        S* dst;
        if (h < a.hq) {
            src = q + b * a.q_sb + t * a.q_st + h * a.q_sh;
            dst = qo + ((b * a.t + t) * a.hq + h) * a.d;
        } else {
            const int64_t hk = h - a.hq;
            src = k + b * a.k_sb + t * a.k_st + hk * a.k_sh;
            dst = kc + b * a.kc_sb + hk * a.kc_sh + p * a.kc_ss;
            const S* vs = v + b * a.v_sb + t * a.v_st + hk * a.v_sh;
            S* vd = vc + b * a.vc_sb + hk * a.vc_sh + p * a.vc_ss;
            for (int64_t i = 0; i < a.d; ++i) vd[i] = vs[i];
        }
        for (int64_t i = 0; i < half; ++i) {
            const float x0 = T::load(src[i]), x1 = T::load(src[i + half]);
            const float a0 = x0 * C::load(c[i]), b0 = -x1 * C::load(s[i]);
            const float a1 = x1 * C::load(c[i + half]), b1 = x0 * C::load(s[i + half]);
            dst[i] = T::store(a0 + b0);
            dst[i + half] = T::store(a1 + b1);
        }
    }
}

template <typename T>
void attention_t(const AttnArgs& a) {
    using S = typename T::S;
    const int64_t group = a.hq / a.hkv;
    const int64_t items = a.b * a.hq;
    const S* q = static_cast<const S*>(a.q);
    const S* kc = static_cast<const S*>(a.k_cache);
    const S* vc = static_cast<const S*>(a.v_cache);
    S* out = static_cast<S*>(a.out);
#pragma omp parallel num_threads(clamp_threads(a.threads)) if (items * a.seq_len * a.d >= (1 << 15))
    {
        std::vector<float> scores(static_cast<size_t>(a.seq_len));
        std::vector<float> qf(static_cast<size_t>(a.d)), acc(static_cast<size_t>(a.d));
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t b = it / a.hq, h = it % a.hq, hk = h / group;
            const S* qi = q + b * a.q_sb + h * a.q_sh;
            for (int64_t i = 0; i < a.d; ++i) qf[i] = T::load(qi[i]);
            const S* kb = kc + b * a.kc_sb + hk * a.kc_sh;
            const S* vb = vc + b * a.vc_sb + hk * a.vc_sh;
            float mx = -INFINITY;
            for (int64_t p = 0; p < a.seq_len; ++p) {
                const S* kr = kb + p * a.kc_ss;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < a.d; ++i) dot += qf[i] * T::load(kr[i]);
                const float sc = dot * a.scale;
                scores[p] = sc;
                mx = std::max(mx, sc);
            }
            float sum = 0.0f;
            for (int64_t p = 0; p < a.seq_len; ++p) {
                scores[p] = std::exp(scores[p] - mx);
                sum += scores[p];
            }
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t p = 0; p < a.seq_len; ++p) {
                const float pr = scores[p] / sum;
                const S* vr = vb + p * a.vc_ss;
                for (int64_t i = 0; i < a.d; ++i) acc[i] += pr * T::load(vr[i]);
            }
            S* o = out + it * a.d;
            for (int64_t i = 0; i < a.d; ++i) o[i] = T::store(acc[i]);
        }
    }
}

template <typename T>
void silu_mul_t(const void* gv, const void* uv, int64_t n, void* ov, int threads) {
    using S = typename T::S;
    const S* g = static_cast<const S*>(gv);
    const S* u = static_cast<const S*>(uv);
    S* o = static_cast<S*>(ov);
#pragma omp parallel for simd schedule(static) num_threads(clamp_threads(threads)) if (n >= (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
        const float x = T::load(g[i]);
        const float s = round_to<T>(x / (1.0f + std::exp(-x)));
        o[i] = T::store(s * T::load(u[i]));
    }
}

}  // namespace

void gptq_gemv(const GemvArgs& a) {
    require(a.m >= 1 && a.m <= 8, "gptq_gemv takes 1 to 8 rows");
    require(a.k >= 1 && a.n >= 1, "gptq_gemv needs positive K and N");
    require(a.group_size >= 8 && a.group_size % 8 == 0, "gptq_gemv needs a group size that is a multiple of 8");
    require(a.groups == (a.k + a.group_size - 1) / a.group_size, "gptq_gemv: groups != ceil(K / group_size)");
    const int64_t kp = (a.k + 7) / 8 * 8;
    // Gather (act-order) and widen x once; the padding rows past K are zero so they add nothing.
    std::vector<float> xs(static_cast<size_t>(a.m * kp), 0.0f);
    std::vector<float> row(static_cast<size_t>(a.k));
    for (int64_t m = 0; m < a.m; ++m) {
        load_row(a.x, a.x_dtype, m * a.x_stride, a.k, row.data());
        float* dst = xs.data() + m * kp;
        if (a.perm) {
            for (int64_t i = 0; i < a.k; ++i) {
                const int64_t src = a.perm[i];
                require(src >= 0 && src < a.k, "gptq_gemv: perm holds an index outside 0..K-1");
                dst[i] = row[src];
            }
        } else {
            std::copy(row.begin(), row.end(), dst);
        }
    }
    std::vector<float> xsum(static_cast<size_t>(a.m * a.groups), 0.0f);
    for (int64_t m = 0; m < a.m; ++m)
        for (int64_t i = 0; i < a.k; ++i) xsum[m * a.groups + i / a.group_size] += xs[m * kp + i];
    switch (a.m) {
        case 1: gemv_all<1>(a, xs.data(), xsum.data(), kp); break;
        case 2: gemv_all<2>(a, xs.data(), xsum.data(), kp); break;
        case 3: gemv_all<3>(a, xs.data(), xsum.data(), kp); break;
        case 4: gemv_all<4>(a, xs.data(), xsum.data(), kp); break;
        case 5: gemv_all<5>(a, xs.data(), xsum.data(), kp); break;
        case 6: gemv_all<6>(a, xs.data(), xsum.data(), kp); break;
        case 7: gemv_all<7>(a, xs.data(), xsum.data(), kp); break;
        default: gemv_all<8>(a, xs.data(), xsum.data(), kp); break;
    }
}

void gptq_dequantize(const int32_t* qweight, int64_t k, int64_t n, const void* scales, const void* zeros,
                     int sz_dtype, int64_t group_size, int64_t groups, void* out, int threads) {
    require(k >= 1 && n >= 1 && group_size >= 1, "gptq_dequantize needs positive K, N and group size");
    require(groups == (k + group_size - 1) / group_size, "gptq_dequantize: groups != ceil(K / group_size)");
    KB_DISPATCH(sz_dtype, T, dequantize_t<T>(qweight, k, n, scales, zeros, group_size, out, threads));
}

void rms_norm(const void* x, int64_t x_stride, const void* residual, int64_t r_stride, int dtype, int64_t rows,
              int64_t d, const void* weight, int w_dtype, float eps, void* y, void* residual_out, int threads) {
    require(d >= 1, "rms_norm needs a positive row length");
    require(!residual || residual_out, "rms_norm: a residual needs a residual_out buffer");
    KB_DISPATCH(dtype, T, {
        KB_DISPATCH(w_dtype, W,
                    rms_norm_t<T, W>(x, x_stride, residual, r_stride, rows, d, weight, eps, y, residual_out,
                                     threads));
    });
}

void rope_cache_write(const RopeArgs& a) {
    require(a.d % 2 == 0, "rope_cache_write needs an even head dimension");
    KB_DISPATCH(a.dtype, T, { KB_DISPATCH(a.cs_dtype, C, rope_t<T, C>(a)); });
}

void decode_attention(const AttnArgs& a) {
    require(a.hkv >= 1 && a.hq % a.hkv == 0, "decode_attention: query heads must be a multiple of KV heads");
    require(a.seq_len >= 1, "decode_attention needs seq_len >= 1");
    KB_DISPATCH(a.dtype, T, attention_t<T>(a));
}

void silu_mul(const void* gate, const void* up, int dtype, int64_t n, void* out, int threads) {
    KB_DISPATCH(dtype, T, silu_mul_t<T>(gate, up, n, out, threads));
}

}  // namespace cpu
}  // namespace kb
