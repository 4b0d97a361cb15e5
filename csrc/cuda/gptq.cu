// GPTQ 4-bit kernels: a GEMV for 1..8 rows that reads every packed weight once (16-byte loads,
// split-K with a deterministic last-block reduction), and dequantization to fp16 for prompt GEMMs.
// gptq_gemv hands wide outputs to the whole-K kernel of gptq_wide.cu.
#include <algorithm>

#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileCols = 128;        // 32 lanes x 4 columns: one 16-byte load per lane per packed row
constexpr int kMaxRowsPerBlock = 128; // packed rows (1024 input rows) of x staged per block
constexpr int kUnroll = 4;            // packed rows loaded per step; two steps are in flight

// The 8 weights of one packed word as (q - zero) * scale in fp16, paired (row j, row j + 4), j = 0..3.
// OR-ing a nibble into the mantissa of 1024.0 (0x6400) gives 1024 + q (or 1024 + 16q for the upper
// nibble of a byte) exactly; one subtract or fma recovers q, so q - zero is rounded once as in torch.
__device__ __forceinline__ void dequant_word(uint32_t w, half2 z, half2 s, half2 (&out)[4]) {
    const half2 k1024 = u32_as_half2(0x64006400u);
    const half2 k16th = u32_as_half2(0x2C002C00u);  // 1/16
    const half2 km64 = u32_as_half2(0xD400D400u);   // -64
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

__device__ __forceinline__ void load_rows(const uint4* __restrict__ p, int64_t stride, int first, int end,
                                          uint4 (&w)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
        if (first + u < end) w[u] = __ldg(p + static_cast<int64_t>(first + u) * stride);
}

// Grid (column tiles, K splits); block: 8 warps over one tile of 128 columns, each warp a contiguous
// run of this split's packed rows. Shared memory: x staged as half2 pairs, then reused for the
// cross-warp sum.
template <int M>
__global__ void __launch_bounds__(kThreads) gemv_kernel(
    const half* __restrict__ x, int64_t x_stride, const int64_t* __restrict__ perm, const uint4* __restrict__ qw4,
    const half* __restrict__ scales, const half* __restrict__ zeros, const half* __restrict__ bias,
    half* __restrict__ out, float* __restrict__ partial, unsigned int* __restrict__ counters, int k, int n,
    int group_size, int rows_per_split) {
    extern __shared__ uint4 smem[];
    __shared__ bool is_last;
    const int splits = gridDim.y;
    const int rows = (k + 7) / 8;
    const int r0 = blockIdx.y * rows_per_split;
    const int nrows = min(rows_per_split, rows - r0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int col = blockIdx.x * kTileCols + lane * 4;
    const int n4 = n / 4;
    const bool active = col < n;  // n % 4 == 0, so the lane's 4 columns are all in or all out
    const int per_warp = (nrows + kWarps - 1) / kWarps;
    const int wb = min(warp * per_warp, nrows), we = min(wb + per_warp, nrows);
    const uint4* qp = qw4 + static_cast<int64_t>(r0) * n4 + col / 4;

    // Issue the first weight loads before staging x so both latencies overlap.
    uint4 next[kUnroll];
    if (active) load_rows(qp, n4, wb, we, next);

    // Stage x[:, perm[8r + j]] for this split as half2 (j, j + 4); rows past K are zero.
    half* xs = reinterpret_cast<half*>(smem);
#pragma unroll
    for (int u = 0; u < kMaxRowsPerBlock * 8 / kThreads; ++u) {
        const int slot = threadIdx.x + u * kThreads;  // slot = 8 * r + j
        if (slot < nrows * 8) {
            const int kk = 8 * r0 + slot;
            const int j = slot & 7;
            const int pos = (slot & ~7) + (j < 4 ? 2 * j : 2 * (j - 4) + 1);
            const int64_t src = kk < k ? (perm ? perm[kk] : kk) : -1;
#pragma unroll
            for (int m = 0; m < M; ++m)
                xs[m * nrows * 8 + pos] = src >= 0 ? x[m * x_stride + src] : __float2half(0.0f);
        }
    }
    __syncthreads();

    float acc[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;

    if (active) {
        int cur_g = -1;
        half2 z2[4], s2[4];
        for (int r = wb; r < we; r += kUnroll) {
            uint4 w[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) w[u] = next[u];
            if (r + kUnroll < we) load_rows(qp, n4, r + kUnroll, we, next);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                if (r + u >= we) break;
                const int g = (8 * (r0 + r + u)) / group_size;
                if (g != cur_g) {
                    cur_g = g;
                    const uint2 zz = __ldg(reinterpret_cast<const uint2*>(zeros + static_cast<int64_t>(g) * n + col));
                    const uint2 ss = __ldg(reinterpret_cast<const uint2*>(scales + static_cast<int64_t>(g) * n + col));
                    const half2 z01 = u32_as_half2(zz.x), z23 = u32_as_half2(zz.y);
                    const half2 s01 = u32_as_half2(ss.x), s23 = u32_as_half2(ss.y);
                    z2[0] = __low2half2(z01); z2[1] = __high2half2(z01);
                    z2[2] = __low2half2(z23); z2[3] = __high2half2(z23);
                    s2[0] = __low2half2(s01); s2[1] = __high2half2(s01);
                    s2[2] = __low2half2(s23); s2[3] = __high2half2(s23);
                }
                const uint32_t words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
                half2 dq[4][4];
#pragma unroll
                for (int c = 0; c < 4; ++c) dequant_word(words[c], z2[c], s2[c], dq[c]);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const uint4 xv = smem[m * nrows + r + u];
                    const half2 x0 = u32_as_half2(xv.x), x1 = u32_as_half2(xv.y);
                    const half2 x2 = u32_as_half2(xv.z), x3 = u32_as_half2(xv.w);
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        half2 h = __hmul2(dq[c][0], x0);
                        h = __hfma2(dq[c][1], x1, h);
                        h = __hfma2(dq[c][2], x2, h);
                        h = __hfma2(dq[c][3], x3, h);
                        const float2 f = __half22float2(h);
                        acc[m][c] += f.x + f.y;
                    }
                }
            }
        }
    }

    __syncthreads();  // x staging is done with; reuse shared memory for the cross-warp sum
    float* red = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int m = 0; m < M; ++m)
        reinterpret_cast<float4*>(red)[(warp * M + m) * (kTileCols / 4) + lane] =
            make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    __syncthreads();
    for (int i = threadIdx.x; i < M * kTileCols; i += kThreads) {
        const int m = i / kTileCols, cc = i % kTileCols, nn = blockIdx.x * kTileCols + cc;
        float s = 0.0f;
#pragma unroll
        for (int wi = 0; wi < kWarps; ++wi) s += red[(wi * M + m) * kTileCols + cc];
        if (nn < n) {
            if (splits == 1)
                out[static_cast<int64_t>(m) * n + nn] = __float2half(s + (bias ? __half2float(bias[nn]) : 0.0f));
            else
                partial[(static_cast<int64_t>(blockIdx.y) * M + m) * n + nn] = s;
        }
    }
    if (splits == 1) return;

    // The last block of this tile to finish sums the splits in a fixed order and writes the output.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&counters[blockIdx.x], 1u) == static_cast<unsigned>(splits - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int i = threadIdx.x; i < M * kTileCols; i += kThreads) {
        const int m = i / kTileCols, nn = blockIdx.x * kTileCols + i % kTileCols;
        if (nn >= n) continue;
        float s = 0.0f;
        for (int sp = 0; sp < splits; ++sp) s += __ldcg(&partial[(static_cast<int64_t>(sp) * M + m) * n + nn]);
        out[static_cast<int64_t>(m) * n + nn] = __float2half(s + (bias ? __half2float(bias[nn]) : 0.0f));
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch on this workspace
}

template <int M>
void launch_gemv(const GemvArgs& a, int rows_per_split, int splits, int tiles) {
    const size_t stage = static_cast<size_t>(M) * rows_per_split * sizeof(uint4);
    const size_t reduce = static_cast<size_t>(kWarps) * M * kTileCols * sizeof(float);
    const size_t smem = std::max(stage, reduce);
    gemv_kernel<M><<<dim3(tiles, splits), kThreads, smem, as_stream(a.stream)>>>(
        static_cast<const half*>(a.x), a.x_stride, a.perm, reinterpret_cast<const uint4*>(a.qweight),
        static_cast<const half*>(a.scales), static_cast<const half*>(a.zeros), static_cast<const half*>(a.bias),
        static_cast<half*>(a.out), a.ws.data, a.ws.counters, static_cast<int>(a.k), static_cast<int>(a.n),
        static_cast<int>(a.group_size), rows_per_split);
    KB_CHECK_LAUNCH();
}

__global__ void dequant_kernel(const uint32_t* __restrict__ qw, int k, int n, const half* __restrict__ scales,
                               const half* __restrict__ zeros, int group_size, half* __restrict__ out) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= n) return;
    const int rows = (k + 7) / 8;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const uint32_t w = __ldg(qw + static_cast<int64_t>(r) * n + col);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int kk = 8 * r + j;
            if (kk >= k) break;
            const int64_t g = kk / group_size;
            const half q = __int2half_rn(static_cast<int>((w >> (4 * j)) & 15u));
            out[static_cast<int64_t>(kk) * n + col] =
                __hmul(__hsub(q, zeros[g * n + col]), scales[g * n + col]);
        }
    }
}

// The GEMV kernel for a shape when none is forced: 1 split-K, 2 or 3 whole-K with 256 or 512 threads
// (gptq_wide.cu). From tools/gptq_gemv_bench.py on the H200 (docs/performance.md): whole-K needs its 32-column
// tiles to fill most multiprocessors; it wins at 1-2 rows on every 7B/13B/70B shape whose tiles fill the last wave
// well (>= 90%) or whose K is short (<= 5120), and at up to 8 rows on N = 4096; split-K wins at 4-8 rows on wide
// outputs, on ragged last waves with long K (13B down, 70B qkv), and for act-order over more than 3 waves of
// tiles (each whole-K block gathers all of x through the permutation). With one tile or fewer per
// multiprocessor and a long K, 512 threads keep more loads in flight (7B down: 15.8 vs 17.3 us).
int choose_gemv(const GemvArgs& a, int sms) {
    const int64_t tiles = (a.n + 31) / 32;
    const int64_t waves = (tiles + sms - 1) / sms;
    const bool fill = 10 * tiles >= 9 * waves * sms;
    const bool wide = 4 * tiles >= 3LL * sms && (a.m <= 2 || a.n <= 4096) && (a.k <= 5120 || fill) &&
                      (a.perm == nullptr || tiles <= 3LL * sms);
    if (!wide) return 1;
    if (a.m <= 2 && tiles <= sms && a.k >= 8192 && gptq_gemv_wide_fits(a, 512)) return 3;
    return gptq_gemv_wide_fits(a, 256) ? 2 : 1;
}

}  // namespace

void gptq_gemv(const GemvArgs& a) {
    require(a.m >= 1 && a.m <= 8, "gptq_gemv takes 1 to 8 rows");
    require(a.k >= 1 && a.n >= 4 && a.n % 4 == 0, "gptq_gemv needs K >= 1 and N a multiple of 4");
    require(a.k < (1LL << 31) && a.n < (1LL << 31), "gptq_gemv: K and N must fit in int32");
    require(a.group_size >= 8 && a.group_size % 8 == 0, "gptq_gemv needs a group size that is a multiple of 8");
    require(a.groups == (a.k + a.group_size - 1) / a.group_size, "gptq_gemv: groups != ceil(K / group_size)");
    require(aligned(a.qweight, 16) && aligned(a.scales, 8) && aligned(a.zeros, 8),
            "gptq_gemv needs qweight 16-byte aligned and scales/zeros 8-byte aligned");
    require(a.variant >= 0 && a.variant <= 6,
            "gptq_gemv: variant must be 0 (auto), 1 (split-K), 2 or 3 (whole-K, 256 or 512 threads), 4 or 5 "
            "(whole-K lean, without or with programmatic dependent launch) or 6 (auto with the 256/512-thread whole-K "
            "kernels instead of the lean one)");
    use_device(a.device);
    if (a.variant == 4 || a.variant == 5) {
        require(gptq_gemv_wide_fits(a, 256), "gptq_gemv: this shape cannot use the whole-K kernel");
        gptq_gemv_lean(a, a.variant == 5);
        return;
    }
    if (a.variant == 2 || a.variant == 3) {
        const int threads = a.variant == 2 ? 256 : 512;
        require(gptq_gemv_wide_fits(a, threads), "gptq_gemv: this shape cannot use the whole-K kernel");
        gptq_gemv_wide(a, threads);
        return;
    }
    int variant = a.variant == 1 ? 1 : choose_gemv(a, sm_count(a.device));
    // Where a whole-K kernel is chosen the lean one runs: 17-25 % faster at 1 row on every 7B shape measured
    // (docs/performance.md); variant 6 keeps the previous 256/512-thread choice for comparison.
    if (a.variant != 6 && (variant == 2 || variant == 3)) variant = 4;
    if (variant >= 4) {
        gptq_gemv_lean(a, variant == 5);
        return;
    }
    if (variant >= 2) {
        gptq_gemv_wide(a, variant == 2 ? 256 : 512);
        return;
    }
    const int64_t rows = (a.k + 7) / 8;
    const int64_t tiles = (a.n + kTileCols - 1) / kTileCols;
    require(tiles <= 2147483647LL, "gptq_gemv: N too large");
    // Aim for ~4 blocks per multiprocessor; split K when the column tiles alone are too few.
    const int64_t want = std::max<int64_t>(1, (4LL * sm_count(a.device) + tiles - 1) / tiles);
    int64_t rps = (rows + want - 1) / want;
    rps = std::min<int64_t>(kMaxRowsPerBlock, std::max<int64_t>(rps, std::min<int64_t>(16, rows)));
    int64_t splits = (rows + rps - 1) / rps;
    if (splits > 1) {
        require(a.ws.data && a.ws.counters && tiles <= a.ws.ncounters,
                "gptq_gemv: the workspace has too few counters for this N");
        require(splits * a.m * a.n <= a.ws.floats, "gptq_gemv: the workspace is too small for this shape");
        require(splits <= 65535, "gptq_gemv: K too large");
    }
    const int r = static_cast<int>(rps), s = static_cast<int>(splits), t = static_cast<int>(tiles);
    switch (a.m) {
        case 1: launch_gemv<1>(a, r, s, t); break;
        case 2: launch_gemv<2>(a, r, s, t); break;
        case 3: launch_gemv<3>(a, r, s, t); break;
        case 4: launch_gemv<4>(a, r, s, t); break;
        case 5: launch_gemv<5>(a, r, s, t); break;
        case 6: launch_gemv<6>(a, r, s, t); break;
        case 7: launch_gemv<7>(a, r, s, t); break;
        default: launch_gemv<8>(a, r, s, t); break;
    }
}

void gptq_dequantize(const uint32_t* qweight, int64_t k, int64_t n, const void* scales, const void* zeros,
                     int64_t group_size, int64_t groups, void* out, int device, std::uintptr_t stream) {
    require(k >= 1 && n >= 1 && group_size >= 1, "gptq_dequantize needs positive K, N and group size");
    require(k < (1LL << 31) && n < (1LL << 31), "gptq_dequantize: K and N must fit in int32");
    require(groups == (k + group_size - 1) / group_size, "gptq_dequantize: groups != ceil(K / group_size)");
    use_device(device);
    const int threads = 256;
    const int64_t rows = (k + 7) / 8;
    const dim3 grid(blocks_for(n, threads, 2147483647LL), static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
    dequant_kernel<<<grid, threads, 0, as_stream(stream)>>>(qweight, static_cast<int>(k), static_cast<int>(n),
                                                            static_cast<const half*>(scales),
                                                            static_cast<const half*>(zeros),
                                                            static_cast<int>(group_size), static_cast<half*>(out));
    KB_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace kb
