// GPTQ 4-bit whole-K GEMV with fewer instructions per weight ("lean"), for 1..8 rows, 256 threads.
//
// Same block shape, weight reads and x staging as the 256-thread kernel of gptq_wide.cu (one block per 32-column
// tile for all of K, 8 lanes per 128-byte packed row, two batches of 8 packed rows in flight per thread); only the
// arithmetic per weight changes. gptq_wide.cu spends 5 half2 operations per pair of weights (unpack, remove the
// 1024 offset, subtract the zero, multiply by the scale, multiply-add with x) and converts every 8 products to
// fp32. Here:
// - the zero is folded into the offset subtraction: (1024 + q) - (1024 + z) = q - z, exact in fp16 because GPTQ
//   and AWQ zeros are integers (0..16), so one HADD2 (or one HFMA2 for the upper nibble of a byte, stored as
//   1024 + 16q) gives q - z;
// - the scale is applied once per 4 packed rows, in fp32: the half2 products (q - z) * x are summed for 4 packed
//   rows (16 products per fp16 lane), then converted and multiply-added with scale into the fp32 sum.
// That leaves unpack (LOP3), q - z, and the multiply-add: 3 operations per pair of weights plus a shift per word.
// Without the scale the fp16 partial sums are ~1/scale larger, so x is staged pre-divided by a power of two
// 2^e chosen per block from max |x| (e = 0 unless max |x| > 128; the scale is multiplied by 2^e instead):
// |partial sum| <= 16 products x 16 x 128 = 32768 < 65504 whatever x holds. gptq.cu's gptq_gemv selects this
// kernel only when forced (variant 4); it takes the shapes gptq_gemv_wide_fits(a, 256) accepts.
// Variant 5 is the same kernel launched with programmatic dependent launch (sm_90+): it lets the next kernel
// launch as soon as all its blocks have started, and waits for the previous kernel's writes only after its own
// first weight loads are issued (weights, scales and zeros are never written by a preceding kernel; x is), so
// one GEMV's weight reads overlap the previous kernel's tail.
#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLanesPerRow = 8;  // 8 lanes x 4 columns = 32 columns per tile
constexpr int kTileCols = kLanesPerRow * 4;
constexpr int kSlots = kThreads / kLanesPerRow;  // row slots per block
constexpr int kBatch = 8;        // packed rows per batch (64 inputs, inside one group)
constexpr int kFlush = 4;        // packed rows summed in fp16 before the fp32 flush
constexpr float kMaxStagedX = 128.0f;
constexpr int kStageUnroll = 4;  // rows of x loaded per thread before any is stored

__device__ __forceinline__ uint32_t as_u32(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// Row r of staged x sits at uint4 index r + r / 8 (bank spread for the 4 slots of a warp, as in gptq_wide.cu).
__device__ __forceinline__ int padded(int r) { return r + (r >> 3); }
__host__ __device__ inline int64_t padded_rows(int64_t rows) { return rows + rows / 8 + 1; }

struct Batch {
    uint4 w[kBatch];
    uint2 s, z;
};

// One 64-bit address per batch, 32-bit row offsets (a row is n4 < 2^26 uint4: N < 2^28 is checked). The
// group index is rb / (group_size / 64) computed as floor((rb + 0.5) * inv_bpg) in fp32: the quotient is then at
// least 0.5 / bpg from an integer, and the float error (< 2^-23 * rb / bpg, rb < 2^13 since x fits in shared
// memory) is smaller, so the result is exact; a division costs ~15 instructions per batch (nvcc keeps it in the
// loop).
__device__ __forceinline__ void load_batch(const uint4* __restrict__ qp, int n4, int rb, int rows,
                                           const half* __restrict__ scales, const half* __restrict__ zeros,
                                           int64_t n, int col, float inv_bpg, Batch& b) {
    const int r0 = rb * kBatch;
    const uint4* p = qp + static_cast<int64_t>(r0) * n4;
    if (r0 + kBatch <= rows) {
#pragma unroll
        for (int u = 0; u < kBatch; ++u) b.w[u] = __ldg(p + u * n4);
    } else {  // rows past the last packed row re-read it (no zeroing): x is staged as zero there
        const int last = rows - 1 - r0;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) b.w[u] = __ldg(p + min(u, last) * n4);
    }
    const int64_t g = __float2int_rz((static_cast<float>(rb) + 0.5f) * inv_bpg);
    b.s = __ldg(reinterpret_cast<const uint2*>(scales + g * n + col));
    b.z = __ldg(reinterpret_cast<const uint2*>(zeros + g * n + col));
}

// (a & mask) | 0x64006400 in one LOP3: nvcc emits an AND and an OR for the C++ expression.
__device__ __forceinline__ uint32_t nibbles_as_half2(uint32_t a, uint32_t mask) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(0x64006400u));
    return d;
}

// Adds (q - z) * x of one packed word (8 weights; rows (j, j + 4) paired as x is staged) to h.
// lo = -(1024 + z) for the nibbles at bits 0 and 16 (value 1024 + q), hi = -(64 + z) for those at bits 4 and 20
// (value 1024 + 16q, times 1/16 gives 64 + q).
__device__ __forceinline__ half2 dot_word(uint32_t w, half2 lo, half2 hi, uint4 xv, half2 h) {
    const half2 k16th = u32_as_half2(0x2C002C00u);
    const half2 a = u32_as_half2(nibbles_as_half2(w, 0x000F000Fu));
    const half2 b = u32_as_half2(nibbles_as_half2(w, 0x00F000F0u));
    w >>= 8;
    const half2 c = u32_as_half2(nibbles_as_half2(w, 0x000F000Fu));
    const half2 d = u32_as_half2(nibbles_as_half2(w, 0x00F000F0u));
    h = __hfma2(__hadd2(a, lo), u32_as_half2(xv.x), h);
    h = __hfma2(__hfma2(b, k16th, hi), u32_as_half2(xv.y), h);
    h = __hfma2(__hadd2(c, lo), u32_as_half2(xv.z), h);
    h = __hfma2(__hfma2(d, k16th, hi), u32_as_half2(xv.w), h);
    return h;
}

template <int M>
__device__ __forceinline__ void flush(half2 (&h)[M][4], const float (&sf)[4], float (&acc)[M][4]) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float2 f = __half22float2(h[m][c]);
            acc[m][c] = fmaf(f.x + f.y, sf[c], acc[m][c]);
            h[m][c] = __float2half2_rn(0.0f);
        }
}

template <int M>
__device__ __forceinline__ void consume(const Batch& b, const uint4* __restrict__ xs, int xrows, int rb,
                                        float pow2e, float (&acc)[M][4]) {
    const half2 s01 = u32_as_half2(b.s.x), s23 = u32_as_half2(b.s.y);
    const half2 z01 = u32_as_half2(b.z.x), z23 = u32_as_half2(b.z.y);
    const float sf[4] = {__low2float(s01) * pow2e, __high2float(s01) * pow2e, __low2float(s23) * pow2e,
                         __high2float(s23) * pow2e};
    const half2 zc[4] = {__low2half2(z01), __high2half2(z01), __low2half2(z23), __high2half2(z23)};
    half2 lo[4], hi[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        lo[c] = __hneg2(__hadd2(zc[c], u32_as_half2(0x64006400u)));  // -(1024 + z)
        hi[c] = __hneg2(__hadd2(zc[c], u32_as_half2(0x54005400u)));  // -(64 + z)
    }
    half2 h[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) h[m][c] = __float2half2_rn(0.0f);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
        const uint32_t words[4] = {b.w[u].x, b.w[u].y, b.w[u].z, b.w[u].w};
        const int xr = padded(rb * kBatch + u);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4 xv = xs[m * xrows + xr];
#pragma unroll
            for (int c = 0; c < 4; ++c) h[m][c] = dot_word(words[c], lo[c], hi[c], xv, h[m][c]);
        }
        if (u == kFlush - 1) flush<M>(h, sf, acc);
    }
    flush<M>(h, sf, acc);
}

// Grid: one block per 32-column tile; slot s of a block takes the 8-row batches s, s + 32, s + 64, ... of K.
template <int M>
__global__ void __launch_bounds__(kThreads, M <= 2 ? 2 : 1) gemv_lean_kernel(
    const half* __restrict__ x, int64_t x_stride, const int64_t* __restrict__ perm, const uint4* __restrict__ qw4,
    const half* __restrict__ scales, const half* __restrict__ zeros, const half* __restrict__ bias,
    half* __restrict__ out, int k, int n, int group_size, bool vec_x, bool pdl) {
    extern __shared__ uint4 xs[];
    __shared__ float red[kWarps][M][kTileCols];
    __shared__ float warp_max[kWarps];
    const int rows = (k + 7) / 8;
    const int row_blocks = (rows + kBatch - 1) / kBatch;
    const int staged = row_blocks * kBatch;  // x is staged (zero past K) to whole batches
    const int xrows = static_cast<int>(padded_rows(staged));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int lg = lane % kLanesPerRow;
    const int slot = warp * (32 / kLanesPerRow) + lane / kLanesPerRow;
    const int col = blockIdx.x * kTileCols + lg * 4;
    const bool active = col < n;  // n % 4 == 0: a lane's 4 columns are all in or all out
    const int n4 = n / 4;
    const uint4* qp = qw4 + (active ? col / 4 : 0);
    const float inv_bpg = 1.0f / static_cast<float>(group_size / (8 * kBatch));

    // Two batches in flight, in two buffers used in turn (a copy from one to the other costs 36 moves a batch).
    Batch b0, b1;
    int rb = slot;
    if (active && rb < row_blocks) load_batch(qp, n4, rb, rows, scales, zeros, n, col, inv_bpg, b0);
    if (active && rb + kSlots < row_blocks)
        load_batch(qp, n4, rb + kSlots, rows, scales, zeros, n, col, inv_bpg, b1);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (pdl) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        asm volatile("griddepcontrol.wait;" ::: "memory");  // x (and out) only after the previous kernel is done
    }
#endif

    // Stage x[:, perm[8r + j]] as half2 pairs (j, j + 4) per packed row r (inputs past K are zero, to the end of
    // the last batch); thread t stages the rows t, t + 256, ... and keeps max |x| over them.
    float amax = 0.0f;
    for (int m = 0; m < M; ++m) {
        for (int r0 = threadIdx.x; r0 < staged; r0 += kThreads * kStageUnroll) {
            half v[kStageUnroll][8];  // all loads of this step issued before any store
#pragma unroll
            for (int u = 0; u < kStageUnroll; ++u) {
                const int r = r0 + u * kThreads;
                if (vec_x && r < rows) {
                    const uint4 p = __ldg(reinterpret_cast<const uint4*>(x + m * x_stride) + r);
                    const uint32_t u4[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        v[u][2 * i] = __low2half(u32_as_half2(u4[i]));
                        v[u][2 * i + 1] = __high2half(u32_as_half2(u4[i]));
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const int i = 8 * r + j;
                        v[u][j] = i < k ? x[m * x_stride + (perm ? perm[i] : i)] : __float2half(0.0f);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < kStageUnroll; ++u) {
                const int r = r0 + u * kThreads;
                if (r >= staged) break;
#pragma unroll
                for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(__half2float(v[u][j])));
                xs[m * xrows + padded(r)] = make_uint4(
                    as_u32(__halves2half2(v[u][0], v[u][4])), as_u32(__halves2half2(v[u][1], v[u][5])),
                    as_u32(__halves2half2(v[u][2], v[u][6])), as_u32(__halves2half2(v[u][3], v[u][7])));
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) warp_max[warp] = amax;
    __syncthreads();
    amax = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, warp_max[w]);
    // x / 2^e <= 128; 2^-e is exact in fp16 down to e = 24 (beyond, only an x of inf or >= 2^31 would ask)
    int e = 0;
    if (amax > kMaxStagedX) {
        frexpf(amax / kMaxStagedX, &e);
        e = min(e, 24);
        const half2 down = __float2half2_rn(ldexpf(1.0f, -e));
        for (int m = 0; m < M; ++m)
            for (int r = threadIdx.x; r < staged; r += kThreads) {
                uint4& p = xs[m * xrows + padded(r)];
                p = make_uint4(as_u32(__hmul2(u32_as_half2(p.x), down)), as_u32(__hmul2(u32_as_half2(p.y), down)),
                               as_u32(__hmul2(u32_as_half2(p.z), down)), as_u32(__hmul2(u32_as_half2(p.w), down)));
            }
        __syncthreads();  // block-uniform: every thread read the same warp_max
    }
    const float pow2e = ldexpf(1.0f, e);

    float acc[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;

    if (active) {
        while (rb < row_blocks) {
            consume<M>(b0, xs, xrows, rb, pow2e, acc);
            if (rb + 2 * kSlots < row_blocks)
                load_batch(qp, n4, rb + 2 * kSlots, rows, scales, zeros, n, col, inv_bpg, b0);
            rb += kSlots;
            if (rb >= row_blocks) break;
            consume<M>(b1, xs, xrows, rb, pow2e, acc);
            if (rb + 2 * kSlots < row_blocks)
                load_batch(qp, n4, rb + 2 * kSlots, rows, scales, zeros, n, col, inv_bpg, b1);
            rb += kSlots;
        }
    }

    // Sum the 4 slots of each warp that share a lane group, then the 8 warps in order: deterministic.
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float v = acc[m][c];
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            acc[m][c] = v;
        }
    if (lane < kLanesPerRow) {
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int c = 0; c < 4; ++c) red[warp][m][lg * 4 + c] = acc[m][c];
    }
    __syncthreads();
    if (threadIdx.x < M * kTileCols) {
        const int m = threadIdx.x / kTileCols, cc = threadIdx.x % kTileCols;
        const int nn = blockIdx.x * kTileCols + cc;
        if (nn < n) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) s += red[w][m][cc];
            if (bias) s += __half2float(bias[nn]);
            out[static_cast<int64_t>(m) * n + nn] = __float2half(s);
        }
    }
}

template <int M>
void launch_lean(const GemvArgs& a, bool pdl) {
    const int64_t staged = (a.k + 8 * kBatch - 1) / (8 * kBatch) * kBatch;
    const size_t smem = static_cast<size_t>(M) * padded_rows(staged) * sizeof(uint4);
    auto kernel = gemv_lean_kernel<M>;
    allow_dynamic_smem(kernel, smem);
    const unsigned tiles = static_cast<unsigned>((a.n + kTileCols - 1) / kTileCols);
    // x read as 16-byte rows of 8 inputs: no permutation, K % 8 == 0 and every row 16-byte aligned
    const bool vec_x = a.perm == nullptr && a.k % 8 == 0 && a.x_stride % 8 == 0 && aligned(a.x, 16);
    const half* x = static_cast<const half*>(a.x);
    const uint4* qw = reinterpret_cast<const uint4*>(a.qweight);
    const half* scales = static_cast<const half*>(a.scales);
    const half* zeros = static_cast<const half*>(a.zeros);
    const half* bias = static_cast<const half*>(a.bias);
    half* out = static_cast<half*>(a.out);
    const int k = static_cast<int>(a.k), n = static_cast<int>(a.n), gs = static_cast<int>(a.group_size);
    if (!pdl) {
        kernel<<<tiles, kThreads, smem, as_stream(a.stream)>>>(x, a.x_stride, a.perm, qw, scales, zeros, bias, out, k,
                                                                n, gs, vec_x, false);
        KB_CHECK_LAUNCH();
        return;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(tiles);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = as_stream(a.stream);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    KB_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, x, a.x_stride, a.perm, qw, scales, zeros, bias, out, k, n, gs,
                                     vec_x, true));
}

}  // namespace

void gptq_gemv_lean(const GemvArgs& a, bool pdl) {
    require(gptq_gemv_wide_fits(a, kThreads), "gptq_gemv_lean: shape outside the whole-K kernel's range");
    require(a.n < (1LL << 28), "gptq_gemv_lean: N must be below 2^28 (32-bit row offsets)");
    if (pdl) {  // programmatic dependent launch needs sm_90; elsewhere the plain launch
        int major = 0;
        KB_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a.device));
        pdl = major >= 9;
    }
    switch (a.m) {
        case 1: launch_lean<1>(a, pdl); break;
        case 2: launch_lean<2>(a, pdl); break;
        case 3: launch_lean<3>(a, pdl); break;
        case 4: launch_lean<4>(a, pdl); break;
        case 5: launch_lean<5>(a, pdl); break;
        case 6: launch_lean<6>(a, pdl); break;
        case 7: launch_lean<7>(a, pdl); break;
        default: launch_lean<8>(a, pdl); break;
    }
}

}  // namespace cuda
}  // namespace kb
