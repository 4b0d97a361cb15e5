// EXL2 kernels on exllamav2's stored layout (docs/exl2.md): a GEMV for 1..4 rows that reads every packed
// word once (16-byte loads of 4 columns, split-K over 32-row chunks with a deterministic last-block
// reduction), and dequantization to fp16 [K, N] in input-feature order for prompt GEMMs.
//
// A chunk is 32 consecutive stored rows of one group; at width B it is exactly B words per column, value i
// at bits [i*B, i*B + B) of those words. Each chunk's first word row and width come from a table built at
// load, so groups of any width may follow in any order.
#include <algorithm>

#include "kb_cuda.cuh"
#include "ops_exl2.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileCols = 128;         // 32 lanes x 4 columns: one 16-byte load per lane per word row
constexpr int kMaxChunksPerBlock = 32; // 1024 input rows of x staged per block
constexpr int kMaxRows = 4;

// Value i of a B-bit chunk held in B words (compile-time i: the shifts and word picks fold away).
template <int B>
__device__ __forceinline__ uint32_t field(const uint32_t (&w)[B], int i) {
    const int bit = i * B, word = bit >> 5, shift = bit & 31;
    uint32_t v;
    if (shift + B <= 32 || word + 1 >= B)
        v = w[word] >> shift;
    else
        v = __funnelshift_r(w[word], w[word + 1], shift);
    return v & ((1u << B) - 1u);
}

// The fp16 scale of a group for one column: (code + 1)^2 * fp16(q_scale_max / 256), rounded to fp16.
__device__ __forceinline__ float group_scale(uint32_t code, float smax) {
    const float s = static_cast<float>((code + 1) * (code + 1)) * smax;
    return __half2float(__float2half_rn(s));
}

__device__ __forceinline__ float scale_max(const half* q_scale_max, int g) {
    return __half2float(__float2half_rn(__half2float(q_scale_max[g]) * (1.0f / 256.0f)));
}

// (q - 2^(B-1)) as float: q OR-ed into the mantissa of 2^23 is 2^23 + q exactly; one subtract removes both.
template <int B>
__device__ __forceinline__ float centered(uint32_t q) {
    return __uint_as_float(0x4B000000u | q) - (8388608.0f + static_cast<float>(1 << (B - 1)));
}

template <int B, int M>
__device__ __forceinline__ void chunk_dot(const uint4* __restrict__ p, int64_t stride4, const float* xs, int xrows,
                                          int xr, const float (&s)[4], float (&acc)[M][4]) {
    uint32_t w[4][B];
#pragma unroll
    for (int j = 0; j < B; ++j) {
        const uint4 v = __ldg(p + j * stride4);
        w[0][j] = v.x; w[1][j] = v.y; w[2][j] = v.z; w[3][j] = v.w;
    }
    float part[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) part[m][c] = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i += 4) {
        float4 xv[M];
#pragma unroll
        for (int m = 0; m < M; ++m) xv[m] = *reinterpret_cast<const float4*>(xs + m * xrows + xr + i);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float q0 = centered<B>(field<B>(w[c], i));
            const float q1 = centered<B>(field<B>(w[c], i + 1));
            const float q2 = centered<B>(field<B>(w[c], i + 2));
            const float q3 = centered<B>(field<B>(w[c], i + 3));
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float t = part[m][c];
                t = fmaf(q0, xv[m].x, t);
                t = fmaf(q1, xv[m].y, t);
                t = fmaf(q2, xv[m].z, t);
                t = fmaf(q3, xv[m].w, t);
                part[m][c] = t;
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = fmaf(part[m][c], s[c], acc[m][c]);
}

// Grid (column tiles, K splits of whole chunks); block: 8 warps over one tile of 128 columns, each warp a
// contiguous run of this split's chunks. Shared memory: x[:, perm] of the split as float, then the cross-warp sum.
template <int M>
__global__ void __launch_bounds__(kThreads) exl2_gemv_kernel(
    const half* __restrict__ x, int64_t x_stride, const int64_t* __restrict__ perm, const uint4* __restrict__ qw4,
    const uint32_t* __restrict__ q_scale, const half* __restrict__ q_scale_max, const int2* __restrict__ chunks,
    const int32_t* __restrict__ chunk_groups, const half* __restrict__ bias, half* __restrict__ out,
    float* __restrict__ partial, unsigned int* __restrict__ counters, int k, int n, int n_stored,
    int chunks_per_split) {
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    __shared__ bool is_last;
    const int splits = gridDim.y;
    const int nchunks = k / 32;
    const int c0 = blockIdx.y * chunks_per_split;
    const int nc = min(chunks_per_split, nchunks - c0);
    const int xrows = nc * 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int col = blockIdx.x * kTileCols + lane * 4;
    const int stride4 = n_stored / 4;
    const bool active = col < n_stored;
    const int per_warp = (nc + kWarps - 1) / kWarps;
    const int wb = min(warp * per_warp, nc), we = min(wb + per_warp, nc);

    for (int i = threadIdx.x; i < xrows; i += kThreads) {
        const int64_t src = perm[32LL * c0 + i];
#pragma unroll
        for (int m = 0; m < M; ++m) smem[m * xrows + i] = __half2float(x[m * x_stride + src]);
    }
    __syncthreads();

    float acc[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;

    if (active) {
        int cur_g = -1;
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int c = wb; c < we; ++c) {
            const int2 ch = __ldg(chunks + c0 + c);
            const int g = __ldg(chunk_groups + c0 + c);
            if (g != cur_g) {
                cur_g = g;
                const uint32_t word = __ldg(q_scale + static_cast<int64_t>(g) * (n_stored / 8) + col / 8) >> (4 * (col & 7));
                const float smax = scale_max(q_scale_max, g);
#pragma unroll
                for (int j = 0; j < 4; ++j) s[j] = group_scale((word >> (4 * j)) & 15u, smax);
            }
            const uint4* p = qw4 + static_cast<int64_t>(ch.x) * stride4 + col / 4;
            const int xr = c * 32;
            switch (ch.y) {
                case 2: chunk_dot<2, M>(p, stride4, smem, xrows, xr, s, acc); break;
                case 3: chunk_dot<3, M>(p, stride4, smem, xrows, xr, s, acc); break;
                case 4: chunk_dot<4, M>(p, stride4, smem, xrows, xr, s, acc); break;
                case 5: chunk_dot<5, M>(p, stride4, smem, xrows, xr, s, acc); break;
                case 6: chunk_dot<6, M>(p, stride4, smem, xrows, xr, s, acc); break;
                default: chunk_dot<8, M>(p, stride4, smem, xrows, xr, s, acc); break;
            }
        }
    }

    __syncthreads();  // x staging is done with; reuse shared memory for the cross-warp sum
    float* red = smem;
#pragma unroll
    for (int m = 0; m < M; ++m)
        reinterpret_cast<float4*>(red)[(warp * M + m) * (kTileCols / 4) + lane] =
            make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    __syncthreads();
    for (int i = threadIdx.x; i < M * kTileCols; i += kThreads) {
        const int m = i / kTileCols, cc = i % kTileCols, nn = blockIdx.x * kTileCols + cc;
        float sum = 0.0f;
#pragma unroll
        for (int wi = 0; wi < kWarps; ++wi) sum += red[(wi * M + m) * kTileCols + cc];
        if (nn < n) {
            if (splits == 1)
                out[static_cast<int64_t>(m) * n + nn] = __float2half(sum + (bias ? __half2float(bias[nn]) : 0.0f));
            else
                partial[(static_cast<int64_t>(blockIdx.y) * M + m) * n + nn] = sum;
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
        float sum = 0.0f;
        for (int sp = 0; sp < splits; ++sp) sum += __ldcg(&partial[(static_cast<int64_t>(sp) * M + m) * n + nn]);
        out[static_cast<int64_t>(m) * n + nn] = __float2half(sum + (bias ? __half2float(bias[nn]) : 0.0f));
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch on this workspace
}

template <int M>
void launch_gemv(const Exl2Args& a, int chunks_per_split, int splits, int tiles) {
    const size_t stage = static_cast<size_t>(M) * chunks_per_split * 32 * sizeof(float);
    const size_t reduce = static_cast<size_t>(kWarps) * M * kTileCols * sizeof(float);
    const size_t smem = std::max(stage, reduce);
    exl2_gemv_kernel<M><<<dim3(tiles, splits), kThreads, smem, as_stream(a.stream)>>>(
        static_cast<const half*>(a.x), a.x_stride, a.perm, reinterpret_cast<const uint4*>(a.q_weight), a.q_scale,
        static_cast<const half*>(a.q_scale_max), reinterpret_cast<const int2*>(a.chunks), a.chunk_groups,
        static_cast<const half*>(a.bias), static_cast<half*>(a.out), a.ws.data, a.ws.counters,
        static_cast<int>(a.k), static_cast<int>(a.n), static_cast<int>(a.n_stored), chunks_per_split);
    KB_CHECK_LAUNCH();
}

template <int B>
__device__ __forceinline__ void dequant_chunk(const uint32_t* __restrict__ p, int64_t stride, float s,
                                              const int64_t* __restrict__ perm, int row0, int n, int col,
                                              half* __restrict__ out) {
    uint32_t w[B];
#pragma unroll
    for (int j = 0; j < B; ++j) w[j] = __ldg(p + j * stride);
#pragma unroll
    for (int i = 0; i < 32; ++i)
        out[perm[row0 + i] * n + col] = __float2half_rn(centered<B>(field<B>(w, i)) * s);
}

// Grid (column blocks, chunk strides); one thread per column and chunk.
__global__ void exl2_dequant_kernel(const uint32_t* __restrict__ qw, const int64_t* __restrict__ perm,
                                    const uint32_t* __restrict__ q_scale, const half* __restrict__ q_scale_max,
                                    const int2* __restrict__ chunks, const int32_t* __restrict__ chunk_groups,
                                    int k, int n, int n_stored, half* __restrict__ out) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= n) return;
    for (int c = blockIdx.y; c < k / 32; c += gridDim.y) {
        const int2 ch = chunks[c];
        const int g = chunk_groups[c];
        const uint32_t code = (q_scale[static_cast<int64_t>(g) * (n_stored / 8) + col / 8] >> (4 * (col & 7))) & 15u;
        const float s = group_scale(code, scale_max(q_scale_max, g));
        const uint32_t* p = qw + static_cast<int64_t>(ch.x) * n_stored + col;
        switch (ch.y) {
            case 2: dequant_chunk<2>(p, n_stored, s, perm, 32 * c, n, col, out); break;
            case 3: dequant_chunk<3>(p, n_stored, s, perm, 32 * c, n, col, out); break;
            case 4: dequant_chunk<4>(p, n_stored, s, perm, 32 * c, n, col, out); break;
            case 5: dequant_chunk<5>(p, n_stored, s, perm, 32 * c, n, col, out); break;
            case 6: dequant_chunk<6>(p, n_stored, s, perm, 32 * c, n, col, out); break;
            default: dequant_chunk<8>(p, n_stored, s, perm, 32 * c, n, col, out); break;
        }
    }
}

void check_common(const Exl2Args& a, const char* what) {
    require(a.k >= 32 && a.k % 32 == 0, std::string(what) + " needs K a positive multiple of 32");
    require(a.n >= 1 && a.n_stored >= a.n && a.n_stored % 32 == 0,
            std::string(what) + " needs 1 <= N <= stored columns, a multiple of 32");
    require(a.k < (1LL << 31) && a.n_stored < (1LL << 31), std::string(what) + ": K and N must fit in int32");
    require(a.perm && a.q_weight && a.q_scale && a.q_scale_max && a.chunks && a.chunk_groups && a.out,
            std::string(what) + " got a null tensor");
}

}  // namespace

void exl2_gemv(const Exl2Args& a) {
    check_common(a, "exl2_gemv");
    require(a.m >= 1 && a.m <= kMaxRows, "exl2_gemv takes 1 to 4 rows");
    require(aligned(a.q_weight, 16), "exl2_gemv needs q_weight 16-byte aligned");
    use_device(a.device);
    const int64_t nchunks = a.k / 32;
    const int64_t tiles = (a.n_stored + kTileCols - 1) / kTileCols;
    // Aim for ~4 blocks per multiprocessor; split K when the column tiles alone are too few.
    const int64_t want = std::max<int64_t>(1, (4LL * sm_count(a.device) + tiles - 1) / tiles);
    int64_t cps = (nchunks + want - 1) / want;
    cps = std::min<int64_t>(kMaxChunksPerBlock, std::max<int64_t>(cps, std::min<int64_t>(4, nchunks)));
    const int64_t splits = (nchunks + cps - 1) / cps;
    if (splits > 1) {
        require(a.ws.data && a.ws.counters && tiles <= a.ws.ncounters,
                "exl2_gemv: the workspace has too few counters for this N");
        require(splits * a.m * a.n <= a.ws.floats, "exl2_gemv: the workspace is too small for this shape");
        require(splits <= 65535, "exl2_gemv: K too large");
    }
    const int c = static_cast<int>(cps), s = static_cast<int>(splits), t = static_cast<int>(tiles);
    switch (a.m) {
        case 1: launch_gemv<1>(a, c, s, t); break;
        case 2: launch_gemv<2>(a, c, s, t); break;
        case 3: launch_gemv<3>(a, c, s, t); break;
        default: launch_gemv<4>(a, c, s, t); break;
    }
}

void exl2_dequantize(const Exl2Args& a) {
    check_common(a, "exl2_dequantize");
    use_device(a.device);
    const int threads = 128;
    const dim3 grid(blocks_for(a.n, threads, 2147483647LL), static_cast<unsigned>(std::min<int64_t>(a.k / 32, 65535)));
    exl2_dequant_kernel<<<grid, threads, 0, as_stream(a.stream)>>>(
        a.q_weight, a.perm, a.q_scale, static_cast<const half*>(a.q_scale_max), reinterpret_cast<const int2*>(a.chunks),
        a.chunk_groups, static_cast<int>(a.k), static_cast<int>(a.n), static_cast<int>(a.n_stored),
        static_cast<half*>(a.out));
    KB_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace kb
