// Decode attention (one query row per sequence) for every KV-cache dtype, one templated flash-decoding body:
//  - fd_chunk_kernel<KLoad, VLoad, NH, DL>: one block per (batch, KV head, group of <= NH of its query heads,
//    chunk of positions). Each of its 4 warps walks its own tiles of 32 positions with its own online softmax, so
//    no block-wide barrier sits between a tile's loads and its arithmetic:
//      scores: lane = position; the lane reads its whole K row in 16-byte loads (fp16, int8 or nibbles), applies
//              the group scale in registers and dots it with the query (shared memory, a broadcast read);
//      values: lane = DL consecutive output dims; the 32 positions of the tile are read (and dequantized) in one
//              unrolled sweep, so 32 loads per lane are in flight.
//    The warps merge in shared memory; the block writes its chunk's unnormalised output, max and sum.
//  - fd_reduce_kernel: one block per (batch, query head) merges the chunks.
// The load policies (F16Load, Q8Load, Q4Load) are the only part that knows the cache dtype. A quantized cache is
// stored Hadamard-rotated (ops/kv_quant.py): the query is rotated into that space as it is loaded and the output
// rotated back as it is written. The chunk count follows the context, the SM count and the instance's occupancy
// (one wave of resident blocks); with a device position (CUDA graphs) the plan is made for `seq_len` and chunks past
// the position are empty.
// KOBOLD_BACKEND_ATTN=legacy keeps the previous kernels (attention.cu, kv_quant.cu) for a same-run comparison.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 32;          // positions per warp step
constexpr int kMaxDim = 256;
constexpr int kGroup = 32;         // values per scale in a quantized cache
constexpr int kMinChunk = 128;     // one tile per warp
constexpr float kHadamardNorm = 0.17677669529663687f;  // 1 / sqrt(32)

__device__ __forceinline__ float hadamard32(float x, int lane) {
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, x, m);
        x = (lane & m) ? y - x : x + y;
    }
    return x * kHadamardNorm;
}

// Load policies. group(): the 32 values of group g of a row (stored values) and the factor they take (the group
// scale; 1 for fp16). slice<DL>(): DL consecutive values starting at e0 (a multiple of DL, inside one group).
struct F16Load {
    static constexpr bool kQuant = false;
    __device__ static __forceinline__ float group(const uint8_t* row, const half*, int g, float (&x)[kGroup]) {
        const uint4* p = reinterpret_cast<const uint4*>(row) + g * 4;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const uint4 raw = __ldg(p + c);
            const half2* h = reinterpret_cast<const half2*>(&raw);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = __half22float2(h[e]);
                x[8 * c + 2 * e] = f.x;
                x[8 * c + 2 * e + 1] = f.y;
            }
        }
        return 1.0f;
    }
    template <int DL>
    __device__ static __forceinline__ float slice(const uint8_t* row, const half*, int e0, float (&x)[DL]) {
        const half2* p = reinterpret_cast<const half2*>(row) + e0 / 2;
        if constexpr (DL == 8) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
            const half2* h = reinterpret_cast<const half2*>(&raw);
#pragma unroll
            for (int e = 0; e < DL / 2; ++e) {
                const float2 f = __half22float2(h[e]);
                x[2 * e] = f.x;
                x[2 * e + 1] = f.y;
            }
        } else if constexpr (DL == 4) {
            const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
            const half2* h = reinterpret_cast<const half2*>(&raw);
#pragma unroll
            for (int e = 0; e < DL / 2; ++e) {
                const float2 f = __half22float2(h[e]);
                x[2 * e] = f.x;
                x[2 * e + 1] = f.y;
            }
        } else {
            const float2 f = __half22float2(u32_as_half2(__ldg(reinterpret_cast<const uint32_t*>(p))));
            x[0] = f.x;
            x[DL - 1] = f.y;
        }
        return 1.0f;
    }
};

// Integers become floats without I2F (a quarter-rate conversion that would bound the q8/q4 loops before the
// memory does): an integer u in [0, 2^23) placed in the mantissa of 2^23 is the float 2^23 + u, exactly, so one
// byte permute or mask and one subtraction give the stored value.
constexpr uint32_t kTwo23 = 0x4B000000u;  // 2^23 as a float's bits

// The first N (<= 4) of the four int8 in w, lowest byte first.
template <int N>
__device__ __forceinline__ void int8_to_float(uint32_t w, float* x) {
    const uint32_t u = w ^ 0x80808080u;  // b -> b + 128, unsigned
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = __uint_as_float(__byte_perm(u, kTwo23, 0x7540u + e)) - 8388736.0f;
}

// N nibbles of w (stored + 8), lowest first.
template <int N>
__device__ __forceinline__ void nibbles_to_float(uint32_t w, float* x) {
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = __uint_as_float(((w >> (4 * e)) & 15u) | kTwo23) - 8388616.0f;
}

struct Q8Load {
    static constexpr bool kQuant = true;
    __device__ static __forceinline__ float group(const uint8_t* row, const half* srow, int g, float (&x)[kGroup]) {
        const uint4* p = reinterpret_cast<const uint4*>(row) + g * 2;
        const uint4 a = __ldg(p), b = __ldg(p + 1);
        int8_to_float<4>(a.x, x); int8_to_float<4>(a.y, x + 4); int8_to_float<4>(a.z, x + 8);
        int8_to_float<4>(a.w, x + 12); int8_to_float<4>(b.x, x + 16); int8_to_float<4>(b.y, x + 20);
        int8_to_float<4>(b.z, x + 24); int8_to_float<4>(b.w, x + 28);
        return __half2float(srow[g]);
    }
    template <int DL>
    __device__ static __forceinline__ float slice(const uint8_t* row, const half* srow, int e0, float (&x)[DL]) {
        if constexpr (DL == 8) {
            const uint2 raw = __ldg(reinterpret_cast<const uint2*>(row + e0));
            int8_to_float<4>(raw.x, x);
            int8_to_float<4>(raw.y, x + 4);
        } else if constexpr (DL == 4) {
            int8_to_float<4>(__ldg(reinterpret_cast<const uint32_t*>(row + e0)), x);
        } else {
            int8_to_float<DL>(__ldg(reinterpret_cast<const uint16_t*>(row + e0)), x);
        }
        return __half2float(srow[e0 / kGroup]);
    }
};

struct Q4Load {
    static constexpr bool kQuant = true;
    __device__ static __forceinline__ float group(const uint8_t* row, const half* srow, int g, float (&x)[kGroup]) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(row) + g);
        nibbles_to_float<8>(a.x, x); nibbles_to_float<8>(a.y, x + 8);
        nibbles_to_float<8>(a.z, x + 16); nibbles_to_float<8>(a.w, x + 24);
        return __half2float(srow[g]);
    }
    template <int DL>
    __device__ static __forceinline__ float slice(const uint8_t* row, const half* srow, int e0, float (&x)[DL]) {
        if constexpr (DL == 8) {
            nibbles_to_float<8>(__ldg(reinterpret_cast<const uint32_t*>(row + e0 / 2)), x);
        } else if constexpr (DL == 4) {
            nibbles_to_float<4>(__ldg(reinterpret_cast<const uint16_t*>(row + e0 / 2)), x);
        } else {
            nibbles_to_float<DL>(__ldg(row + e0 / 2), x);
        }
        return __half2float(srow[e0 / kGroup]);
    }
};

struct FdParams {
    const void* q;
    int q_f16, out_f16;
    int64_t q_sb, q_sh;
    const uint8_t* kd;  // K rows (bytes)
    const half* ks;     // K group scales (quantized caches)
    const uint8_t* vd;
    const half* vs;
    int64_t kd_sb, kd_sh, kd_ss, vd_sb, vd_sh, vd_ss;  // bytes
    int64_t ks_sb, ks_sh, ks_ss, vs_sb, vs_sh, vs_ss;  // halves
    int hq, hkv, group, hgroups, d, seq_len, chunk_len, nchunks, window;
    float scale, softcap;
    const int64_t* pos_dev;
    void* out;
    float* part_o;   // [B * Hq, nchunks, D] unnormalised outputs
    float* part_ml;  // [B * Hq, nchunks, 2] max and sum of each chunk
};

template <class KL, class VL, int NH, int DL>
__global__ void __launch_bounds__(kThreads) fd_chunk_kernel(FdParams p) {
    __shared__ __align__(16) float q_s[NH * kMaxDim];
    __shared__ __align__(16) float p_s[kWarps][NH][kTile];
    __shared__ __align__(16) float o_s[NH * kMaxDim];
    __shared__ float m_w[kWarps][NH], l_w[kWarps][NH], mb_s[NH], lb_s[NH];

    const int chunk = blockIdx.x;
    const int bkg = blockIdx.y;
    const int hg = bkg % p.hgroups;
    const int hk = (bkg / p.hgroups) % p.hkv;
    const int b = bkg / (p.hgroups * p.hkv);
    const int h0 = hk * p.group + hg * NH;
    const int nh = min(NH, p.group - hg * NH);
    const int d = p.d, groups = d / kGroup;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int seq = p.pos_dev ? static_cast<int>(min(static_cast<int64_t>(p.seq_len), *p.pos_dev + 1)) : p.seq_len;
    const int lo = p.window > 0 ? max(0, seq - p.window) : 0;
    const int c0 = max(chunk * p.chunk_len, lo), c1 = min(chunk * p.chunk_len + p.chunk_len, seq);

    // The query (zero for the heads past nh), rotated into the cache's space for a quantized K; nh * d and d are
    // multiples of 32, so each warp rotates whole groups.
    for (int i = tid; i < NH * d; i += kThreads) {
        const int h = i / d, e = i % d;
        float x = 0.0f;
        if (h < nh) {
            const int64_t at = b * p.q_sb + static_cast<int64_t>(h0 + h) * p.q_sh + e;
            x = p.q_f16 ? __half2float(static_cast<const half*>(p.q)[at]) : static_cast<const float*>(p.q)[at];
        }
        q_s[i] = KL::kQuant ? hadamard32(x, lane) : x;
    }
    __syncthreads();

    const uint8_t* kdb = p.kd + b * p.kd_sb + hk * p.kd_sh;
    const half* ksb = KL::kQuant ? p.ks + b * p.ks_sb + hk * p.ks_sh : nullptr;
    const uint8_t* vdb = p.vd + b * p.vd_sb + hk * p.vd_sh;
    const half* vsb = VL::kQuant ? p.vs + b * p.vs_sb + hk * p.vs_sh : nullptr;
    const int e0 = lane * DL;  // this lane's output dims
    const float4* q4 = reinterpret_cast<const float4*>(q_s);

    float m[NH], l[NH], acc[NH][DL];
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < DL; ++i) acc[h][i] = 0.0f;
    }

    for (int t0 = c0 + warp * kTile; t0 < c1; t0 += kWarps * kTile) {
        // Scores: lane = position (a position past c1 reads row c1 - 1 and scores -inf).
        const bool valid = t0 + lane < c1;
        const int64_t pos = min(t0 + lane, c1 - 1);
        const uint8_t* krow = kdb + pos * p.kd_ss;
        const half* ksrow = KL::kQuant ? ksb + pos * p.ks_ss : nullptr;
        float s[NH];
#pragma unroll
        for (int h = 0; h < NH; ++h) s[h] = 0.0f;
#pragma unroll 2
        for (int g = 0; g < groups; ++g) {
            float x[kGroup];
            const float f = KL::group(krow, ksrow, g, x);
#pragma unroll
            for (int h = 0; h < NH; ++h) {
                float part = 0.0f;
#pragma unroll
                for (int c = 0; c < kGroup / 4; ++c) {
                    const float4 qv = q4[(h * d + g * kGroup) / 4 + c];
                    part += qv.x * x[4 * c] + qv.y * x[4 * c + 1] + qv.z * x[4 * c + 2] + qv.w * x[4 * c + 3];
                }
                s[h] += f * part;
            }
        }
        // Online softmax per head over the tile; the sum stays per lane until the end.
#pragma unroll
        for (int h = 0; h < NH; ++h) {
            float x = s[h] * p.scale;
            if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
            x = valid ? x : -INFINITY;
            float mx = x;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m[h], mx);  // finite: lane 0's position is always valid
            const float alpha = __expf(m[h] - m_new);
            const float e = valid ? __expf(x - m_new) : 0.0f;
            m[h] = m_new;
            l[h] = l[h] * alpha + e;
#pragma unroll
            for (int i = 0; i < DL; ++i) acc[h][i] *= alpha;
            p_s[warp][h][lane] = e;
        }
        __syncwarp();
        // Values: all 32 rows of the tile (clamped as above, weight 0), this lane's DL dims of each.
        const int vlast = c1 - 1 - t0;
#pragma unroll
        for (int j4 = 0; j4 < kTile; j4 += 4) {
            float4 w4[NH];
#pragma unroll
            for (int h = 0; h < NH; ++h) w4[h] = *reinterpret_cast<const float4*>(&p_s[warp][h][j4]);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const int64_t vpos = t0 + min(j4 + jj, vlast);
                float v[DL];
                const float f = VL::template slice<DL>(vdb + vpos * p.vd_ss,
                                                       VL::kQuant ? vsb + vpos * p.vs_ss : nullptr, e0, v);
#pragma unroll
                for (int h = 0; h < NH; ++h) {
                    const float w = f * (jj == 0 ? w4[h].x : jj == 1 ? w4[h].y : jj == 2 ? w4[h].z : w4[h].w);
#pragma unroll
                    for (int i = 0; i < DL; ++i) acc[h][i] += w * v[i];
                }
            }
        }
        __syncwarp();
    }

    // Merge the warps: each scales its part to the block's max and adds it into o_s in turn (a fixed order, so a
    // replayed graph and an eager call give the same bits).
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        float lsum = l[h];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, off);
        if (lane == 0) {
            m_w[warp][h] = m[h];
            l_w[warp][h] = lsum;
        }
    }
    __syncthreads();
    if (tid < NH) {
        float mx = -INFINITY, sum = 0.0f;
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_w[w][tid]);
        for (int w = 0; w < kWarps; ++w)
            if (l_w[w][tid] > 0.0f) sum += l_w[w][tid] * __expf(m_w[w][tid] - mx);
        mb_s[tid] = mx;
        lb_s[tid] = sum;
    }
    __syncthreads();
    for (int w = 0; w < kWarps; ++w) {
        if (warp == w) {
#pragma unroll
            for (int h = 0; h < NH; ++h) {
                const float f = l_w[w][h] > 0.0f ? __expf(m[h] - mb_s[h]) : 0.0f;
#pragma unroll
                for (int i = 0; i < DL; ++i) {
                    float* o = &o_s[h * kMaxDim + e0 + i];
                    *o = (w == 0 ? 0.0f : *o) + f * acc[h][i];
                }
            }
        }
        __syncthreads();
    }

    for (int i = tid; i < nh * d; i += kThreads) {  // whole warps: nh * d is a multiple of 32
        const int h = i / d, e = i % d;
        const float o = o_s[h * kMaxDim + e];
        const int64_t bh = static_cast<int64_t>(b) * p.hq + h0 + h;
        if (p.nchunks == 1) {
            const float y = VL::kQuant ? hadamard32(o / lb_s[h], lane) : o / lb_s[h];
            if (p.out_f16) static_cast<half*>(p.out)[bh * d + e] = __float2half(y);
            else static_cast<float*>(p.out)[bh * d + e] = y;
        } else {
            p.part_o[(bh * p.nchunks + chunk) * d + e] = o;
            if (e == 0) {
                p.part_ml[(bh * p.nchunks + chunk) * 2] = mb_s[h];
                p.part_ml[(bh * p.nchunks + chunk) * 2 + 1] = lb_s[h];
            }
        }
    }
}

// One block per (b, query head): out = sum_i o_i e^(m_i - M) / sum_i l_i e^(m_i - M) over the chunks with l > 0,
// rotated back by H for a quantized V. Whole warps and d a multiple of 32, so every warp holds whole groups.
__global__ void fd_reduce_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml, int nchunks,
                                 int d, int rotate, void* __restrict__ out, int out_f16) {
    const int64_t bh = blockIdx.x;
    const float* ml = part_ml + bh * nchunks * 2;
    float mx = -INFINITY;
    for (int i = 0; i < nchunks; ++i)
        if (ml[2 * i + 1] > 0.0f) mx = fmaxf(mx, ml[2 * i]);
    float total = 0.0f;
    for (int i = 0; i < nchunks; ++i)
        if (ml[2 * i + 1] > 0.0f) total += ml[2 * i + 1] * __expf(ml[2 * i] - mx);
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float o = 0.0f;
        for (int i = 0; i < nchunks; ++i)
            if (ml[2 * i + 1] > 0.0f) o += part_o[(bh * nchunks + i) * d + e] * __expf(ml[2 * i] - mx);
        const float y = rotate ? hadamard32(o / total, threadIdx.x % 32) : o / total;
        if (out_f16) static_cast<half*>(out)[bh * d + e] = __float2half(y);
        else static_cast<float*>(out)[bh * d + e] = y;
    }
}

enum LoadKind { kF16, kQ8, kQ4 };
using ChunkKernel = void (*)(FdParams);

// The instance for a head_dim of 32 * DL, with how many of its blocks one SM holds (asked once per instance).
template <class KL, class VL, int NH>
ChunkKernel pick_dl(int d, int* per_sm) {
    ChunkKernel k = d == 64 ? fd_chunk_kernel<KL, VL, NH, 2> : d == 128 ? fd_chunk_kernel<KL, VL, NH, 4>
                                                                        : fd_chunk_kernel<KL, VL, NH, 8>;
    static int occ[3] = {0, 0, 0};
    int& o = occ[d == 64 ? 0 : d == 128 ? 1 : 2];
    if (o == 0) {
        int n = 1;
        KB_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, kThreads, 0));
        o = std::max(n, 1);
    }
    *per_sm = o;
    return k;
}

template <class KL, class VL>
ChunkKernel pick_nh(int nh, int d, int* per_sm) {
    if (nh == 1) return pick_dl<KL, VL, 1>(d, per_sm);
    if (nh == 2) return pick_dl<KL, VL, 2>(d, per_sm);
    if (nh == 4) return pick_dl<KL, VL, 4>(d, per_sm);
    return pick_dl<KL, VL, 8>(d, per_sm);
}

ChunkKernel pick(LoadKind k, LoadKind v, int nh, int d, int* per_sm) {
    if (k == kF16) return pick_nh<F16Load, F16Load>(nh, d, per_sm);
    if (k == kQ8 && v == kQ8) return pick_nh<Q8Load, Q8Load>(nh, d, per_sm);
    if (k == kQ8) return pick_nh<Q8Load, Q4Load>(nh, d, per_sm);
    return pick_nh<Q4Load, Q4Load>(nh, d, per_sm);
}

// Query heads per block: the whole group up to 8, else groups of 8.
int heads_per_block(int64_t group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }

int64_t base_blocks_of(int64_t b, int64_t hq, int64_t hkv) {
    const int64_t group = hq / hkv, nh = heads_per_block(group);
    return b * hkv * ((group + nh - 1) / nh);
}

bool fd_shape_ok(int64_t d, const void* kd, const void* vd, const int64_t* strides, int n) {
    if (!(d == 64 || d == 128 || d == 256) || !aligned(kd, 16) || !aligned(vd, 16)) return false;
    for (int i = 0; i < n; ++i)
        if (strides[i] % 16) return false;
    return true;
}

// Chunks of >= kMinChunk positions (a multiple of the tile), as many as one wave of resident blocks takes: every
// block then streams its chunk once and no second, partly filled wave follows.
void plan(FdParams& p, int64_t b, int64_t hq, int64_t base_blocks, int64_t wave, const Workspace& ws) {
    const int64_t seq_len = p.seq_len;
    const int64_t max_chunks = (seq_len + kMinChunk - 1) / kMinChunk;
    int64_t nchunks = std::min<int64_t>(max_chunks, std::max<int64_t>(1, wave / base_blocks));
    if (nchunks > 1) {
        const int64_t fit = ws.data ? ws.floats / (b * hq * (p.d + 2)) : 0;
        nchunks = std::max<int64_t>(1, std::min(nchunks, fit));
    }
    int64_t chunk_len = (seq_len + nchunks - 1) / nchunks;
    chunk_len = (chunk_len + kTile - 1) / kTile * kTile;
    nchunks = (seq_len + chunk_len - 1) / chunk_len;
    p.chunk_len = static_cast<int>(chunk_len);
    p.nchunks = static_cast<int>(nchunks);
    p.part_o = ws.data;
    p.part_ml = ws.data ? ws.data + b * hq * nchunks * p.d : nullptr;
}

void run(FdParams& p, LoadKind k, LoadKind v, int64_t b, int64_t hq, int64_t hkv, const Workspace& ws, int device,
         cudaStream_t stream) {
    const int64_t group = hq / hkv;
    const int nh = heads_per_block(group);
    const int64_t hgroups = (group + nh - 1) / nh;
    p.hq = static_cast<int>(hq);
    p.hkv = static_cast<int>(hkv);
    p.group = static_cast<int>(group);
    p.hgroups = static_cast<int>(hgroups);
    const int64_t base_blocks = b * hkv * hgroups;
    int per_sm = 1;
    const ChunkKernel kernel = pick(k, v, nh, p.d, &per_sm);
    plan(p, b, hq, base_blocks, static_cast<int64_t>(per_sm) * sm_count(device), ws);
    const dim3 grid(static_cast<unsigned>(p.nchunks), static_cast<unsigned>(base_blocks));
    kernel<<<grid, kThreads, 0, stream>>>(p);
    KB_CHECK_LAUNCH();
    if (p.nchunks > 1) {
        const int threads = static_cast<int>(std::min(256, p.d));
        fd_reduce_kernel<<<static_cast<unsigned>(b * hq), threads, 0, stream>>>(
            p.part_o, p.part_ml, p.nchunks, p.d, v != kF16, p.out, p.out_f16);
        KB_CHECK_LAUNCH();
    }
}

}  // namespace

bool legacy_attention() {
    const char* v = std::getenv("KOBOLD_BACKEND_ATTN");
    return v != nullptr && std::strcmp(v, "legacy") == 0;
}

bool flash_decode(const AttnArgs& a) {
    const int64_t strides[6] = {a.kc_sb * 2, a.kc_sh * 2, a.kc_ss * 2, a.vc_sb * 2, a.vc_sh * 2, a.vc_ss * 2};
    if (!fd_shape_ok(a.d, a.k_cache, a.v_cache, strides, 6) || base_blocks_of(a.b, a.hq, a.hkv) > 65535) return false;
    FdParams p{};
    p.q = a.q;
    p.q_f16 = 1;
    p.out_f16 = 1;
    p.q_sb = a.q_sb;
    p.q_sh = a.q_sh;
    p.kd = static_cast<const uint8_t*>(a.k_cache);
    p.vd = static_cast<const uint8_t*>(a.v_cache);
    p.kd_sb = strides[0]; p.kd_sh = strides[1]; p.kd_ss = strides[2];
    p.vd_sb = strides[3]; p.vd_sh = strides[4]; p.vd_ss = strides[5];
    p.d = static_cast<int>(a.d);
    p.seq_len = static_cast<int>(a.seq_len);
    p.scale = a.scale;
    p.pos_dev = a.pos_dev;
    p.out = a.out;
    run(p, kF16, kF16, a.b, a.hq, a.hkv, a.ws, a.device, as_stream(a.stream));
    return true;
}

bool flash_decode(const KvqAttnArgs& a) {
    const int64_t strides[6] = {a.kd_sb, a.kd_sh, a.kd_ss, a.vd_sb, a.vd_sh, a.vd_ss};
    if (!fd_shape_ok(a.d, a.kd, a.vd, strides, 6) || (a.k_bits == 4 && a.v_bits == 8) ||
        base_blocks_of(a.b, a.hq, a.hkv) > 65535)
        return false;
    FdParams p{};
    p.q = a.q;
    p.q_f16 = a.q_f16;
    p.out_f16 = a.out_f16;
    p.q_sb = a.q_sb;
    p.q_sh = a.q_sh;
    p.kd = static_cast<const uint8_t*>(a.kd);
    p.ks = static_cast<const half*>(a.ks);
    p.vd = static_cast<const uint8_t*>(a.vd);
    p.vs = static_cast<const half*>(a.vs);
    p.kd_sb = a.kd_sb; p.kd_sh = a.kd_sh; p.kd_ss = a.kd_ss;
    p.vd_sb = a.vd_sb; p.vd_sh = a.vd_sh; p.vd_ss = a.vd_ss;
    p.ks_sb = a.ks_sb; p.ks_sh = a.ks_sh; p.ks_ss = a.ks_ss;
    p.vs_sb = a.vs_sb; p.vs_sh = a.vs_sh; p.vs_ss = a.vs_ss;
    p.d = static_cast<int>(a.d);
    p.seq_len = static_cast<int>(a.seq_len);
    p.window = static_cast<int>(std::min<int64_t>(a.window, a.seq_len));
    p.scale = a.scale;
    p.softcap = a.softcap;
    p.pos_dev = a.pos_dev;
    p.out = a.out;
    run(p, a.k_bits == 8 ? kQ8 : kQ4, a.v_bits == 8 ? kQ8 : kQ4, a.b, a.hq, a.hkv, a.ws, a.device,
        as_stream(a.stream));
    return true;
}

}  // namespace cuda
}  // namespace kb
