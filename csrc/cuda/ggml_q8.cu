// The integer GGML GEMV for 1..8 fp16 rows (speculative verification takes 5..8): the activations are quantized once per call to int8 in groups of 16
// (scale d = amax / 127, q = rint(x * (1 / d)) in fp32, and d * sum(q) kept beside d), then one templated body
// dots the weight quants, as the file stores them, with those int8 values through __dp4a and scales the integer
// sums in fp32.
//
// Every block type is read in steps of 32 weights: a step is two halves of 16 weights, each half four int32 words
// of byte-sized quants q (unsigned nibbles, 5/6-bit values or int8) and an affine map w = a * q + b (a and b in
// fp32 as ggml forms them: d * sc and -dmin * m for the K types, d and -8 d for Q4_0, ...). With an activation
// group (d_x, s_x = d_x * sum q_x) a half contributes a * d_x * dp4a(q, q_x) + b * s_x. `Loader<T>::load` is the
// only per-type code. Q4_K and Q5_K blocks (16-byte aligned) are read with 16-byte loads; the others with 2-byte
// loads, unless the weight was re-laid out at load (ops/ggml.py `repack`, type ids with kRepacked set): Q4_0, Q8_0
// and Q6_K rows then hold every block's quant bytes first (16, 32 and 208 bytes a block, so each block starts
// 16-byte aligned), then the blocks' fp16 d in order, then zeros up to a multiple of 16 bytes; `Repacked<T>` reads
// those with 16-byte loads. With `pdl` (sm_90+) the GEMV is launched with programmatic dependent launch behind the quantization
// kernel: each lane first asks L2 for the start of its row (the weights are never written by a kernel), then waits
// for the quantization's writes (`griddepcontrol.wait`), so the two launches overlap instead of running back to
// back.
#include "ggml_blocks.h"
#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kGroup = 16;  // activations per int8 group

// One step of 32 weights: half h covers block elements e[h] .. e[h] + 15.
struct Step {
    int q[8];  // q[0..3] half 0, q[4..7] half 1; byte i of q[4h + w] is element e[h] + 4w + i
    int e[2];
    float a[2], b[2];
};

// The loads and decoders are host-callable too (plain loads there), so a host build can check them.
KB_HD uint4 ld128(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
    return __ldg(reinterpret_cast<const uint4*>(p));
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}

// Four bytes from a 2-byte aligned address.
KB_HD int ld32_a2(const uint8_t* p) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
#if defined(__CUDA_ARCH__)
    return static_cast<int>(static_cast<uint32_t>(__ldg(h)) | static_cast<uint32_t>(__ldg(h + 1)) << 16);
#else
    return static_cast<int>(static_cast<uint32_t>(h[0]) | static_cast<uint32_t>(h[1]) << 16);
#endif
}

KB_HD uint2 ld64(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
    return __ldg(reinterpret_cast<const uint2*>(p));
#else
    return *reinterpret_cast<const uint2*>(p);
#endif
}

KB_HD float f16_lo(uint32_t v) { return ggml::f16(static_cast<uint16_t>(v & 0xFFFFu)); }
KB_HD float f16_hi(uint32_t v) { return ggml::f16(static_cast<uint16_t>(v >> 16)); }

// Bits 0..3 of v -> bit 4 of bytes 0..3 (v * 0x00204081 places bit k at 8k with no overlapping copies).
KB_HD int spread4(uint32_t v) { return static_cast<int>(((v * 0x00204081u) & 0x01010101u) << 4); }

// Nibble words: low nibbles to half 0, high nibbles to half 1.
KB_HD void nibbles(Step& s, const int (&w)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s.q[i] = w[i] & 0x0F0F0F0F;
        s.q[4 + i] = (w[i] >> 4) & 0x0F0F0F0F;
    }
}

// Q4_K / Q5_K: the 6-bit scales and mins of sub-blocks 2c and 2c + 1 (bytes 0 / 1 of sc and mn) from the scale
// words y (bytes 0-3), z (4-7), w (8-11): sub-blocks 0-3 keep theirs in the low 6 bits of y's / z's bytes, 4-7 take
// w's low / high nibbles and the top 2 bits of y's / z's bytes.
KB_HD void k4_scale_pair(uint32_t y, uint32_t z, uint32_t w, int c, uint32_t& sc, uint32_t& mn) {
    const int sh = 16 * (c & 1);
    y >>= sh, z >>= sh, w >>= sh;
    const bool low = c < 2;
    sc = low ? (y & 0x3F3Fu) : ((w & 0x0F0Fu) | ((y >> 2) & 0x3030u));
    mn = low ? (z & 0x3F3Fu) : (((w >> 4) & 0x0F0Fu) | ((z >> 2) & 0x3030u));
}

template <int T>
struct Loader;

template <>
struct Loader<ggml::Q8_0> {
    static constexpr int steps = 1;
    static KB_HD void load(const uint8_t* b, int, Step& s) {
        const float d = ggml::f16(ggml::ld16(b));
#pragma unroll
        for (int i = 0; i < 8; ++i) s.q[i] = ld32_a2(b + 2 + 4 * i);
        s.e[0] = 0, s.e[1] = 16;
        s.a[0] = s.a[1] = d;
        s.b[0] = s.b[1] = 0.f;
    }
};

template <>
struct Loader<ggml::Q4_0> {
    static constexpr int steps = 1;
    static KB_HD void load(const uint8_t* b, int, Step& s) {
        const float d = ggml::f16(ggml::ld16(b));
        int w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = ld32_a2(b + 2 + 4 * i);
        nibbles(s, w);
        s.e[0] = 0, s.e[1] = 16;
        s.a[0] = s.a[1] = d;
        s.b[0] = s.b[1] = -8.f * d;
    }
};

template <>
struct Loader<ggml::Q4_1> {
    static constexpr int steps = 1;
    static KB_HD void load(const uint8_t* b, int, Step& s) {
        const uint32_t dm = static_cast<uint32_t>(ld32_a2(b));
        int w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = ld32_a2(b + 4 + 4 * i);
        nibbles(s, w);
        s.e[0] = 0, s.e[1] = 16;
        s.a[0] = s.a[1] = f16_lo(dm);
        s.b[0] = s.b[1] = f16_hi(dm);
    }
};

template <>
struct Loader<ggml::Q5_0> {
    static constexpr int steps = 1;
    static KB_HD void load(const uint8_t* b, int, Step& s) {
        const float d = ggml::f16(ggml::ld16(b));
        const uint32_t qh = static_cast<uint32_t>(ld32_a2(b + 2));
        int w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = ld32_a2(b + 6 + 4 * i);
        nibbles(s, w);
#pragma unroll
        for (int i = 0; i < 8; ++i) s.q[i] |= spread4((qh >> (4 * i)) & 0xF);
        s.e[0] = 0, s.e[1] = 16;
        s.a[0] = s.a[1] = d;
        s.b[0] = s.b[1] = -16.f * d;
    }
};

template <>
struct Loader<ggml::Q5_1> {
    static constexpr int steps = 1;
    static KB_HD void load(const uint8_t* b, int, Step& s) {
        const uint32_t dm = static_cast<uint32_t>(ld32_a2(b)), qh = static_cast<uint32_t>(ld32_a2(b + 4));
        int w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = ld32_a2(b + 8 + 4 * i);
        nibbles(s, w);
#pragma unroll
        for (int i = 0; i < 8; ++i) s.q[i] |= spread4((qh >> (4 * i)) & 0xF);
        s.e[0] = 0, s.e[1] = 16;
        s.a[0] = s.a[1] = f16_lo(dm);
        s.b[0] = s.b[1] = f16_hi(dm);
    }
};

// Q4_K step j (0..7): 16 quant bytes at 16 + 16 j, i.e. 32-byte chunk c = j / 2, part h = j % 2: low nibbles are
// sub-block 2c's elements 16h.., high nibbles sub-block 2c + 1's.
template <>
struct Loader<ggml::Q4_K> {
    static constexpr int steps = 8;
    static KB_HD void k_common(const uint4& hd, int j, Step& s) {
        const int c = j >> 1, h = j & 1;
        const float d = f16_lo(hd.x), dmin = f16_hi(hd.x);
        uint32_t sc, mn;
        k4_scale_pair(hd.y, hd.z, hd.w, c, sc, mn);
        const float sc0 = static_cast<float>(sc & 0xFF), sc1 = static_cast<float>(sc >> 8);
        const float mn0 = static_cast<float>(mn & 0xFF), mn1 = static_cast<float>(mn >> 8);
        s.e[0] = 64 * c + 16 * h, s.e[1] = 64 * c + 32 + 16 * h;
        s.a[0] = d * sc0, s.a[1] = d * sc1;
        s.b[0] = -(dmin * mn0), s.b[1] = -(dmin * mn1);
    }
    static KB_HD void load(const uint8_t* b, int j, Step& s) {
        const uint4 hd = ld128(b), q = ld128(b + 16 + 16 * j);
        const int w[4] = {static_cast<int>(q.x), static_cast<int>(q.y), static_cast<int>(q.z), static_cast<int>(q.w)};
        nibbles(s, w);
        k_common(hd, j, s);
    }
};

// Q5_K: as Q4_K (quants at 48), plus bits 2c and 2c + 1 of qh bytes 16h .. 16h + 15 as the fifth bits.
template <>
struct Loader<ggml::Q5_K> {
    static constexpr int steps = 8;
    static KB_HD void load(const uint8_t* b, int j, Step& s) {
        const int c = j >> 1, h = j & 1;
        const uint4 hd = ld128(b), qh = ld128(b + 16 + 16 * h), q = ld128(b + 48 + 16 * j);
        const int w[4] = {static_cast<int>(q.x), static_cast<int>(q.y), static_cast<int>(q.z), static_cast<int>(q.w)};
        const uint32_t hw[4] = {qh.x, qh.y, qh.z, qh.w};
        nibbles(s, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            s.q[i] |= static_cast<int>(((hw[i] >> (2 * c)) & 0x01010101u) << 4);
            s.q[4 + i] |= static_cast<int>(((hw[i] >> (2 * c + 1)) & 0x01010101u) << 4);
        }
        Loader<ggml::Q4_K>::k_common(hd, j, s);
    }
};

// Q6_K step j (0..7): half t = j / 4 (128 elements), p = j % 4: ql bytes 64t + 16p .. +15 hold rows r = p / 2
// (low nibbles) and r + 2 (high) at elements l0 = 16 (p % 2) ..; their top bits are bits 2r / 2r + 4 of
// qh[32t + l0 ..]; one int8 scale per 16 elements.
template <>
struct Loader<ggml::Q6_K> {
    static constexpr int steps = 8;
    static KB_HD void load(const uint8_t* b, int j, Step& s) {
        const int t = j >> 2, p = j & 3, r = p >> 1, l0 = 16 * (p & 1);
        int w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = ld32_a2(b + 64 * t + 16 * p + 4 * i);
        nibbles(s, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t hw = static_cast<uint32_t>(ld32_a2(b + 128 + 32 * t + l0 + 4 * i));
            s.q[i] |= static_cast<int>(((hw >> (2 * r)) & 0x03030303u) << 4);
            s.q[4 + i] |= static_cast<int>(((hw >> (2 * r + 4)) & 0x03030303u) << 4);
        }
        const float d = ggml::f16(ggml::ld16(b + 208));
        s.e[0] = 128 * t + 32 * r + l0, s.e[1] = s.e[0] + 64;
        // scale groups g0 = e[0] / 16 and g0 + 4 share a parity: two 2-byte loads at even offsets
        const int g0 = s.e[0] / 16, sh = 8 * (g0 & 1);
        const uint32_t sc = ggml::ld16(b + 192 + (g0 & ~1)), sc1 = ggml::ld16(b + 196 + (g0 & ~1));
        s.a[0] = d * static_cast<float>(static_cast<int8_t>((sc >> sh) & 0xFF));
        s.a[1] = d * static_cast<float>(static_cast<int8_t>((sc1 >> sh) & 0xFF));
        s.b[0] = -32.f * s.a[0], s.b[1] = -32.f * s.a[1];
    }
};

// The kernel reads a row through a layout: `Stored<T>` (blocks as the file has them, `Loader<T>`) or
// `Repacked<T>`; load(row, blk, j, nb, s) decodes step j of block blk of a row of nb blocks.
template <int T>
struct Stored {
    static constexpr int elements = ggml::Block<T>::elements;
    static constexpr int steps = Loader<T>::steps;
    static KB_HD void load(const uint8_t* row, int blk, int j, int, Step& s) {
        Loader<T>::load(row + blk * ggml::Block<T>::bytes, j, s);
    }
};

// Type ids of re-laid-out weights: the block type's id with this bit set (ops/ggml.py REPACK_BIT).
constexpr int kRepacked = 0x100;

// Quant bytes per block in the re-laid-out row (the block without its fp16 d).
KB_HD constexpr int repacked_body(int t) { return t == ggml::Q6_K ? 208 : t == ggml::Q8_0 ? 32 : 16; }

template <int T>
struct Repacked;

template <>
struct Repacked<ggml::Q8_0> {
    static constexpr int elements = 32, steps = 1;
    static KB_HD void load(const uint8_t* row, int blk, int, int nb, Step& s) {
        const uint4 q0 = ld128(row + 32 * blk), q1 = ld128(row + 32 * blk + 16);
        const float d = ggml::f16(ggml::ld16(row + 32 * nb + 2 * blk));
        s.q[0] = static_cast<int>(q0.x), s.q[1] = static_cast<int>(q0.y);
        s.q[2] = static_cast<int>(q0.z), s.q[3] = static_cast<int>(q0.w);
        s.q[4] = static_cast<int>(q1.x), s.q[5] = static_cast<int>(q1.y);
        s.q[6] = static_cast<int>(q1.z), s.q[7] = static_cast<int>(q1.w);
        s.e[0] = 0, s.e[1] = 16;
        s.a[0] = s.a[1] = d;
        s.b[0] = s.b[1] = 0.f;
    }
};

template <>
struct Repacked<ggml::Q4_0> {
    static constexpr int elements = 32, steps = 1;
    static KB_HD void load(const uint8_t* row, int blk, int, int nb, Step& s) {
        const uint4 q = ld128(row + 16 * blk);
        const float d = ggml::f16(ggml::ld16(row + 16 * nb + 2 * blk));
        const int w[4] = {static_cast<int>(q.x), static_cast<int>(q.y), static_cast<int>(q.z), static_cast<int>(q.w)};
        nibbles(s, w);
        s.e[0] = 0, s.e[1] = 16;
        s.a[0] = s.a[1] = d;
        s.b[0] = s.b[1] = -8.f * d;
    }
};

// Q6_K as Loader<Q6_K> (ql, qh and the 16 int8 scales keep their block offsets 0, 128, 192): ql and qh in one
// 16-byte load each; the step's scales g0 and g0 + 4 (g0 % 8 < 4) are bytes g0 % 4 of one 8-byte load's words.
template <>
struct Repacked<ggml::Q6_K> {
    static constexpr int elements = 256, steps = 8;
    static KB_HD void load(const uint8_t* row, int blk, int j, int nb, Step& s) {
        const uint8_t* b = row + 208 * blk;
        const int t = j >> 2, p = j & 3, r = p >> 1, l0 = 16 * (p & 1);
        const uint4 ql = ld128(b + 64 * t + 16 * p), qh = ld128(b + 128 + 32 * t + l0);
        const int w[4] = {static_cast<int>(ql.x), static_cast<int>(ql.y), static_cast<int>(ql.z),
                          static_cast<int>(ql.w)};
        const uint32_t hw[4] = {qh.x, qh.y, qh.z, qh.w};
        nibbles(s, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            s.q[i] |= static_cast<int>(((hw[i] >> (2 * r)) & 0x03030303u) << 4);
            s.q[4 + i] |= static_cast<int>(((hw[i] >> (2 * r + 4)) & 0x03030303u) << 4);
        }
        const float d = ggml::f16(ggml::ld16(row + 208 * nb + 2 * blk));
        s.e[0] = 128 * t + 32 * r + l0, s.e[1] = s.e[0] + 64;
        const uint2 sc = ld64(b + 192 + 8 * t);
        const int sh = 8 * (2 * r + (p & 1));
        s.a[0] = d * static_cast<float>(static_cast<int8_t>((sc.x >> sh) & 0xFF));
        s.a[1] = d * static_cast<float>(static_cast<int8_t>((sc.y >> sh) & 0xFF));
        s.b[0] = -32.f * s.a[0], s.b[1] = -32.f * s.a[1];
    }
};

// x fp16 [M, K] (row stride x_stride) -> xq int8 [M, K], xds float2 [M, K / 16] = (d, d * sum q) per group.
__global__ void quantize_q8_kernel(const half* __restrict__ x, int64_t x_stride, int m, int k,
                                   int8_t* __restrict__ xq, float2* __restrict__ xds) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // a programmatic GEMV may start prefetching
#endif
    const int groups = k / kGroup;
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= m * groups) return;
    const int row = g / groups, off = (g % groups) * kGroup;
    const uint4* src = reinterpret_cast<const uint4*>(x + row * x_stride + off);
    const uint4 v0 = __ldg(src), v1 = __ldg(src + 1);
    const uint32_t u[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    float f[16];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float2 p = __half22float2(u32_as_half2(u[i]));
        f[2 * i] = p.x, f[2 * i + 1] = p.y;
        amax = fmaxf(amax, fmaxf(fabsf(p.x), fabsf(p.y)));
    }
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    uint32_t packed[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        uint32_t word = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = __float2int_rn(f[4 * w + i] * id);
            sum += q;
            word |= (static_cast<uint32_t>(q) & 0xFFu) << (8 * i);
        }
        packed[w] = word;
    }
    reinterpret_cast<uint4*>(xq + static_cast<int64_t>(row) * k + off)[0] =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
    xds[g] = make_float2(d, d * static_cast<float>(sum));
}

// One warp per output feature, all M rows; lane l takes steps l, l + 32, ... of the row (L::steps per block).
template <class L, int M>
__global__ void __launch_bounds__(kThreads) ggml_gemv_q8_kernel(const uint8_t* __restrict__ w, int64_t row_bytes,
                                                                int n, int k, const int8_t* __restrict__ xq,
                                                                const float2* __restrict__ xds,
                                                                const half* __restrict__ bias,
                                                                half* __restrict__ out) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * kWarps + warp;
    if (row >= n) return;
    const uint8_t* __restrict__ wr = w + row * row_bytes;
    const int nb = k / L::elements, steps = nb * L::steps, groups = k / kGroup;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // the row's first 5 KiB (a whole 7B Q4_K row), one 32-byte sector per lane per KiB; then x is safe to read
    // (griddepcontrol.wait returns at once when the launch was not programmatic)
    for (int64_t off = 32 * lane; off < row_bytes && off < 5120; off += 1024)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(wr + off));
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    float acc[M];
#pragma unroll
    for (int i = 0; i < M; ++i) acc[i] = 0.f;
#pragma unroll 4
    for (int st = lane; st < steps; st += 32) {
        const int blk = st / L::steps;
        Step s;
        L::load(wr, blk, st % L::steps, nb, s);
#pragma unroll
        for (int i = 0; i < M; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int e = blk * L::elements + s.e[h];
                const int4 xv = __ldg(reinterpret_cast<const int4*>(xq + static_cast<int64_t>(i) * k + e));
                const float2 ds = __ldg(xds + i * groups + e / kGroup);
                int dot = __dp4a(s.q[4 * h], xv.x, 0);
                dot = __dp4a(s.q[4 * h + 1], xv.y, dot);
                dot = __dp4a(s.q[4 * h + 2], xv.z, dot);
                dot = __dp4a(s.q[4 * h + 3], xv.w, dot);
                acc[i] = fmaf(s.a[h] * ds.x, static_cast<float>(dot), fmaf(s.b[h], ds.y, acc[i]));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < M; ++i) {
        float v = acc[i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        acc[i] = v;
    }
    if (lane == 0) {
        const float b = bias ? __half2float(bias[row]) : 0.f;
#pragma unroll
        for (int i = 0; i < M; ++i) out[static_cast<int64_t>(i) * n + row] = __float2half(acc[i] + b);
    }
}

struct GemvQ8Launch {
    const GgmlGemvArgs& a;
    const int8_t* xq;
    const float2* xds;
    bool pdl;
    template <class L, int M>
    void launch() const {
        const unsigned int blocks = static_cast<unsigned int>((a.n + kWarps - 1) / kWarps);
        const uint8_t* w = static_cast<const uint8_t*>(a.w);
        const int n = static_cast<int>(a.n), k = static_cast<int>(a.k);
        const half* bias = static_cast<const half*>(a.bias);
        half* out = static_cast<half*>(a.out);
        if (!pdl) {
            ggml_gemv_q8_kernel<L, M><<<blocks, kThreads, 0, as_stream(a.stream)>>>(w, a.row_bytes, n, k, xq, xds,
                                                                                    bias, out);
            return;
        }
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(kThreads);
        cfg.stream = as_stream(a.stream);
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        KB_CUDA_CHECK(cudaLaunchKernelEx(&cfg, ggml_gemv_q8_kernel<L, M>, w, a.row_bytes, n, k, xq, xds, bias, out));
    }
    template <class L>
    void rows() const {
        switch (a.m) {
            case 1: launch<L, 1>(); break;
            case 2: launch<L, 2>(); break;
            case 3: launch<L, 3>(); break;
            case 4: launch<L, 4>(); break;
            case 5: launch<L, 5>(); break;
            case 6: launch<L, 6>(); break;
            case 7: launch<L, 7>(); break;
            default: launch<L, 8>(); break;
        }
    }
    template <int T>
    void run() const {
        rows<Stored<T>>();
    }
};

}  // namespace

void ggml_gemv_q8(const GgmlGemvArgs& a, void* scratch, bool pdl) {
    require(a.m >= 1 && a.m <= 8, "ggml_gemv_q8: rows must be 1..8");
    const bool repacked = (a.type & kRepacked) != 0;
    const int type = a.type & ~kRepacked;
    require(!repacked || type == ggml::Q4_0 || type == ggml::Q8_0 || type == ggml::Q6_K,
            "ggml_gemv_q8: unsupported re-laid-out block type " + std::to_string(type));
    const bool k_type = type == ggml::Q4_K || type == ggml::Q5_K || type == ggml::Q6_K;
    require(a.k > 0 && a.k % (k_type ? 256 : 32) == 0 && a.n > 0 && a.n < (1LL << 31) && a.k < (1LL << 26),
            "ggml_gemv_q8: K must be a positive multiple of the block");
    if (repacked) {  // quants, fp16 d per block, zeros to a multiple of 16 bytes
        const int64_t nb = a.k / (type == ggml::Q6_K ? 256 : 32);
        require(a.row_bytes == (nb * (repacked_body(type) + 2) + 15) / 16 * 16,
                "ggml_gemv_q8: re-laid-out rows must hold quants and scales padded to 16 bytes");
    }
    const std::uintptr_t align = (repacked || type == ggml::Q4_K || type == ggml::Q5_K) ? 16 : 2;
    require(aligned(a.w, align) && a.row_bytes % static_cast<int64_t>(align) == 0,
            "ggml_gemv_q8: weight rows are not aligned for their block type");
    require(aligned(a.x, 16) && a.x_stride % 8 == 0 && a.x_stride >= a.k,
            "ggml_gemv_q8: x rows must be 16-byte aligned");
    require(aligned(scratch, 16), "ggml_gemv_q8: scratch must be 16-byte aligned");
    use_device(a.device);
    if (pdl) {  // programmatic dependent launch needs sm_90; elsewhere the plain launch
        int major = 0;
        KB_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a.device));
        pdl = major >= 9;
    }
    // scratch: xds float2 [M, K / 16] (M * K / 2 bytes, a multiple of 16), then xq int8 [M, K]
    float2* xds = static_cast<float2*>(scratch);
    int8_t* xq = static_cast<int8_t*>(scratch) + a.m * a.k / 2;
    const int64_t groups = a.m * a.k / kGroup;
    quantize_q8_kernel<<<static_cast<unsigned int>((groups + 127) / 128), 128, 0, as_stream(a.stream)>>>(
        static_cast<const half*>(a.x), a.x_stride, static_cast<int>(a.m), static_cast<int>(a.k), xq, xds);
    KB_CHECK_LAUNCH();
    const GemvQ8Launch launch{a, xq, xds, pdl};
    if (repacked) {
        switch (type) {
            case ggml::Q4_0: launch.rows<Repacked<ggml::Q4_0>>(); break;
            case ggml::Q8_0: launch.rows<Repacked<ggml::Q8_0>>(); break;
            default: launch.rows<Repacked<ggml::Q6_K>>(); break;
        }
    } else {
        require(ggml::dispatch(type, launch), "ggml_gemv_q8: unsupported block type " + std::to_string(type));
    }
    KB_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace kb
