// Decode attention over the 8/4-bit KV cache on the CPU (kobold_backend/ops/kv_quant.py has the layout): the
// integers are read and scaled in the loop, never dequantized into a copy. The query is rotated into the
// cache's Hadamard space once and the output rotated back once (H is its own inverse).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kb_common.h"
#include "ops_cpu.h"

namespace kb {
namespace cpu {
namespace {

constexpr int kGroup = 32;

// The orthonormal Sylvester-Hadamard transform of each group of 32 values of x[0, d), in place.
void hadamard_groups(float* x, int64_t d) {
    const float norm = 1.0f / std::sqrt(static_cast<float>(kGroup));
    for (int64_t g = 0; g < d; g += kGroup) {
        float* v = x + g;
        for (int m = 1; m < kGroup; m <<= 1) {
            for (int i = 0; i < kGroup; ++i) {
                if (i & m) continue;
                const float a = v[i], b = v[i + m];
                v[i] = a + b;
                v[i + m] = a - b;
            }
        }
        for (int i = 0; i < kGroup; ++i) v[i] *= norm;
    }
}

// The stored integer of value e of a row (before its group's scale).
template <int BITS>
inline float stored(const uint8_t* row, int64_t e) {
    if (BITS == 8) return static_cast<float>(static_cast<int8_t>(row[e]));
    const uint8_t b = row[e / 2];
    return static_cast<float>(static_cast<int>((e & 1) ? (b >> 4) : (b & 15u)) - 8);
}

template <int KBITS, int VBITS>
void kvq_attention_t(const KvqAttnArgs& a) {
    const int64_t group = a.hq / a.hkv, items = a.b * a.hq, groups = a.d / kGroup;
    const float* q = static_cast<const float*>(a.q);
    const uint8_t* kd = static_cast<const uint8_t*>(a.kd);
    const uint8_t* vd = static_cast<const uint8_t*>(a.vd);
    const uint16_t* ks = static_cast<const uint16_t*>(a.ks);
    const uint16_t* vs = static_cast<const uint16_t*>(a.vs);
    float* out = static_cast<float*>(a.out);
#pragma omp parallel num_threads(a.threads < 1 ? 1 : a.threads) if (items * a.seq_len * a.d >= (1 << 15))
    {
        std::vector<float> scores(static_cast<size_t>(a.seq_len));
        std::vector<float> qf(static_cast<size_t>(a.d)), acc(static_cast<size_t>(a.d));
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t b = it / a.hq, h = it % a.hq, hk = h / group;
            const float* qi = q + b * a.q_sb + h * a.q_sh;
            std::copy(qi, qi + a.d, qf.begin());
            hadamard_groups(qf.data(), a.d);
            float mx = -INFINITY;
            const int64_t lo = a.window > 0 ? std::max<int64_t>(0, a.seq_len - a.window) : 0;
            for (int64_t p = lo; p < a.seq_len; ++p) {
                const uint8_t* kr = kd + b * a.kd_sb + hk * a.kd_sh + p * a.kd_ss;
                const uint16_t* sr = ks + b * a.ks_sb + hk * a.ks_sh + p * a.ks_ss;
                float dot = 0.0f;
                for (int64_t g = 0; g < groups; ++g) {
                    float part = 0.0f;
                    for (int64_t e = g * kGroup; e < (g + 1) * kGroup; ++e) part += qf[e] * stored<KBITS>(kr, e);
                    dot += half_to_f32(sr[g]) * part;
                }
                const float x = dot * a.scale;
                scores[p] = a.softcap > 0.0f ? a.softcap * std::tanh(x / a.softcap) : x;
                mx = std::max(mx, scores[p]);
            }
            float sum = 0.0f;
            for (int64_t p = lo; p < a.seq_len; ++p) {
                scores[p] = std::exp(scores[p] - mx);
                sum += scores[p];
            }
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t p = lo; p < a.seq_len; ++p) {
                const uint8_t* vr = vd + b * a.vd_sb + hk * a.vd_sh + p * a.vd_ss;
                const uint16_t* sr = vs + b * a.vs_sb + hk * a.vs_sh + p * a.vs_ss;
                const float pr = scores[p] / sum;
                for (int64_t g = 0; g < groups; ++g) {
                    const float w = pr * half_to_f32(sr[g]);
                    for (int64_t e = g * kGroup; e < (g + 1) * kGroup; ++e) acc[e] += w * stored<VBITS>(vr, e);
                }
            }
            hadamard_groups(acc.data(), a.d);
            std::copy(acc.begin(), acc.end(), out + it * a.d);
        }
    }
}

}  // namespace

void kvq_decode_attention(const KvqAttnArgs& a) {
    require(a.hkv >= 1 && a.hq % a.hkv == 0, "kvq_decode_attention: query heads must be a multiple of KV heads");
    require(a.d >= kGroup && a.d % kGroup == 0, "kvq_decode_attention needs head_dim a multiple of 32");
    require(a.seq_len >= 1, "kvq_decode_attention needs seq_len >= 1");
    require(a.window >= 0 && a.softcap >= 0.0f, "kvq_decode_attention: window and softcap must be >= 0 (0: none)");
    require((a.k_bits == 8 || a.k_bits == 4) && (a.v_bits == 8 || a.v_bits == 4),
            "kvq_decode_attention: K and V must be 8- or 4-bit");
    if (a.k_bits == 8 && a.v_bits == 8) kvq_attention_t<8, 8>(a);
    else if (a.k_bits == 8) kvq_attention_t<8, 4>(a);
    else if (a.v_bits == 8) kvq_attention_t<4, 8>(a);
    else kvq_attention_t<4, 4>(a);
}

}  // namespace cpu
}  // namespace kb
