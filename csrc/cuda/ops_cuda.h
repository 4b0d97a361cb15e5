// Host-side interface of the CUDA kernels (plain C++ types only, so the pybind11 binding compiles
// without CUDA headers). Pointers are device addresses; `stream` is a cudaStream_t as an integer;
// every launcher selects `device`, checks its arguments and every CUDA call, and throws on error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kb {
namespace cuda {

struct BuildInfo {
    int cuda_version;          // CUDART_VERSION at build time, e.g. 13000
    std::string archs;         // e.g. "80 86 89 90+PTX"
    std::string nvcc;          // e.g. "13.0"
    std::string host_compiler; // e.g. "gcc 12.2.0"
};

BuildInfo build_info();
int driver_version();   // cudaDriverGetVersion (0 when no driver is installed)
int runtime_version();  // cudaRuntimeGetVersion of the statically linked runtime
int device_count();     // 0 when no device or no driver

// Scratch memory owned by the caller, one per (device, stream): `floats` fp32 values and `counters`
// uint32 values that must be zero before the first launch (kernels leave them zero again).
struct Workspace {
    float* data;
    int64_t floats;
    uint32_t* counters;
    int64_t ncounters;
};

struct GemvArgs {
    const void* x;  // [M, K] fp16, row stride x_stride
    int64_t x_stride, m, k;
    const int64_t* perm;       // [K] or null
    const uint32_t* qweight;   // [ceil(K/8), N]
    int64_t n;
    const void* scales;        // [G, N] fp16
    const void* zeros;         // [G, N] fp16
    int64_t group_size, groups;
    const void* bias;          // [N] fp16 or null
    void* out;                 // [M, N] fp16
    Workspace ws;
    int device;
    std::uintptr_t stream;
    int variant;  // 0: chosen by shape; 1: split-K (gptq.cu); 2, 3: whole-K with 256, 512 threads (gptq_wide.cu);
                  // 4: whole-K lean, 256 threads (gptq_lean.cu); 5: the same with programmatic dependent launch
};

void gptq_gemv(const GemvArgs& a);  // M in 1..8, group_size % 8 == 0, N % 4 == 0
bool gptq_gemv_wide_fits(const GemvArgs& a, int threads);
void gptq_gemv_wide(const GemvArgs& a, int threads);  // whole-K GEMV; only where gptq_gemv_wide_fits
// whole-K, fewer instructions per weight; where gptq_gemv_wide_fits(a, 256); pdl: programmatic dependent launch
void gptq_gemv_lean(const GemvArgs& a, bool pdl);

// Tensor-core GPTQ 4-bit product for 1..kMmaMaxRows rows (gptq_mma.cu): K and N multiples of 64, group_size % 8 == 0.
constexpr int64_t kMmaMaxRows = 128;
struct MmaArgs {
    const void* x;  // [M, K] fp16, row stride x_stride (a multiple of 8), 16-byte aligned
    int64_t x_stride, m, k;
    const uint32_t* qweight;  // [K/8, N]
    int64_t n;
    const void* scales;       // [G, N] fp16
    const void* zeros;        // [G, N] fp16
    int64_t group_size, groups;
    const void* bias;         // [N] fp16 or null
    void* out;                // [M, N] fp16, contiguous
    float* partial;           // [splits, 16 * ceil(M / 16), N] fp32 scratch
    int64_t splits;           // slices of K (1..K/64); fewer are used when the slices round up to 64 inputs
    int device;
    std::uintptr_t stream;
};
void gptq_mma(const MmaArgs& a);

void gptq_dequantize(const uint32_t* qweight, int64_t k, int64_t n, const void* scales, const void* zeros,
                     int64_t group_size, int64_t groups, void* out, int device, std::uintptr_t stream);

// fp16 rows; weight fp16 (w_dtype 1) or fp32 (w_dtype 0); residual may be null.
void rms_norm(const void* x, int64_t x_stride, const void* residual, int64_t r_stride, int64_t rows, int64_t d,
              const void* weight, int w_dtype, float eps, void* y, void* residual_out, int device,
              std::uintptr_t stream);

struct RopeArgs {
    const void* q; const void* k; const void* v;  // fp16 [B, T, H, D], last dim contiguous
    int64_t q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh;
    int64_t b, t, hq, hkv, d;
    const void* cos; const void* sin;  // [S, D], fp16 (cs_dtype 1) or fp32 (0)
    int cs_dtype;
    int64_t cos_stride, sin_stride, pos;
    const int64_t* pos_dev;            // or the first position read on the device (CUDA graphs); then
    int64_t max_pos;                   // positions >= max_pos (cache or table length) are skipped
    void* k_cache; void* v_cache;      // fp16 [B, Hkv, S, D]
    int64_t kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss;
    void* q_out;                       // fp16 [B, T, Hq, D] contiguous
    int device;
    std::uintptr_t stream;
};

void rope_cache_write(const RopeArgs& a);

struct AttnArgs {
    const void* q;  // fp16 [B, Hq, D]
    int64_t q_sb, q_sh, b, hq, hkv, d;
    const void* k_cache; const void* v_cache;  // fp16 [B, Hkv, S, D]
    int64_t kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss, seq_len;
    const int64_t* pos_dev;  // or null: attend to min(seq_len, *pos_dev + 1) positions (CUDA graphs)
    float scale;
    void* out;  // fp16 [B, Hq, D] contiguous
    Workspace ws;
    int device;
    std::uintptr_t stream;
};

void decode_attention(const AttnArgs& a);  // D even, D % 8 == 0, D <= 256

// Decode attention over the 8/4-bit KV cache of kobold_backend/ops/kv_quant.py (kv_quant.cu).
struct KvqAttnArgs {
    const void* q;  // [B, Hq, D] fp16 (q_f16) or fp32, last dim contiguous
    int q_f16, out_f16;
    int64_t q_sb, q_sh, b, hq, hkv, d;
    const void* kd; const void* ks;  // K: int8 [B, Hkv, S, D] or nibbles uint8 [B, Hkv, S, D/2]; fp16 scales [.., D/32]
    const void* vd; const void* vs;  // V: the same
    int64_t kd_sb, kd_sh, kd_ss, ks_sb, ks_sh, ks_ss, vd_sb, vd_sh, vd_ss, vs_sb, vs_sh, vs_ss;
    int k_bits, v_bits;
    int64_t seq_len;
    const int64_t* pos_dev;  // or null: attend to min(seq_len, *pos_dev + 1) positions (CUDA graphs)
    float scale;
    int64_t window;          // > 0: only the last `window` of those positions (sliding window); 0: all
    float softcap;           // > 0: scores become softcap * tanh(scores / softcap) (Gemma 2); 0: none
    void* out;  // [B, Hq, D] contiguous, fp16 (out_f16) or fp32
    Workspace ws;
    int device;
    std::uintptr_t stream;
};

void kvq_decode_attention(const KvqAttnArgs& a);  // D % 32 == 0, D <= 256

// The templated flash-decoding body of flash_decode.cu for the fp16 and the 8/4-bit caches; false (nothing
// launched) for a shape it does not take (head_dim other than 64/128/256, rows not 16-byte aligned, K 4-bit with
// V 8-bit), which the kernels of attention.cu / kv_quant.cu then serve. decode_attention and kvq_decode_attention
// call it first unless legacy_attention() (the environment variable KOBOLD_BACKEND_ATTN=legacy).
bool flash_decode(const AttnArgs& a);
bool flash_decode(const KvqAttnArgs& a);
bool legacy_attention();

struct KvqWriteArgs {
    const void* q; const void* k; const void* v;  // fp16 [B, T, H, D], last dim contiguous
    int64_t q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh;
    int64_t b, t, hq, hkv, d;
    const void* cos; const void* sin;  // [S, D], fp16 (cs_dtype 1) or fp32 (0)
    int cs_dtype;
    int64_t cos_stride, sin_stride, pos;
    const int64_t* pos_dev;            // or the first position read on the device (CUDA graphs)
    int64_t max_pos;                   // positions >= max_pos are skipped
    void* kd; void* ks; void* vd; void* vs;  // the quantized caches (KvqAttnArgs)
    int64_t kd_sb, kd_sh, kd_ss, ks_sb, ks_sh, ks_ss, vd_sb, vd_sh, vd_ss, vs_sb, vs_sh, vs_ss;
    int k_bits, v_bits;
    void* q_out;                       // fp16 [B, T, Hq, D] contiguous
    int device;
    std::uintptr_t stream;
};

void kvq_rope_write(const KvqWriteArgs& a);  // D % 32 == 0

void silu_mul(const void* gate, const void* up, int64_t n, void* out, int device, std::uintptr_t stream);

// GGML block formats (ggml.cu; type codes of ggml_blocks.h): fp16 x and out, fp32 accumulation.
struct GgmlGemvArgs {
    int type;
    const void* w;  // [N, row_bytes] blocks as stored
    int64_t row_bytes, n, k;
    const void* x;  // fp16 [M, K], 16-byte aligned rows, row stride x_stride
    int64_t x_stride, m;
    const void* bias;  // fp16 [N] or null
    void* out;         // fp16 [M, N] contiguous
    int device;
    std::uintptr_t stream;
};

void ggml_gemv(const GgmlGemvArgs& a);  // M in 1..4, K a multiple of the block
// The integer GEMV (ggml_q8.cu): x quantized to int8 into scratch (M * K * 3 / 2 bytes, 16-byte aligned) first;
// pdl: the GEMV launched programmatically behind that quantization (sm_90+).
void ggml_gemv_q8(const GgmlGemvArgs& a, void* scratch, bool pdl);  // M in 1..4

// out fp16 [N, K] = dequant(w)
void ggml_dequantize(int type, const void* w, int64_t row_bytes, int64_t n, int64_t k, void* out, int device,
                     std::uintptr_t stream);

}  // namespace cuda
}  // namespace kb
