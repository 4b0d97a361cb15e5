// CPU kernels of kobold_backend._ext_cpu: raw pointers, shapes and strides in elements, dtype codes
// from kb_common.h. Every function computes in fp32 and rounds once per stored value, as reference.py does.
#pragma once

#include <cstdint>

namespace kb {
namespace cpu {

struct GemvArgs {
    const void* x;          // [M, K] activations (x_dtype), row stride x_stride, last dim contiguous
    int x_dtype;
    int64_t x_stride;
    int64_t m, k;
    const int64_t* perm;    // [K] or null: sorted row -> original column of x
    const int32_t* qweight; // [ceil(K/8), N] contiguous
    int64_t n;
    const void* scales;     // [G, N] contiguous (sz_dtype)
    const void* zeros;      // [G, N] contiguous (sz_dtype), true zeros
    int sz_dtype;
    int64_t group_size, groups;
    const void* bias;       // [N] (bias_dtype) or null
    int bias_dtype;
    void* out;              // [M, N] contiguous (out_dtype)
    int out_dtype;
    int threads;
};

// y = x[:, perm] @ dequant(w) + bias for 1..8 rows, reading each packed word once.
// Requires group_size % 8 == 0.
void gptq_gemv(const GemvArgs& a);

// out [K, N] (sz_dtype) = (q - zeros[k / gs]) * scales[k / gs]; any group size.
void gptq_dequantize(const int32_t* qweight, int64_t k, int64_t n, const void* scales, const void* zeros,
                     int sz_dtype, int64_t group_size, int64_t groups, void* out, int threads);

// y = rms_norm(x [+ residual]) * weight over rows of length d; residual_out = x + residual when given.
void rms_norm(const void* x, int64_t x_stride, const void* residual, int64_t r_stride, int dtype, int64_t rows,
              int64_t d, const void* weight, int w_dtype, float eps, void* y, void* residual_out, int threads);

struct RopeArgs {
    const void* q; const void* k; const void* v;  // [B, T, H, D], last dim contiguous
    int dtype;
    int64_t q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh;
    int64_t b, t, hq, hkv, d;
    const void* cos; const void* sin;  // [S, D], row strides cs_stride / sn_stride
    int cs_dtype;
    int64_t cos_stride, sin_stride;
    int64_t pos;
    void* k_cache; void* v_cache;     // [B, Hkv, S, D]
    int64_t kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss;
    void* q_out;                      // [B, T, Hq, D] contiguous
    int threads;
};

void rope_cache_write(const RopeArgs& a);

struct AttnArgs {
    const void* q;  // [B, Hq, D], last dim contiguous
    int dtype;
    int64_t q_sb, q_sh;
    int64_t b, hq, hkv, d;
    const void* k_cache; const void* v_cache;  // [B, Hkv, S, D]
    int64_t kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss;
    int64_t seq_len;
    float scale;
    void* out;  // [B, Hq, D] contiguous
    int threads;
};

void decode_attention(const AttnArgs& a);

// Decode attention over the 8/4-bit KV cache of kobold_backend/ops/kv_quant.py (kv_quant_cpu.cpp); strides in
// elements (bytes for the data, fp16 values for the scales).
struct KvqAttnArgs {
    const void* q;  // float32 [B, Hq, D], last dim contiguous
    int64_t q_sb, q_sh, b, hq, hkv, d;
    const void* kd; const void* ks;  // K: int8 [B, Hkv, S, D] or nibbles uint8 [.., D/2]; fp16 scales [.., D/32]
    const void* vd; const void* vs;  // V: the same
    int64_t kd_sb, kd_sh, kd_ss, ks_sb, ks_sh, ks_ss, vd_sb, vd_sh, vd_ss, vs_sb, vs_sh, vs_ss;
    int k_bits, v_bits;
    int64_t seq_len;
    float scale;
    int64_t window;  // > 0: only the last `window` of the seq_len positions; 0: all
    float softcap;   // > 0: scores become softcap * tanh(scores / softcap); 0: none
    void* out;       // float32 [B, Hq, D] contiguous
    int threads;
};

void kvq_decode_attention(const KvqAttnArgs& a);

// out = silu(gate) * up over n contiguous elements.
void silu_mul(const void* gate, const void* up, int dtype, int64_t n, void* out, int threads);

}  // namespace cpu
}  // namespace kb
