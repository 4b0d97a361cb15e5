// GGML block formats (what GGUF files store), decoded eight elements at a time for the CPU and CUDA kernels
// (csrc/cpu/ggml_cpu.cpp, csrc/cuda/ggml.cu). Written from ggml's block definitions; the layouts are described in
// kobold_backend/ops/ggml.py, whose torch dequantization is the reference these decoders are tested against.
//
// `Block<T>::decode8(b, j, w)` writes elements 8j .. 8j+7 of the block at `b` to w[0..7] in fp32, with ggml's
// arithmetic: scale products first (d * sc, dmin * m), then times the quant, then the min. Every block starts on
// an even address (all block sizes are even), so fields are read with 16-bit loads; Q4_K and Q5_K blocks
// (144 and 176 bytes) start on 16-byte boundaries, so their quants are read with 64-bit loads.
#pragma once

#include <cstdint>

#include "kb_common.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define KB_HD __host__ __device__ __forceinline__
#else
#define KB_HD inline
#endif

namespace kb {
namespace ggml {

// ggml_type ids (ggml.h's enum ggml_type), the codes the bindings take.
enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

KB_HD float f16(uint16_t h) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    return half_to_f32(h);
#endif
}

KB_HD uint32_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }

// Eight bytes from a 2-byte aligned address, byte i in bits 8i..8i+7.
KB_HD uint64_t ld64_a2(const uint8_t* p) {
    return static_cast<uint64_t>(ld16(p)) | static_cast<uint64_t>(ld16(p + 2)) << 16 |
           static_cast<uint64_t>(ld16(p + 4)) << 32 | static_cast<uint64_t>(ld16(p + 6)) << 48;
}

// Eight bytes from an 8-byte aligned address.
KB_HD uint64_t ld64_a8(const uint8_t* p) { return *reinterpret_cast<const uint64_t*>(p); }

KB_HD uint32_t byte_of(uint64_t v, int i) { return static_cast<uint32_t>(v >> (8 * i)) & 0xFFu; }

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 scale bytes at `s` (4-byte aligned), read as three
// words and selected without branches: sub-blocks 0-3 keep theirs in the low 6 bits of bytes j and j + 4; 4-7 take
// the low / high nibble of byte j + 4 and the top 2 bits of bytes j - 4 / j.
KB_HD void scale_min_k4(const uint8_t* s, int j, float& sc, float& mn) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(s);
    const int shift = 8 * (j & 3);
    const uint32_t b0 = (w[0] >> shift) & 0xFF, b4 = (w[1] >> shift) & 0xFF, b8 = (w[2] >> shift) & 0xFF;
    const bool low = j < 4;
    sc = static_cast<float>(low ? (b0 & 63) : ((b8 & 0xF) | ((b0 >> 6) << 4)));
    mn = static_cast<float>(low ? (b4 & 63) : ((b8 >> 4) | ((b4 >> 6) << 4)));
}

template <int T>
struct Block;

template <>
struct Block<Q8_0> {
    static constexpr int elements = 32, bytes = 34;
    static KB_HD void decode8(const uint8_t* b, int j, float* w) {
        const float d = f16(ld16(b));
        const uint64_t q = ld64_a2(b + 2 + 8 * j);
        for (int i = 0; i < 8; ++i) w[i] = static_cast<float>(static_cast<int8_t>(byte_of(q, i))) * d;
    }
};

// 32-element blocks with nibbles: element e < 16 is the low nibble of byte e, element e >= 16 the high nibble
// of byte e - 16; chunk j's nibbles sit in bytes 8 (j & 1) .. +7 at shift 4 (j >> 1).
template <>
struct Block<Q4_0> {
    static constexpr int elements = 32, bytes = 18;
    static KB_HD void decode8(const uint8_t* b, int j, float* w) {
        const float d = f16(ld16(b));
        const uint64_t q = ld64_a2(b + 2 + 8 * (j & 1)) >> (4 * (j >> 1));
        for (int i = 0; i < 8; ++i) w[i] = d * static_cast<float>(static_cast<int>(byte_of(q, i) & 0xF) - 8);
    }
};

template <>
struct Block<Q4_1> {
    static constexpr int elements = 32, bytes = 20;
    static KB_HD void decode8(const uint8_t* b, int j, float* w) {
        const float d = f16(ld16(b)), m = f16(ld16(b + 2));
        const uint64_t q = ld64_a2(b + 4 + 8 * (j & 1)) >> (4 * (j >> 1));
        for (int i = 0; i < 8; ++i) w[i] = d * static_cast<float>(byte_of(q, i) & 0xF) + m;
    }
};

// Q5_0 / Q5_1: bit e of the little-endian uint32 qh is element e's fifth bit.
template <>
struct Block<Q5_0> {
    static constexpr int elements = 32, bytes = 22;
    static KB_HD void decode8(const uint8_t* b, int j, float* w) {
        const float d = f16(ld16(b));
        const uint32_t qh = (ld16(b + 2) | ld16(b + 4) << 16) >> (8 * j);
        const uint64_t q = ld64_a2(b + 6 + 8 * (j & 1)) >> (4 * (j >> 1));
        for (int i = 0; i < 8; ++i) {
            const int v = static_cast<int>((byte_of(q, i) & 0xF) | ((qh >> i) & 1) << 4);
            w[i] = d * static_cast<float>(v - 16);
        }
    }
};

template <>
struct Block<Q5_1> {
    static constexpr int elements = 32, bytes = 24;
    static KB_HD void decode8(const uint8_t* b, int j, float* w) {
        const float d = f16(ld16(b)), m = f16(ld16(b + 2));
        const uint32_t qh = (ld16(b + 4) | ld16(b + 6) << 16) >> (8 * j);
        const uint64_t q = ld64_a2(b + 8 + 8 * (j & 1)) >> (4 * (j >> 1));
        for (int i = 0; i < 8; ++i) {
            const uint32_t v = (byte_of(q, i) & 0xF) | ((qh >> i) & 1) << 4;
            w[i] = d * static_cast<float>(v) + m;
        }
    }
};

// Q4_K: sub-block s (32 elements) is the low (s even) or high (s odd) nibbles of quant bytes 32 (s / 2) .. +31.
template <>
struct Block<Q4_K> {
    static constexpr int elements = 256, bytes = 144;
    static KB_HD void decode8(const uint8_t* b, int j, float* w) {
        const int s = j >> 2, l = 8 * (j & 3);
        float sc, mn;
        scale_min_k4(b + 4, s, sc, mn);
        const float dl = f16(ld16(b)) * sc, ml = f16(ld16(b + 2)) * mn;
        const uint64_t q = ld64_a8(b + 16 + 32 * (s >> 1) + l) >> (4 * (s & 1));
        for (int i = 0; i < 8; ++i) w[i] = dl * static_cast<float>(byte_of(q, i) & 0xF) - ml;
    }
};

// Q5_K: as Q4_K, plus bit s of qh[l] as sub-block s's element l's fifth bit.
template <>
struct Block<Q5_K> {
    static constexpr int elements = 256, bytes = 176;
    static KB_HD void decode8(const uint8_t* b, int j, float* w) {
        const int s = j >> 2, l = 8 * (j & 3);
        float sc, mn;
        scale_min_k4(b + 4, s, sc, mn);
        const float dl = f16(ld16(b)) * sc, ml = f16(ld16(b + 2)) * mn;
        const uint64_t qh = ld64_a8(b + 16 + l) >> s;
        const uint64_t q = ld64_a8(b + 48 + 32 * (s >> 1) + l) >> (4 * (s & 1));
        for (int i = 0; i < 8; ++i) {
            const uint32_t v = (byte_of(q, i) & 0xF) | (byte_of(qh, i) & 1) << 4;
            w[i] = dl * static_cast<float>(v) - ml;
        }
    }
};

// Q6_K: half h (128 elements) has four rows r of 32; row r's low 4 bits are the low (r < 2) or high nibbles of
// ql[64 h + 32 (r & 1) + l], its top 2 bits are bits 2r of qh[32 h + l]; one int8 scale per 16 elements.
template <>
struct Block<Q6_K> {
    static constexpr int elements = 256, bytes = 210;
    static KB_HD void decode8(const uint8_t* b, int j, float* w) {
        const int h = j >> 4, r = (j >> 2) & 3, l = 8 * (j & 3);
        const float dl = f16(ld16(b + 208)) * static_cast<float>(static_cast<int8_t>(b[192 + (j >> 1)]));
        const uint64_t ql = ld64_a2(b + 64 * h + 32 * (r & 1) + l) >> (4 * (r >> 1));
        const uint64_t qh = ld64_a2(b + 128 + 32 * h + l) >> (2 * r);
        for (int i = 0; i < 8; ++i) {
            const int v = static_cast<int>((byte_of(ql, i) & 0xF) | (byte_of(qh, i) & 3) << 4);
            w[i] = dl * static_cast<float>(v - 32);
        }
    }
};

// Calls f.run<T>() for the block type `type`; false when the type has no kernel.
template <typename F>
bool dispatch(int type, F&& f) {
    switch (type) {
        case Q4_0: f.template run<Q4_0>(); return true;
        case Q4_1: f.template run<Q4_1>(); return true;
        case Q5_0: f.template run<Q5_0>(); return true;
        case Q5_1: f.template run<Q5_1>(); return true;
        case Q8_0: f.template run<Q8_0>(); return true;
        case Q4_K: f.template run<Q4_K>(); return true;
        case Q5_K: f.template run<Q5_K>(); return true;
        case Q6_K: f.template run<Q6_K>(); return true;
        default: return false;
    }
}

}  // namespace ggml
}  // namespace kb
