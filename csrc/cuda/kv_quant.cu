// The 8/4-bit KV cache (kobold_backend/ops/kv_quant.py has the layout and the torch definitions):
//  - kvq_rope_write: RoPE on q and k, then k and v rotated by the group Hadamard matrix and quantized into the
//    cache at pos.. (host) or *pos_dev (CUDA graphs); one warp per group of 32 values, the Hadamard transform a
//    butterfly over shuffles.
//  - kvq_decode_attention: one query row against the integers, dequantized in registers, never written back.
//    Same plan as attention.cu (flash-decoding: sequence chunks, one block per KV head and up to 8 of its query
//    heads, an online softmax, a merge pass); the query is rotated into the cache's space in shared memory and the
//    output rotated back before it is written (H is its own inverse). flash_decode.cu's templated body serves the
//    shapes it takes first; this kernel is the fallback for the others and, with KOBOLD_BACKEND_ATTN=legacy, the
//    previous kernel for a same-run comparison.
#include <algorithm>

#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kHeads = 8;       // query heads per block
constexpr int kTile = 256;      // positions scored per step
constexpr int kMaxDim = 256;
constexpr int kGroup = 32;      // values per scale
constexpr int kMinChunk = 256;
constexpr float kHadamardNorm = 0.17677669529663687f;  // 1 / sqrt(32)

// The orthonormal Sylvester-Hadamard transform of the 32 values a full warp holds (one per lane).
__device__ __forceinline__ float hadamard32(float x, int lane) {
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, x, m);
        x = (lane & m) ? y - x : x + y;
    }
    return x * kHadamardNorm;
}

struct QParams {
    const void* q;
    int q_f16, out_f16;  // query / output dtype: float16, else float32
    int64_t q_sb, q_sh;
    const uint8_t* kd;
    const half* ks;
    const uint8_t* vd;
    const half* vs;
    int64_t kd_sb, kd_sh, kd_ss, ks_sb, ks_sh, ks_ss, vd_sb, vd_sh, vd_ss, vs_sb, vs_sh, vs_ss;
    int hq, hkv, group, hgroups, d, seq_len, chunk_len, nchunks, window;
    float scale, softcap;
    const int64_t* pos_dev;
    void* out;
    float* part_o;
    float* part_ml;
};

// Eight consecutive values of a K row (stored integers, before the group scale).
template <int BITS>
__device__ __forceinline__ void load8(const uint8_t* row, int e0, float (&k)[8]) {
    if (BITS == 8) {
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(row + e0));
        const int8_t* b = reinterpret_cast<const int8_t*>(&raw);
#pragma unroll
        for (int e = 0; e < 8; ++e) k[e] = static_cast<float>(b[e]);
    } else {
        const uint32_t w = __ldg(reinterpret_cast<const uint32_t*>(row + e0 / 2));
#pragma unroll
        for (int e = 0; e < 8; ++e) k[e] = static_cast<float>(static_cast<int>((w >> (4 * e)) & 15u) - 8);
    }
}

// Values 2p and 2p + 1 of a V row (stored integers).
template <int BITS>
__device__ __forceinline__ float2 load2(const uint8_t* row, int p) {
    if (BITS == 8) {
        const char2 c = __ldg(reinterpret_cast<const char2*>(row) + p);
        return make_float2(static_cast<float>(c.x), static_cast<float>(c.y));
    }
    const uint8_t b = __ldg(row + p);
    return make_float2(static_cast<float>(static_cast<int>(b & 15u) - 8), static_cast<float>(static_cast<int>(b >> 4) - 8));
}

template <int KBITS, int VBITS>
__global__ void __launch_bounds__(kThreads) kvq_chunk_kernel(QParams p) {
    __shared__ float4 q_s4[kHeads * kMaxDim / 4];
    __shared__ float sc[kHeads * kTile];
    __shared__ float m_s[kHeads], l_s[kHeads], alpha_s[kHeads];
    float* q_s = reinterpret_cast<float*>(q_s4);

    const int chunk = blockIdx.x;
    const int bkg = blockIdx.y;
    const int hg = bkg % p.hgroups;
    const int hk = (bkg / p.hgroups) % p.hkv;
    const int b = bkg / (p.hgroups * p.hkv);
    const int h0 = hk * p.group + hg * kHeads;
    const int nh = min(kHeads, p.group - hg * kHeads);
    const int d = p.d, groups = d / kGroup, pairs = d / 2;
    const int seq = p.pos_dev ? static_cast<int>(min(static_cast<int64_t>(p.seq_len), *p.pos_dev + 1)) : p.seq_len;
    // A sliding window hides the positions before seq - window (the chunks there stay empty: l = 0).
    const int lo = p.window > 0 ? max(0, seq - p.window) : 0;
    const int c0 = max(chunk * p.chunk_len, lo), c1 = min(chunk * p.chunk_len + p.chunk_len, seq);
    const int tid = threadIdx.x;

    for (int i = tid; i < nh * d; i += kThreads) {
        const int h = i / d, e = i % d;
        const int64_t at = b * p.q_sb + static_cast<int64_t>(h0 + h) * p.q_sh + e;
        q_s[h * d + e] = p.q_f16 ? __half2float(static_cast<const half*>(p.q)[at]) : static_cast<const float*>(p.q)[at];
    }
    __syncthreads();
    // Into the cache's rotated space: nh * d is a multiple of 32, so each warp holds whole groups.
    for (int i = tid; i < nh * d; i += kThreads) q_s[i] = hadamard32(q_s[i], tid % 32);
    if (tid < kHeads) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
    }
    const uint8_t* kdb = p.kd + b * p.kd_sb + hk * p.kd_sh;
    const half* ksb = p.ks + b * p.ks_sb + hk * p.ks_sh;
    const uint8_t* vdb = p.vd + b * p.vd_sb + hk * p.vd_sh;
    const half* vsb = p.vs + b * p.vs_sb + hk * p.vs_sh;

    const int nph = kThreads / pairs;
    const int ph = tid / pairs, dp = tid % pairs;
    const bool out_active = ph < nph;
    float2 acc[kHeads];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) acc[h] = make_float2(0.0f, 0.0f);
    __syncthreads();

    for (int ts = c0; ts < c1; ts += kTile) {
        const int tn = min(kTile, c1 - ts);
        for (int pi = tid; pi < tn; pi += kThreads) {
            const int64_t pos = ts + pi;
            const uint8_t* krow = kdb + pos * p.kd_ss;
            const half* srow = ksb + pos * p.ks_ss;
            float dot[kHeads];
#pragma unroll
            for (int h = 0; h < kHeads; ++h) dot[h] = 0.0f;
            for (int g = 0; g < groups; ++g) {
                const float s = __half2float(srow[g]);
                float part[kHeads];
#pragma unroll
                for (int h = 0; h < kHeads; ++h) part[h] = 0.0f;
#pragma unroll
                for (int c = 0; c < kGroup / 8; ++c) {
                    const int e0 = g * kGroup + c * 8;
                    float kf[8];
                    load8<KBITS>(krow, e0, kf);
#pragma unroll
                    for (int h = 0; h < kHeads; ++h) {
                        if (h < nh) {
                            const float4 qa = q_s4[(h * d + e0) / 4], qb = q_s4[(h * d + e0) / 4 + 1];
                            part[h] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] +
                                       qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                        }
                    }
                }
#pragma unroll
                for (int h = 0; h < kHeads; ++h) dot[h] += s * part[h];
            }
#pragma unroll
            for (int h = 0; h < kHeads; ++h) {
                if (h < nh) {
                    const float x = dot[h] * p.scale;
                    sc[h * kTile + pi] = p.softcap > 0.0f ? p.softcap * tanhf(x / p.softcap) : x;
                }
            }
        }
        __syncthreads();

        const int warp = tid / 32, lane = tid % 32;
        for (int h = warp; h < nh; h += kThreads / 32) {
            float mx = -INFINITY;
            for (int i = lane; i < tn; i += 32) mx = fmaxf(mx, sc[h * kTile + i]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_old = m_s[h];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (int i = lane; i < tn; i += 32) {
                const float e = expf(sc[h * kTile + i] - m_new);
                sc[h * kTile + i] = e;
                sum += e;
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            __syncwarp();
            if (lane == 0) {
                const float alpha = expf(m_old - m_new);
                alpha_s[h] = alpha;
                l_s[h] = l_s[h] * alpha + sum;
                m_s[h] = m_new;
            }
        }
        __syncthreads();

        if (out_active) {
#pragma unroll
            for (int h = 0; h < kHeads; ++h) {
                if (h < nh) {
                    acc[h].x *= alpha_s[h];
                    acc[h].y *= alpha_s[h];
                }
            }
            const int vg = (2 * dp) / kGroup;
            for (int pi = ph; pi < tn; pi += nph) {
                const int64_t pos = ts + pi;
                const float s = __half2float(vsb[pos * p.vs_ss + vg]);
                float2 v = load2<VBITS>(vdb + pos * p.vd_ss, dp);
                v.x *= s;
                v.y *= s;
#pragma unroll
                for (int h = 0; h < kHeads; ++h) {
                    if (h < nh) {
                        const float w = sc[h * kTile + pi];
                        acc[h].x += w * v.x;
                        acc[h].y += w * v.y;
                    }
                }
            }
        }
        __syncthreads();
    }

    float* red = sc;  // [nph][kHeads][d] floats
    if (out_active) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
            if (h < nh) {
                red[(ph * kHeads + h) * d + 2 * dp] = acc[h].x;
                red[(ph * kHeads + h) * d + 2 * dp + 1] = acc[h].y;
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < nh * d; i += kThreads) {
        const int h = i / d, e = i % d;
        float o = 0.0f;
        for (int r = 0; r < nph; ++r) o += red[(r * kHeads + h) * d + e];
        const int64_t bh = static_cast<int64_t>(b) * p.hq + h0 + h;
        if (p.nchunks == 1) {
            const float y = hadamard32(o / l_s[h], tid % 32);
            if (p.out_f16) static_cast<half*>(p.out)[bh * d + e] = __float2half(y);
            else static_cast<float*>(p.out)[bh * d + e] = y;
        } else {
            p.part_o[(bh * p.nchunks + chunk) * d + e] = o;
            if (e == 0) {
                p.part_ml[(bh * p.nchunks + chunk) * 2] = m_s[h];
                p.part_ml[(bh * p.nchunks + chunk) * 2 + 1] = l_s[h];
            }
        }
    }
}

// One block per (b, query head): out = H (sum_i o_i e^(m_i - M) / sum_i l_i e^(m_i - M)); empty chunks have
// l = 0. The block is a whole number of warps and d a multiple of 32, so every warp holds whole groups.
__global__ void kvq_reduce_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml, int nchunks,
                                  int d, void* __restrict__ out, int out_f16) {
    const int64_t bh = blockIdx.x;
    const float* ml = part_ml + bh * nchunks * 2;
    float mx = -INFINITY;
    for (int i = 0; i < nchunks; ++i)
        if (ml[2 * i + 1] > 0.0f) mx = fmaxf(mx, ml[2 * i]);
    float total = 0.0f;
    for (int i = 0; i < nchunks; ++i)
        if (ml[2 * i + 1] > 0.0f) total += ml[2 * i + 1] * expf(ml[2 * i] - mx);
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float o = 0.0f;
        for (int i = 0; i < nchunks; ++i)
            if (ml[2 * i + 1] > 0.0f) o += part_o[(bh * nchunks + i) * d + e] * expf(ml[2 * i] - mx);
        const float y = hadamard32(o / total, threadIdx.x % 32);
        if (out_f16) static_cast<half*>(out)[bh * d + e] = __float2half(y);
        else static_cast<float*>(out)[bh * d + e] = y;
    }
}

__device__ __forceinline__ float cs_at(const void* t, int cs_f16, int64_t i) {
    return cs_f16 ? __half2float(static_cast<const half*>(t)[i]) : static_cast<const float*>(t)[i];
}

// One warp per (b, t, head, group of 32) over Hq query heads, then Hkv key heads, then Hkv value heads.
__global__ void __launch_bounds__(kThreads) kvq_write_kernel(KvqWriteArgs a) {
    const int lane = threadIdx.x % 32;
    const int64_t groups = a.d / kGroup;
    const int64_t heads = a.hq + 2 * a.hkv;
    const int64_t item = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
    if (item >= a.b * a.t * heads * groups) return;  // whole warps leave together
    const int64_t g = item % groups, h = (item / groups) % heads, bt = item / (groups * heads);
    const int64_t t = bt % a.t, b = bt / a.t;
    const int64_t p = (a.pos_dev ? *a.pos_dev : a.pos) + t;
    if (p < 0 || p >= a.max_pos) return;
    const int64_t e = g * kGroup + lane, half_d = a.d / 2;
    const int64_t pair = e < half_d ? e + half_d : e - half_d;
    const float sign = e < half_d ? -1.0f : 1.0f;  // rotate_half: (-x[D/2:], x[:D/2])
    const int cs16 = a.cs_dtype == F16;
    if (h < a.hq) {
        const half* src = static_cast<const half*>(a.q) + b * a.q_sb + t * a.q_st + h * a.q_sh;
        const float y = __half2float(src[e]) * cs_at(a.cos, cs16, p * a.cos_stride + e) +
                        sign * __half2float(src[pair]) * cs_at(a.sin, cs16, p * a.sin_stride + e);
        static_cast<half*>(a.q_out)[((b * a.t + t) * a.hq + h) * a.d + e] = __float2half(y);
        return;
    }
    const bool is_k = h < a.hq + a.hkv;
    const int64_t hk = is_k ? h - a.hq : h - a.hq - a.hkv;
    float x;
    if (is_k) {
        const half* src = static_cast<const half*>(a.k) + b * a.k_sb + t * a.k_st + hk * a.k_sh;
        const float y = __half2float(src[e]) * cs_at(a.cos, cs16, p * a.cos_stride + e) +
                        sign * __half2float(src[pair]) * cs_at(a.sin, cs16, p * a.sin_stride + e);
        x = __half2float(__float2half(y));  // the rotated key in the model's dtype, as the torch path stores it
    } else {
        x = __half2float((static_cast<const half*>(a.v) + b * a.v_sb + t * a.v_st + hk * a.v_sh)[e]);
    }
    x = hadamard32(x, lane);
    float amax = fabsf(x);
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    const int bits = is_k ? a.k_bits : a.v_bits;
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const half scale = __float2half(amax / qmax);
    const float s = __half2float(scale);
    const float q = s > 0.0f ? fminf(fmaxf(rintf(x / s), -qmax), qmax) : 0.0f;
    uint8_t* data = static_cast<uint8_t*>(is_k ? a.kd : a.vd) +
                    b * (is_k ? a.kd_sb : a.vd_sb) + hk * (is_k ? a.kd_sh : a.vd_sh) + p * (is_k ? a.kd_ss : a.vd_ss);
    half* scales = static_cast<half*>(is_k ? a.ks : a.vs) +
                   b * (is_k ? a.ks_sb : a.vs_sb) + hk * (is_k ? a.ks_sh : a.vs_sh) + p * (is_k ? a.ks_ss : a.vs_ss);
    const int qi = static_cast<int>(q);
    if (bits == 8) {
        data[e] = static_cast<uint8_t>(static_cast<int8_t>(qi));
    } else {
        const int n = qi + 8;
        const int hi = __shfl_down_sync(0xffffffffu, n, 1);
        if ((lane & 1) == 0) data[e / 2] = static_cast<uint8_t>(n | (hi << 4));
    }
    if (lane == 0) scales[g] = scale;
}

template <int KBITS, int VBITS>
void launch(const dim3& grid, cudaStream_t stream, const QParams& p) {
    kvq_chunk_kernel<KBITS, VBITS><<<grid, kThreads, 0, stream>>>(p);
}

}  // namespace

void kvq_rope_write(const KvqWriteArgs& a) {
    require(a.d >= kGroup && a.d % kGroup == 0, "kvq_rope_write needs head_dim a multiple of 32");
    require(a.cs_dtype == F16 || a.cs_dtype == F32, "kvq_rope_write: cos/sin must be float16 or float32");
    require((a.k_bits == 8 || a.k_bits == 4) && (a.v_bits == 8 || a.v_bits == 4),
            "kvq_rope_write: K and V must be 8- or 4-bit");
    const int64_t warps = a.b * a.t * (a.hq + 2 * a.hkv) * (a.d / kGroup);
    if (warps == 0) return;
    const int64_t blocks = (warps + kThreads / 32 - 1) / (kThreads / 32);
    require(blocks <= 2147483647LL, "kvq_rope_write: too many heads x tokens for one launch");
    use_device(a.device);
    kvq_write_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, as_stream(a.stream)>>>(a);
    KB_CHECK_LAUNCH();
}

void kvq_decode_attention(const KvqAttnArgs& a) {
    require(a.hkv >= 1 && a.hq >= a.hkv && a.hq % a.hkv == 0,
            "kvq_decode_attention: query heads must be a multiple of KV heads");
    require(a.d >= kGroup && a.d <= kMaxDim && a.d % kGroup == 0,
            "kvq_decode_attention needs head_dim a multiple of 32, <= 256");
    require((a.k_bits == 8 || a.k_bits == 4) && (a.v_bits == 8 || a.v_bits == 4),
            "kvq_decode_attention: K and V must be 8- or 4-bit");
    require(a.seq_len >= 1 && a.seq_len < (1LL << 31), "kvq_decode_attention needs 1 <= seq_len < 2^31");
    require(a.window >= 0 && a.softcap >= 0.0f, "kvq_decode_attention: window and softcap must be >= 0 (0: none)");
    const int64_t kalign = a.k_bits == 8 ? 8 : 4;
    require(aligned(a.kd, kalign) && a.kd_ss % kalign == 0 && a.kd_sh % kalign == 0 && a.kd_sb % kalign == 0 &&
                aligned(a.vd, 2) && a.vd_ss % 2 == 0 && a.vd_sh % 2 == 0 && a.vd_sb % 2 == 0,
            "kvq_decode_attention needs 8-byte (q8) or 4-byte (q4) aligned K rows and 2-byte aligned V rows");
    if (a.b == 0) return;
    use_device(a.device);
    if (!legacy_attention() && flash_decode(a)) return;
    const int64_t group = a.hq / a.hkv;
    const int64_t hgroups = (group + kHeads - 1) / kHeads;
    const int64_t base_blocks = a.b * a.hkv * hgroups;
    require(base_blocks <= 65535, "kvq_decode_attention: batch x KV heads too large for one launch");
    const int64_t max_chunks = (a.seq_len + kMinChunk - 1) / kMinChunk;
    int64_t nchunks = std::min<int64_t>(
        max_chunks, std::max<int64_t>(1, (4LL * sm_count(a.device) + base_blocks - 1) / base_blocks));
    if (nchunks > 1) {
        const int64_t fit = a.ws.data ? a.ws.floats / (a.b * a.hq * (a.d + 2)) : 0;
        nchunks = std::max<int64_t>(1, std::min(nchunks, fit));
    }
    const int64_t chunk_len = (a.seq_len + nchunks - 1) / nchunks;
    nchunks = (a.seq_len + chunk_len - 1) / chunk_len;

    QParams p;
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
    p.ks_sb = a.ks_sb; p.ks_sh = a.ks_sh; p.ks_ss = a.ks_ss;
    p.vd_sb = a.vd_sb; p.vd_sh = a.vd_sh; p.vd_ss = a.vd_ss;
    p.vs_sb = a.vs_sb; p.vs_sh = a.vs_sh; p.vs_ss = a.vs_ss;
    p.hq = static_cast<int>(a.hq);
    p.hkv = static_cast<int>(a.hkv);
    p.group = static_cast<int>(group);
    p.hgroups = static_cast<int>(hgroups);
    p.d = static_cast<int>(a.d);
    p.seq_len = static_cast<int>(a.seq_len);
    p.chunk_len = static_cast<int>(chunk_len);
    p.nchunks = static_cast<int>(nchunks);
    p.scale = a.scale;
    p.window = static_cast<int>(std::min<int64_t>(a.window, a.seq_len));
    p.softcap = a.softcap;
    p.pos_dev = a.pos_dev;
    p.out = a.out;
    p.part_o = a.ws.data;
    p.part_ml = a.ws.data ? a.ws.data + a.b * a.hq * nchunks * a.d : nullptr;
    const dim3 grid(static_cast<unsigned>(nchunks), static_cast<unsigned>(base_blocks));
    const cudaStream_t stream = as_stream(a.stream);
    if (a.k_bits == 8 && a.v_bits == 8) launch<8, 8>(grid, stream, p);
    else if (a.k_bits == 8) launch<8, 4>(grid, stream, p);
    else if (a.v_bits == 8) launch<4, 8>(grid, stream, p);
    else launch<4, 4>(grid, stream, p);
    KB_CHECK_LAUNCH();
    if (nchunks > 1) {
        const int threads = static_cast<int>(std::min<int64_t>(256, (a.d + 31) / 32 * 32));
        kvq_reduce_kernel<<<static_cast<unsigned>(a.b * a.hq), threads, 0, stream>>>(p.part_o, p.part_ml,
                                                                                       p.nchunks, p.d, p.out,
                                                                                       p.out_f16);
        KB_CHECK_LAUNCH();
    }
}

}  // namespace cuda
}  // namespace kb
