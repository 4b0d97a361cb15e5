// Decode attention (one query row per sequence) over the preallocated fp16 KV cache, flash-decoding style:
// the sequence is split into chunks, each block handles one KV head with up to 8 of its query heads (GQA
// reads K/V once per group) and one chunk with an online softmax; a second pass merges the chunks.
// flash_decode.cu's templated body serves the shapes it takes first; this kernel is the fallback for the others and,
// with KOBOLD_BACKEND_ATTN=legacy, the previous kernel for a same-run comparison.
#include <algorithm>

#include "kb_cuda.cuh"
#include "ops_cuda.h"

namespace kb {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kHeads = 8;        // query heads per block
constexpr int kTile = 256;       // positions scored per step (2 per thread)
constexpr int kMaxDim = 256;
constexpr int kMinChunk = 256;   // shorter sequences run as one chunk in one launch

struct ChunkParams {
    const half* q;
    int64_t q_sb, q_sh;
    const half* kc;
    const half* vc;
    int64_t kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss;
    int hq, hkv, group, hgroups, d, seq_len, chunk_len, nchunks;
    float scale;
    const int64_t* pos_dev;
    half* out;      // used when nchunks == 1
    float* part_o;  // [B * Hq, nchunks, D] unnormalised outputs
    float* part_ml; // [B * Hq, nchunks, 2] running max and sum of each chunk
};

__global__ void __launch_bounds__(kThreads) attn_chunk_kernel(ChunkParams p) {
    __shared__ float4 q_s4[kHeads * kMaxDim / 4];
    __shared__ float sc[kHeads * kTile];
    __shared__ float m_s[kHeads], l_s[kHeads], alpha_s[kHeads];
    float* q_s = reinterpret_cast<float*>(q_s4);

    const int chunk = blockIdx.x;
    const int bkg = blockIdx.y;  // (b, kv head, head group)
    const int hg = bkg % p.hgroups;
    const int hk = (bkg / p.hgroups) % p.hkv;
    const int b = bkg / (p.hgroups * p.hkv);
    const int h0 = hk * p.group + hg * kHeads;
    const int nh = min(kHeads, p.group - hg * kHeads);
    const int d = p.d, d8 = d / 8, pairs = d / 2;
    // With a device-side position, positions after it are masked (the chunk plan stays fixed for graphs).
    const int seq = p.pos_dev ? static_cast<int>(min(static_cast<int64_t>(p.seq_len), *p.pos_dev + 1)) : p.seq_len;
    const int c0 = chunk * p.chunk_len, c1 = min(c0 + p.chunk_len, seq);  // c0 >= c1: empty chunk, l = 0
    const int tid = threadIdx.x;

    for (int i = tid; i < nh * d; i += kThreads) {
        const int h = i / d, e = i % d;
        q_s[h * d + e] = __half2float(p.q[b * p.q_sb + static_cast<int64_t>(h0 + h) * p.q_sh + e]);
    }
    if (tid < kHeads) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
    }
    const half* kbase = p.kc + b * p.kc_sb + hk * p.kc_sh;
    const half* vbase = p.vc + b * p.vc_sb + hk * p.vc_sh;

    // Output layout: thread = (phase, pair of dims); phases split the positions of a tile.
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
            const uint4* kr = reinterpret_cast<const uint4*>(kbase + static_cast<int64_t>(ts + pi) * p.kc_ss);
            float dot[kHeads];
#pragma unroll
            for (int h = 0; h < kHeads; ++h) dot[h] = 0.0f;
#pragma unroll 4
            for (int c = 0; c < d8; ++c) {
                const uint4 raw = __ldg(kr + c);
                const half2* kh = reinterpret_cast<const half2*>(&raw);
                float kf[8];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = __half22float2(kh[e]);
                    kf[2 * e] = f.x;
                    kf[2 * e + 1] = f.y;
                }
#pragma unroll
                for (int h = 0; h < kHeads; ++h) {
                    if (h < nh) {
                        const float4 qa = q_s4[(h * d + 8 * c) / 4], qb = q_s4[(h * d + 8 * c) / 4 + 1];
                        dot[h] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] +
                                  qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < kHeads; ++h)
                if (h < nh) sc[h * kTile + pi] = dot[h] * p.scale;
        }
        __syncthreads();

        // Online softmax per head: warp w updates heads w and w + 4.
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
                const float alpha = expf(m_old - m_new);  // 0 on the first tile (m_old = -inf)
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
            const half2* vcol = reinterpret_cast<const half2*>(vbase) + dp;
#pragma unroll 4
            for (int pi = ph; pi < tn; pi += nph) {
                const float2 v = __half22float2(vcol[static_cast<int64_t>(ts + pi) * (p.vc_ss / 2)]);
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

    // Sum the phases (reusing the score buffer), then write this chunk's result.
    float* red = sc;  // [nph][kHeads][d] floats; nph * d <= 256
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
        for (int q = 0; q < nph; ++q) o += red[(q * kHeads + h) * d + e];
        const int64_t bh = static_cast<int64_t>(b) * p.hq + h0 + h;
        if (p.nchunks == 1) {
            p.out[bh * d + e] = __float2half(o / l_s[h]);
        } else {
            p.part_o[(bh * p.nchunks + chunk) * d + e] = o;
            if (e == 0) {
                p.part_ml[(bh * p.nchunks + chunk) * 2] = m_s[h];
                p.part_ml[(bh * p.nchunks + chunk) * 2 + 1] = l_s[h];
            }
        }
    }
}

// One block per (b, query head): out = sum_i o_i e^(m_i - M) / sum_i l_i e^(m_i - M).
__global__ void attn_reduce_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml, int nchunks,
                                   int d, half* __restrict__ out) {
    const int64_t bh = blockIdx.x;
    const float* ml = part_ml + bh * nchunks * 2;
    float mx = -INFINITY;
    for (int i = 0; i < nchunks; ++i) mx = fmaxf(mx, ml[2 * i]);
    float total = 0.0f;
    for (int i = 0; i < nchunks; ++i) total += ml[2 * i + 1] * expf(ml[2 * i] - mx);
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float o = 0.0f;
        for (int i = 0; i < nchunks; ++i) o += part_o[(bh * nchunks + i) * d + e] * expf(ml[2 * i] - mx);
        out[bh * d + e] = __float2half(o / total);
    }
}

}  // namespace

void decode_attention(const AttnArgs& a) {
    require(a.hkv >= 1 && a.hq >= a.hkv && a.hq % a.hkv == 0,
            "decode_attention: query heads must be a multiple of KV heads");
    require(a.d >= 8 && a.d <= kMaxDim && a.d % 8 == 0, "decode_attention needs head_dim a multiple of 8, <= 256");
    require(a.seq_len >= 1 && a.seq_len < (1LL << 31), "decode_attention needs 1 <= seq_len < 2^31");
    require(a.kc_ss % 8 == 0 && a.vc_ss % 2 == 0 && aligned(a.k_cache, 16) && aligned(a.v_cache, 4) &&
                a.kc_sb % 8 == 0 && a.kc_sh % 8 == 0 && a.vc_sb % 2 == 0 && a.vc_sh % 2 == 0,
            "decode_attention needs 16-byte aligned K cache rows and 4-byte aligned V cache rows");
    if (a.b == 0) return;
    use_device(a.device);
    if (!legacy_attention() && flash_decode(a)) return;
    const int64_t group = a.hq / a.hkv;
    const int64_t hgroups = (group + kHeads - 1) / kHeads;
    const int64_t base_blocks = a.b * a.hkv * hgroups;
    require(base_blocks <= 65535, "decode_attention: batch x KV heads too large for one launch");
    // Split the sequence until there are ~4 blocks per multiprocessor (chunks of >= kMinChunk positions).
    const int64_t max_chunks = (a.seq_len + kMinChunk - 1) / kMinChunk;
    int64_t nchunks = std::min<int64_t>(max_chunks, std::max<int64_t>(1, (4LL * sm_count(a.device) + base_blocks - 1) / base_blocks));
    if (nchunks > 1) {
        const int64_t fit = a.ws.data ? a.ws.floats / (a.b * a.hq * (a.d + 2)) : 0;
        nchunks = std::max<int64_t>(1, std::min(nchunks, fit));
    }
    const int64_t chunk_len = (a.seq_len + nchunks - 1) / nchunks;
    nchunks = (a.seq_len + chunk_len - 1) / chunk_len;

    ChunkParams p;
    p.q = static_cast<const half*>(a.q);
    p.q_sb = a.q_sb;
    p.q_sh = a.q_sh;
    p.kc = static_cast<const half*>(a.k_cache);
    p.vc = static_cast<const half*>(a.v_cache);
    p.kc_sb = a.kc_sb; p.kc_sh = a.kc_sh; p.kc_ss = a.kc_ss;
    p.vc_sb = a.vc_sb; p.vc_sh = a.vc_sh; p.vc_ss = a.vc_ss;
    p.hq = static_cast<int>(a.hq);
    p.hkv = static_cast<int>(a.hkv);
    p.group = static_cast<int>(group);
    p.hgroups = static_cast<int>(hgroups);
    p.d = static_cast<int>(a.d);
    p.seq_len = static_cast<int>(a.seq_len);
    p.chunk_len = static_cast<int>(chunk_len);
    p.nchunks = static_cast<int>(nchunks);
    p.scale = a.scale;
    p.pos_dev = a.pos_dev;
    p.out = static_cast<half*>(a.out);
    p.part_o = a.ws.data;
    p.part_ml = a.ws.data ? a.ws.data + a.b * a.hq * nchunks * a.d : nullptr;
    const dim3 grid(static_cast<unsigned>(nchunks), static_cast<unsigned>(base_blocks));
    attn_chunk_kernel<<<grid, kThreads, 0, as_stream(a.stream)>>>(p);
    KB_CHECK_LAUNCH();
    if (nchunks > 1) {
        const int threads = static_cast<int>(std::min<int64_t>(256, (a.d + 31) / 32 * 32));
        attn_reduce_kernel<<<static_cast<unsigned>(a.b * a.hq), threads, 0, as_stream(a.stream)>>>(
            p.part_o, p.part_ml, p.nchunks, p.d, p.out);
        KB_CHECK_LAUNCH();
    }
}

}  // namespace cuda
}  // namespace kb
