// Shared definitions of the native extension: dtype codes (matching kobold_backend/ops/native.py),
// portable fp16/bf16 <-> fp32 conversions for host code, and the build-info macros.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#ifndef KB_VERSION
#define KB_VERSION "unknown"
#endif

namespace kb {

// Dtype codes passed from Python; keep in sync with native.py's _DTYPE_CODES.
enum Dtype : int { F32 = 0, F16 = 1, BF16 = 2 };

inline const char* dtype_name(int code) {
    switch (code) {
        case F32: return "float32";
        case F16: return "float16";
        case BF16: return "bfloat16";
        default: return "unknown";
    }
}

inline void require(bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument(what);
}

inline float bits_to_f32(uint32_t w) {
    float f;
    std::memcpy(&f, &w, sizeof f);
    return f;
}

inline uint32_t f32_to_bits(float f) {
    uint32_t w;
    std::memcpy(&w, &f, sizeof w);
    return w;
}

// IEEE half <-> float, round to nearest even (the FP16 library's branch-free formulation).
inline float half_to_f32(uint16_t h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = bits_to_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_to_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t result = sign | (two_w < (1u << 27) ? f32_to_bits(denormalized) : f32_to_bits(normalized));
    return bits_to_f32(result);
}

inline uint16_t f32_to_half(float f) {
    float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_to_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_to_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
    uint32_t x = f32_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return static_cast<uint16_t>(x >> 16);
}

}  // namespace kb
