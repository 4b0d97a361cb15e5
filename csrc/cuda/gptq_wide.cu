// GPTQ 4-bit GEMV without split-K, for 1..8 rows: one block per 32 output columns reads the whole K.
//
// The split-K kernel in gptq.cu gives each block only a few 16-byte loads per thread and then pays a
// cross-block reduction (partials, fence, atomic, a second read). Here each block (256 or 512 threads) owns a
// 32-column tile for all of K, so the reduction stays in the block (shuffles, then one pass over shared
// memory, in a fixed order: deterministic) and every thread keeps up to 16 independent 16-byte weight loads
// in flight (two batches of 8 packed rows). gptq.cu's choose_gemv decides where this kernel runs. The qweight layout is the GPTQ one ([K/8, N] int32, row 8r + j at bits
// 4j of word r): 8 lanes read one packed row of the tile, 128 contiguous bytes, so a warp reads four full
// cache lines per load. Scales and zeros are read once per batch (a batch of 8 packed rows = 64 inputs
// lies in one group when the group size is a multiple of 64, which gptq_gemv_wide_fits checks).
#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kLanesPerRow = 8;                     // 8 lanes x 4 columns = 32 columns per tile
constexpr int kTileCols = kLanesPerRow * 4;
constexpr int kBatch = 8;                           // packed rows per slot per batch (64 inputs)
constexpr int64_t kMaxStageBytes = 96 * 1024;       // x staged in shared memory for all of K
constexpr int kStageUnroll = 4;                     // 16-byte staging loads in flight per thread
constexpr int kGatherUnroll = 2;                    // packed rows gathered at once per thread

__device__ __forceinline__ uint32_t half2_as_u32(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// Row r of staged x sits at uint4 index r + r / 8: the 4 slots of a warp read rows 8 apart, and the
// padding puts them in different banks.
__device__ __forceinline__ int padded(int r) { return r + (r >> 3); }
__host__ __device__ inline int64_t padded_rows(int64_t rows) { return rows + rows / 8 + 1; }

// See dequant_word in gptq.cu: 8 weights of one word as (q - zero) * scale, paired rows (j, j + 4).
__device__ __forceinline__ void dequant8(uint32_t w, half2 z, half2 s, half2 (&out)[4]) {
    const half2 k1024 = u32_as_half2(0x64006400u);
    const half2 k16th = u32_as_half2(0x2C002C00u);
    const half2 km64 = u32_as_half2(0xD400D400u);
    const half2 a = u32_as_half2((w & 0x000F000Fu) | 0x64006400u);
    const half2 b = u32_as_half2((w & 0x00F000F0u) | 0x64006400u);
    w >>= 8;
    const half2 c = u32_as_half2((w & 0x000F000Fu) | 0x64006400u);
    const half2 d = u32_as_half2((w & 0x00F000F0u) | 0x64006400u);
    out[0] = __hmul2(__hsub2(__hsub2(a, k1024), z), s);
    out[1] = __hmul2(__hsub2(__hfma2(b, k16th, km64), z), s);
    out[2] = __hmul2(__hsub2(__hsub2(c, k1024), z), s);
    out[3] = __hmul2(__hsub2(__hfma2(d, k16th, km64), z), s);
}

struct Batch {
    uint4 w[kBatch];
    uint2 s, z;
};

__device__ __forceinline__ void load_batch(const uint4* __restrict__ qp, int64_t n4, int rb, int rows,
                                           const half* __restrict__ scales, const half* __restrict__ zeros,
                                           int64_t n, int col, int group_size, Batch& b) {
    const int r0 = rb * kBatch;
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
        b.w[u] = r0 + u < rows ? __ldg(qp + static_cast<int64_t>(r0 + u) * n4) : make_uint4(0, 0, 0, 0);
    const int64_t g = (8LL * r0) / group_size;
    b.s = __ldg(reinterpret_cast<const uint2*>(scales + g * n + col));
    b.z = __ldg(reinterpret_cast<const uint2*>(zeros + g * n + col));
}

template <int M>
__device__ __forceinline__ void consume(const Batch& b, const uint4* __restrict__ xs, int xrows, int rb, int rows,
                                        float (&acc)[M][4]) {
    const half2 s01 = u32_as_half2(b.s.x), s23 = u32_as_half2(b.s.y);
    const half2 z01 = u32_as_half2(b.z.x), z23 = u32_as_half2(b.z.y);
    const half2 s2[4] = {__low2half2(s01), __high2half2(s01), __low2half2(s23), __high2half2(s23)};
    const half2 z2[4] = {__low2half2(z01), __high2half2(z01), __low2half2(z23), __high2half2(z23)};
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
        if (rb * kBatch + u >= rows) break;  // the last batch of a K that is not a multiple of 64: x is staged to K
        const uint32_t words[4] = {b.w[u].x, b.w[u].y, b.w[u].z, b.w[u].w};
        const int xr = padded(rb * kBatch + u);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            half2 dq[4];
            dequant8(words[c], z2[c], s2[c], dq);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const uint4 xv = xs[m * xrows + xr];
                half2 h = __hmul2(dq[0], u32_as_half2(xv.x));
                h = __hfma2(dq[1], u32_as_half2(xv.y), h);
                h = __hfma2(dq[2], u32_as_half2(xv.z), h);
                h = __hfma2(dq[3], u32_as_half2(xv.w), h);
                const float2 f = __half22float2(h);
                acc[m][c] += f.x + f.y;
            }
        }
    }
}

// Grid: one block per 32-column tile. Thread: lane group (4 columns) and row slot; slot s takes the
// 8-row blocks s, s + S, s + 2S, ... of K (S = threads / 8 slots), two batches in flight.
template <int M, int kThreads>
__global__ void __launch_bounds__(kThreads, M <= 2 && kThreads == 256 ? 2 : 1) gemv_wide_kernel(
    const half* __restrict__ x, int64_t x_stride, const int64_t* __restrict__ perm, const uint4* __restrict__ qw4,
    const half* __restrict__ scales, const half* __restrict__ zeros, const half* __restrict__ bias,
    half* __restrict__ out, int k, int n, int group_size, bool vec_x) {
    constexpr int kWarps = kThreads / 32;
    constexpr int kSlots = kThreads / kLanesPerRow;  // row slots per block
    extern __shared__ uint4 xs[];
    __shared__ float red[kWarps][M][kTileCols];
    const int rows = (k + 7) / 8;
    const int row_blocks = (rows + kBatch - 1) / kBatch;
    const int xrows = static_cast<int>(padded_rows(rows));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int lg = lane % kLanesPerRow;
    const int slot = warp * (32 / kLanesPerRow) + lane / kLanesPerRow;
    const int col = blockIdx.x * kTileCols + lg * 4;
    const bool active = col < n;  // n % 4 == 0: a lane's 4 columns are all in or all out
    const int64_t n4 = n / 4;
    const uint4* qp = qw4 + (active ? col / 4 : 0);

    Batch cur, nxt;
    int rb = slot;
    if (active && rb < row_blocks) load_batch(qp, n4, rb, rows, scales, zeros, n, col, group_size, cur);
    if (active && rb + kSlots < row_blocks)
        load_batch(qp, n4, rb + kSlots, rows, scales, zeros, n, col, group_size, nxt);

    // Stage x[:, perm[8r + j]] as half2 pairs (j, j + 4) per packed row r; inputs past K are zero. Each
    // thread issues 4 rows' 16-byte loads (or 2 rows' gathers) before storing any, while its weight loads
    // are already in flight.
    if (vec_x) {
        for (int m = 0; m < M; ++m) {
            const uint4* xr = reinterpret_cast<const uint4*>(x + m * x_stride);
            for (int r0 = threadIdx.x; r0 < rows; r0 += kThreads * kStageUnroll) {
                uint4 v[kStageUnroll];
#pragma unroll
                for (int u = 0; u < kStageUnroll; ++u) {
                    const int r = r0 + u * kThreads;
                    if (r < rows) v[u] = __ldg(xr + r);
                }
#pragma unroll
                for (int u = 0; u < kStageUnroll; ++u) {
                    const int r = r0 + u * kThreads;
                    if (r < rows)
                        xs[m * xrows + padded(r)] =
                            make_uint4(__byte_perm(v[u].x, v[u].z, 0x5410), __byte_perm(v[u].x, v[u].z, 0x7632),
                                       __byte_perm(v[u].y, v[u].w, 0x5410), __byte_perm(v[u].y, v[u].w, 0x7632));
                }
            }
        }
    } else {
        // Gathered through perm (or K % 8 != 0, or unaligned rows): per packed row, 8 indices then 8 inputs.
        for (int r0 = threadIdx.x; r0 < rows; r0 += kThreads * kGatherUnroll) {
            int src[kGatherUnroll][8];
#pragma unroll
            for (int u = 0; u < kGatherUnroll; ++u)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int i = 8 * (r0 + u * kThreads) + j;
                    src[u][j] = i < k ? (perm ? static_cast<int>(perm[i]) : i) : -1;
                }
            for (int m = 0; m < M; ++m) {
                half v[kGatherUnroll][8];
#pragma unroll
                for (int u = 0; u < kGatherUnroll; ++u)
#pragma unroll
                    for (int j = 0; j < 8; ++j)
                        v[u][j] = src[u][j] >= 0 ? x[m * x_stride + src[u][j]] : __float2half(0.0f);
#pragma unroll
                for (int u = 0; u < kGatherUnroll; ++u) {
                    const int r = r0 + u * kThreads;
                    if (r < rows) {
                        const half2 p0 = __halves2half2(v[u][0], v[u][4]), p1 = __halves2half2(v[u][1], v[u][5]);
                        const half2 p2 = __halves2half2(v[u][2], v[u][6]), p3 = __halves2half2(v[u][3], v[u][7]);
                        xs[m * xrows + padded(r)] = make_uint4(half2_as_u32(p0), half2_as_u32(p1), half2_as_u32(p2),
                                                               half2_as_u32(p3));
                    }
                }
            }
        }
    }
    __syncthreads();

    float acc[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;

    if (active) {
        while (rb < row_blocks) {
            consume<M>(cur, xs, xrows, rb, rows, acc);
            rb += kSlots;
            if (rb >= row_blocks) break;
            cur = nxt;
            if (rb + kSlots < row_blocks) load_batch(qp, n4, rb + kSlots, rows, scales, zeros, n, col, group_size, nxt);
        }
    }

    // Sum the 4 slots of each warp that share a lane group, then the 8 warps in order.
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

template <int M, int kThreads>
void launch_wide(const GemvArgs& a) {
    const int64_t rows = (a.k + 7) / 8;
    const size_t smem = static_cast<size_t>(M) * padded_rows(rows) * sizeof(uint4);
    auto kernel = gemv_wide_kernel<M, kThreads>;
    allow_dynamic_smem(kernel, smem);
    const unsigned tiles = static_cast<unsigned>((a.n + kTileCols - 1) / kTileCols);
    // x read as 16-byte rows of 8 inputs: no permutation, K % 8 == 0 and every row 16-byte aligned
    const bool vec_x = a.perm == nullptr && a.k % 8 == 0 && a.x_stride % 8 == 0 && aligned(a.x, 16);
    kernel<<<tiles, kThreads, smem, as_stream(a.stream)>>>(
        static_cast<const half*>(a.x), a.x_stride, a.perm, reinterpret_cast<const uint4*>(a.qweight),
        static_cast<const half*>(a.scales), static_cast<const half*>(a.zeros), static_cast<const half*>(a.bias),
        static_cast<half*>(a.out), static_cast<int>(a.k), static_cast<int>(a.n), static_cast<int>(a.group_size),
        vec_x);
    KB_CHECK_LAUNCH();
}

}  // namespace

bool gptq_gemv_wide_fits(const GemvArgs& a, int threads) {
    const int64_t rows = (a.k + 7) / 8;
    return a.m >= 1 && a.m <= (threads == 512 ? 2 : 8) && a.group_size % (8 * kBatch) == 0 && a.n % 4 == 0 &&
           a.m * padded_rows(rows) * static_cast<int64_t>(sizeof(uint4)) <= kMaxStageBytes &&
           (a.n + kTileCols - 1) / kTileCols < 2147483647LL && (threads == 256 || threads == 512);
}

void gptq_gemv_wide(const GemvArgs& a, int threads) {
    require(gptq_gemv_wide_fits(a, threads), "gptq_gemv_wide: shape outside the whole-K kernel's range");
    if (threads == 512) {
        if (a.m == 1) launch_wide<1, 512>(a);
        else launch_wide<2, 512>(a);
        return;
    }
    switch (a.m) {
        case 1: launch_wide<1, 256>(a); break;
        case 2: launch_wide<2, 256>(a); break;
        case 3: launch_wide<3, 256>(a); break;
        case 4: launch_wide<4, 256>(a); break;
        case 5: launch_wide<5, 256>(a); break;
        case 6: launch_wide<6, 256>(a); break;
        case 7: launch_wide<7, 256>(a); break;
        default: launch_wide<8, 256>(a); break;
    }
}

}  // namespace cuda
}  // namespace kb
