// Decode attention over the packed ledger (the Q tier) on the CPU, read straight from its codes.
//
// The XLA FFI custom call behind pallas_kernels.cpu_ledger.ledger_attention_cpu; the same computation as
// pallas_kernels.reference.ledger_attention_reference (see it for the layouts), without ever materializing a
// dequantized cache: each slot's codes are expanded into a small stack buffer, re-rotated with RoPE tables
// combined from per-slot and per-offset angles (angle addition), and consumed at once. Values are applied
// from their codes with the per-token scale folded into the probabilities:
//   sum_t p_t (c_t * s_t + z_t) = sum_t (p_t s_t) c_t + sum_t p_t z_t.
// The slots are split into one contiguous range per thread of XLA's intra-op pool; every range produces a
// flash-decoding partial (out, max, sum) that the calling thread merges.
//
// Three handlers, one per ledger format (pallas_kernels.quant): QevictLedgerAttention reads ChannelKeys
// (pre-RoPE keys with a grid per channel over the window, re-rotated here; values of v_bits, read in their
// stored basis, the caller rotating the output back where they are rotated); QevictRotatedLedgerAttention
// reads RotatedTokens (keys and values with a grid per token, in the rotated basis, no RoPE), with the
// query already rotated by the caller; the key grid is folded into the logit:
//   q . (c_t s_t + z_t) = s_t (q . c_t) + z_t sum(q);
// QevictCenteredLedgerAttention reads RotatedTokens with centered keys: the same, plus the logit offset
// q . RoPE_t(mean) of each window's pre-RoPE key mean, re-rotated here at each token's position.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -1e30f;  // models.attention.NEG_INF
constexpr int kMaxDim = 256;       // head_dim
constexpr int kMaxWindow = 64;     // W
constexpr int kMaxGroup = 16;      // query heads per KV head

struct Shapes {
  int64_t b, hkv, g, d, nl, w, bits, per, wb, db;  // bits: the key codes' width (both, "channel")
  int64_t vbits = 0;                               // value codes' width (0: bits)
};

struct Inputs {
  const float* q;         // [B, Hkv, G, D]
  const uint8_t* kc;      // [B, Hkv, NL, D, Wb]
  const uint16_t* ks;     // [B, Hkv, NL, D] float16
  const uint16_t* kz;     // [B, Hkv, NL, D] float16
  const uint8_t* vc;      // [B, Hkv, NL, W, Db]
  const uint16_t* vs;     // [B, Hkv, NL, W] float16
  const uint16_t* vz;     // [B, Hkv, NL, W] float16
  const uint8_t* valid;   // [B, NL]
  const int32_t* start;   // [B, NL] absolute position of each slot's first token
  const float* inv_freq;  // [D/2]
  const uint16_t* km = nullptr;  // [B, Hkv, NL, D] float16 pre-RoPE key mean per window (centered format)
  const float* qp = nullptr;     // [B, Hkv, G, D] the query before the rotation (centered format)
};

// IEEE half -> float (exact), branch-free for normal numbers and zero; subnormals and inf/nan are rare in
// grids but handled by the slow path.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: value = man * 2^-24
      float f = static_cast<float>(man) * 5.9604644775390625e-08f;
      uint32_t fb;
      std::memcpy(&fb, &f, 4);
      bits = sign | fb;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// sin and cos of a float32 angle (|x| up to ~1e5, as RoPE angles of positions below 2^17 are): Cody-Waite
// reduction by pi/2 in three parts, then minimax polynomials on [-pi/4, pi/4] (Cephes sinf/cosf); error
// ~1e-7 absolute. Branch-free, so loops over channels vectorize.
inline void sincos_f32(float x, float* s_out, float* c_out) {
  const float q = std::nearbyint(x * 0.63661977236758134f);  // x / (pi/2)
  float r = x - q * 1.5703125f;
  r = r - q * 4.837512969970703125e-4f;
  r = r - q * 7.549789948768648e-8f;
  const float r2 = r * r;
  const float sp = r + r * r2 * (-1.6666654611e-1f + r2 * (8.3321608736e-3f + r2 * -1.9515295891e-4f));
  const float cp = 1.0f - 0.5f * r2 + r2 * r2 * (4.166664568298827e-2f + r2 * (-1.388731625493765e-3f +
                                                                           r2 * 2.443315711809948e-5f));
  const int quad = static_cast<int>(q) & 3;
  const float s1 = (quad & 1) ? cp : sp;
  const float c1 = (quad & 1) ? sp : cp;
  *s_out = (quad & 2) ? -s1 : s1;
  *c_out = ((quad + 1) & 2) ? -c1 : c1;
}

// exp(x) for x <= 0 (softmax numerators): 2^(x log2 e) split into the nearest integer and a fraction in
// [-1/2, 1/2], 2^fraction by its degree-6 Taylor polynomial (relative error ~2e-7); 0 below -87.
// Branch-free, so the loops over a window's tokens vectorize.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float fi = std::nearbyint(t);
  const float f = t - fi;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Codes of one packed byte, as floats: kLut[bits == 4][byte][k] = code k of the byte.
struct CodeTables {
  float two[256][4];
  float four[256][2];
  CodeTables() {
    for (int x = 0; x < 256; ++x) {
      for (int k = 0; k < 4; ++k) two[x][k] = static_cast<float>((x >> (2 * k)) & 3);
      for (int k = 0; k < 2; ++k) four[x][k] = static_cast<float>((x >> (4 * k)) & 15);
    }
  }
};
const CodeTables kCodes;

// Expand n packed bytes into n * per code floats.
inline void expand(const uint8_t* bytes, int64_t n, int64_t bits, float* out) {
  if (bits == 2) {
    for (int64_t j = 0; j < n; ++j) std::copy_n(kCodes.two[bytes[j]], 4, out + 4 * j);
  } else {
    for (int64_t j = 0; j < n; ++j) std::copy_n(kCodes.four[bytes[j]], 2, out + 2 * j);
  }
}

typedef float V8 __attribute__((vector_size(32)));    // eight floats (GCC/Clang vector extension)
typedef int32_t V8i __attribute__((vector_size(32)));  // eight int32
typedef uint8_t V8b __attribute__((vector_size(8)));   // eight bytes

// Eight bytes zero-extended to eight int32 lanes (one instruction where AVX2 has it; the generic conversion
// compiles to a chain of scalar inserts).
inline V8i widen_bytes(const uint8_t* p) {
#ifdef __AVX2__
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  V8i out;
  std::memcpy(&out, &x, sizeof(V8i));
  return out;
#else
  V8b raw;
  std::memcpy(&raw, p, 8);
  return __builtin_convertvector(raw, V8i);
#endif
}

// The codes of one token's D channels (per-token groups, pallas_kernels.quant.pack_tokens: 2 or 4 bits
// interleaved, byte j holding channels j * per .. j * per + per - 1; 3 bits as a 2-bit plane of D/4 bytes then
// a 1-bit plane of D/8 bytes) expanded in *lane order*, which a vector unpacks without shuffles: eight bytes
// at a time, the k-th code of each byte side by side. Element e of the expansion is channel
// token_order(e); the callers permute the query the same way (keys) or scatter the output back (values).
template <int kBits>
inline void expand_lanes(const uint8_t* bytes, int64_t d, float* out) {
  constexpr int64_t bits = kBits;
  constexpr int64_t plane = bits == 3 ? 2 : bits;
  constexpr int64_t per = 8 / plane;
  constexpr int32_t mask = (1 << plane) - 1;
  const int64_t nbytes = d * plane / 8;
  for (int64_t j0 = 0; j0 < nbytes; j0 += 8) {
    const int64_t lanes = std::min<int64_t>(8, nbytes - j0);
    float* o = out + j0 * per;
    if (lanes == 8) {
      const V8i x = widen_bytes(bytes + j0);
      for (int64_t k = 0; k < per; ++k) {
        const V8 f = __builtin_convertvector((x >> static_cast<int32_t>(plane * k)) & mask, V8);
        std::memcpy(o + 8 * k, &f, sizeof(V8));
      }
    } else {
      for (int64_t k = 0; k < per; ++k)
        for (int64_t l = 0; l < lanes; ++l) o[k * lanes + l] = static_cast<float>((bytes[j0 + l] >> (plane * k)) & mask);
    }
  }
  if constexpr (bits != 3) return;
  // the high plane: + 4 for channel c = (j0 + l) * 4 + k when bit c % 8 of byte c / 8 is set; a block of
  // eight 2-bit bytes covers 32 channels, one little-endian 32-bit word of the plane
  const uint8_t* high = bytes + d / 4;
  for (int64_t j0 = 0; j0 < nbytes; j0 += 8) {
    const int64_t lanes = std::min<int64_t>(8, nbytes - j0);
    float* o = out + j0 * 4;
    if (lanes == 8) {
      uint32_t word;
      std::memcpy(&word, high + j0 / 2, 4);
      const V8i w = V8i{} + static_cast<int32_t>(word);
      for (int32_t k = 0; k < 4; ++k) {
        const V8i shift = {k, 4 + k, 8 + k, 12 + k, 16 + k, 20 + k, 24 + k, 28 + k};
        V8 f;
        std::memcpy(&f, o + 8 * k, sizeof(V8));
        f += 4.0f * __builtin_convertvector((w >> shift) & 1, V8);
        std::memcpy(o + 8 * k, &f, sizeof(V8));
      }
    } else {
      for (int64_t k = 0; k < 4; ++k)
        for (int64_t l = 0; l < lanes; ++l) {
          const int64_t c = (j0 + l) * 4 + k;
          o[k * lanes + l] += static_cast<float>(((high[c / 8] >> (c % 8)) & 1) << 2);
        }
    }
  }
}

// The codes of a slot's w tokens (token-major, d * bits / 8 bytes each) by expand_lanes: out [w, d].
inline void expand_tokens(const uint8_t* bytes, int64_t w, int64_t d, int64_t bits, float* out) {
  const int64_t stride = d * bits / 8;
  switch (bits) {
    case 2:
      for (int64_t t = 0; t < w; ++t) expand_lanes<2>(bytes + t * stride, d, out + t * d);
      break;
    case 3:
      for (int64_t t = 0; t < w; ++t) expand_lanes<3>(bytes + t * stride, d, out + t * d);
      break;
    default:
      for (int64_t t = 0; t < w; ++t) expand_lanes<4>(bytes + t * stride, d, out + t * d);
  }
}

// The channel of each element of expand_lanes' output: order[e] for e < d.
inline void token_order(int64_t d, int64_t bits, int64_t* order) {
  const int64_t plane = bits == 3 ? 2 : bits;
  const int64_t per = 8 / plane, nbytes = d * plane / 8;
  for (int64_t j0 = 0; j0 < nbytes; j0 += 8) {
    const int64_t lanes = std::min<int64_t>(8, nbytes - j0);
    for (int64_t k = 0; k < per; ++k)
      for (int64_t l = 0; l < lanes; ++l) order[j0 * per + k * lanes + l] = (j0 + l) * per + k;
  }
}

// RoPE tables of the offsets 0..W-1, transposed to [H, W]: the angles as the jnp reference forms them
// (float32 offset * inv_freq).
inline void offset_tables(const float* inv_freq, int64_t H, int64_t W, float* cos_oT, float* sin_oT) {
  for (int64_t t = 0; t < W; ++t)
    for (int64_t i = 0; i < H; ++i) sincos_f32(static_cast<float>(t) * inv_freq[i], &sin_oT[i * W + t], &cos_oT[i * W + t]);
}

// cos, sin [H, W] of the angles of one slot's tokens (first at pos), by angle addition from the slot's start
// angles and the offset tables.
inline void slot_tables(float pos, const float* inv_freq, int64_t H, int64_t W, const float* cos_oT,
                        const float* sin_oT, float* cosr, float* sinr) {
  alignas(64) float ang_c[kMaxDim / 2];
  alignas(64) float ang_s[kMaxDim / 2];
  for (int64_t i = 0; i < H; ++i) sincos_f32(pos * inv_freq[i], &ang_s[i], &ang_c[i]);
  for (int64_t i = 0; i < H; ++i)
    for (int64_t t = 0; t < W; ++t) {
      cosr[i * W + t] = ang_c[i] * cos_oT[i * W + t] - ang_s[i] * sin_oT[i * W + t];
      sinr[i * W + t] = ang_s[i] * cos_oT[i * W + t] + ang_c[i] * sin_oT[i * W + t];
    }
}

// Sum of x[0..n): pairwise for a power-of-two n (vectorizes), else in order. Clobbers x.
inline float sum_inplace(float* x, int64_t n) {
  if (n & (n - 1)) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += x[i];
    return s;
  }
  for (int64_t half = n / 2; half >= 1; half /= 2)
    for (int64_t i = 0; i < half; ++i) x[i] += x[i + half];
  return x[0];
}

// a . b over n channels, n a multiple of 8: eight channels per vector in four independent chains, then the
// lanes pairwise.
inline float dot_product(const float* a, const float* b, int64_t n) {
  V8 acc[4] = {};
  int64_t d = 0;
  for (; d + 32 <= n; d += 32)
    for (int j = 0; j < 4; ++j) {
      V8 x, y;
      std::memcpy(&x, a + d + 8 * j, sizeof(V8));
      std::memcpy(&y, b + d + 8 * j, sizeof(V8));
      acc[j] += x * y;
    }
  for (; d < n; d += 8) {
    V8 x, y;
    std::memcpy(&x, a + d, sizeof(V8));
    std::memcpy(&y, b + d, sizeof(V8));
    acc[0] += x * y;
  }
  const V8 s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

// n float16 values to floats (exact), eight at a time where the CPU converts halves (F16C).
inline void halves_to_floats(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) out[i] = half_to_float(h[i]);
}

template <int kW, int kD>
void values_pass(const Shapes& sh, const Inputs& in, int64_t b, int64_t n0, int64_t n1, float* out_part,
                 float* m_part, float* l_part, float* slot_mass, const float* scores);

// One thread's share: slots [n0, n1) of row b, every KV head and query head. Writes the partial
// (out [Hkv, G, D] unnormalized, m [Hkv, G], l [Hkv, G]) and slot_mass relative to its own max.
// kW, kD: the window and head_dim when known at compile time (0 = read them from sh), so that the loops over
// the window's tokens and the head's channels have fixed trip counts and vectorize.
template <int kW, int kD>
void attend_range(const Shapes& sh, const Inputs& in, int64_t b, int64_t n0, int64_t n1, float* out_part,
                  float* m_part, float* l_part, float* slot_mass, float* scores) {
  const int64_t G = sh.g, HKV = sh.hkv, NL = sh.nl;
  const int64_t W = kW ? kW : sh.w;
  const int64_t D = kD ? kD : sh.d;
  const int64_t H = D / 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  alignas(64) float cosr[kMaxDim / 2 * kMaxWindow];  // [H, W] rotation of each (pair, offset) in the slot
  alignas(64) float sinr[kMaxDim / 2 * kMaxWindow];
  alignas(64) float cos_oT[kMaxDim / 2 * kMaxWindow];  // offset tables transposed to [H, W]
  alignas(64) float sin_oT[kMaxDim / 2 * kMaxWindow];
  alignas(64) float kbuf[kMaxDim * kMaxWindow];  // [D, W] keys of one slot: codes, then re-rotated keys
  alignas(64) float krot[kMaxDim * kMaxWindow];  // [D, W]
  alignas(64) float acc[kMaxWindow];
  std::vector<float> qs(HKV * G * D);  // scaled queries [Hkv, G, D]
  alignas(64) float kscale[kMaxDim], kzero[kMaxDim];
  offset_tables(in.inv_freq, H, W, cos_oT, sin_oT);
  for (int64_t x = 0; x < HKV * G * D; ++x) qs[x] = in.q[b * HKV * G * D + x] * scale;
  const uint8_t* valid = in.valid + b * NL;
  const int64_t span = n1 - n0;
  // running max of the logits per (KV head, query head) and token offset, reduced after pass 1 (a reduction
  // per slot would be a chain of scalar compares)
  std::vector<float> mlane(HKV * G * W, kNegInf);

  // pass 1, slot by slot (the slot's RoPE table serves every KV head): logits of every valid token
  for (int64_t n = n0; n < n1; ++n) {
    if (!valid[n]) continue;
    slot_tables(static_cast<float>(in.start[b * NL + n]), in.inv_freq, H, W, cos_oT, sin_oT, cosr, sinr);
    for (int64_t h = 0; h < HKV; ++h) {
      const int64_t bh = b * HKV + h;
      const int64_t slot = bh * NL + n;
      expand(in.kc + slot * D * sh.wb, D * sh.wb, sh.bits, kbuf);
      for (int64_t d = 0; d < D; ++d) {
        kscale[d] = half_to_float(in.ks[slot * D + d]);
        kzero[d] = half_to_float(in.kz[slot * D + d]);
      }
      for (int64_t d = 0; d < D; ++d)
        for (int64_t t = 0; t < W; ++t) kbuf[d * W + t] = kbuf[d * W + t] * kscale[d] + kzero[d];
      for (int64_t i = 0; i < H; ++i) {
        const float* k1 = kbuf + i * W;
        const float* k2 = kbuf + (i + H) * W;
        const float* c = cosr + i * W;
        const float* s = sinr + i * W;
        float* r1 = krot + i * W;
        float* r2 = krot + (i + H) * W;
        for (int64_t t = 0; t < W; ++t) {
          r1[t] = k1[t] * c[t] - k2[t] * s[t];
          r2[t] = k2[t] * c[t] + k1[t] * s[t];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs.data() + (h * G + g) * D;
        if (W % 8 == 0 && D % 4 == 0) {
          // eight tokens per vector, accumulated over the channels in four independent chains (one chain
          // would wait on the latency of every multiply-add)
          for (int64_t c = 0; c < W; c += 8) {
            V8 a[4] = {};
            for (int64_t d = 0; d < D; d += 4)
              for (int j = 0; j < 4; ++j) {
                V8 k;
                std::memcpy(&k, krot + (d + j) * W + c, sizeof(V8));
                a[j] += qg[d + j] * k;
              }
            const V8 sum = (a[0] + a[1]) + (a[2] + a[3]);
            std::memcpy(acc + c, &sum, sizeof(V8));
          }
        } else {
          for (int64_t t = 0; t < W; ++t) acc[t] = 0.0f;
          for (int64_t d = 0; d < D; ++d)
            for (int64_t t = 0; t < W; ++t) acc[t] += qg[d] * krot[d * W + t];
        }
        float* sc = scores + ((h * G + g) * span + (n - n0)) * W;  // [Hkv, G, span, W]
        float* ml = mlane.data() + (h * G + g) * W;
        for (int64_t t = 0; t < W; ++t) {
          sc[t] = acc[t];
          ml[t] = acc[t] > ml[t] ? acc[t] : ml[t];
        }
      }
    }
  }
  for (int64_t hg = 0; hg < HKV * G; ++hg) {
    float mx = kNegInf;
    for (int64_t t = 0; t < W; ++t) mx = std::max(mx, mlane[hg * W + t]);
    m_part[hg] = mx;
  }
  values_pass<kW, kD>(sh, in, b, n0, n1, out_part, m_part, l_part, slot_mass, scores);
}

// Pass 2 of both formats (values have one grid per token in both): probabilities from the logits in
// ``scores`` [Hkv, G, span, W] and the maxima m_part, the per-slot masses, and the values applied from their
// codes with the per-token scale folded into the probabilities.
template <int kW, int kD>
void values_pass(const Shapes& sh, const Inputs& in, int64_t b, int64_t n0, int64_t n1, float* out_part,
                 float* m_part, float* l_part, float* slot_mass, const float* scores) {
  const int64_t G = sh.g, HKV = sh.hkv, NL = sh.nl;
  const int64_t W = kW ? kW : sh.w;
  const int64_t D = kD ? kD : sh.d;
  const int64_t span = n1 - n0;
  const int64_t vbits = sh.vbits ? sh.vbits : sh.bits;
  const int64_t vtoken = D * vbits / 8;  // bytes of one token's value codes
  const uint8_t* valid = in.valid + b * NL;
  alignas(64) float vbuf[kMaxWindow * kMaxDim];  // [W, D] value codes of one slot, channels in lane order
  alignas(64) float wts[kMaxGroup * kMaxWindow];
  alignas(64) float vscale[kMaxWindow], vzero[kMaxWindow];
  alignas(64) float acc[kMaxGroup * kMaxDim];  // [G, D] the head's output, channels in lane order
  int64_t order[kMaxDim];
  token_order(D, vbits, order);
  for (int64_t h = 0; h < HKV; ++h) {
    const int64_t bh = b * HKV + h;
    float* m = m_part + h * G;
    float* l = l_part + h * G;
    float* out = acc;
    const float* sc = scores + h * G * span * W;  // [G, span, W]
    alignas(64) float lsum[kMaxGroup * kMaxWindow];  // per-lane sums of p and of p * zero, reduced at the end
    alignas(64) float zsum[kMaxGroup * kMaxWindow];
    alignas(64) float tmp[kMaxWindow];
    std::fill_n(lsum, G * W, 0.0f);
    std::fill_n(zsum, G * W, 0.0f);
    std::fill_n(out, G * D, 0.0f);
    for (int64_t n = n0; n < n1; ++n) {
      float* mass = slot_mass + (bh * G) * NL + n;  // [G] with stride NL
      if (!valid[n]) {
        for (int64_t g = 0; g < G; ++g) mass[g * NL] = 0.0f;
        continue;
      }
      const int64_t slot = bh * NL + n;
      halves_to_floats(in.vs + slot * W, W, vscale);
      halves_to_floats(in.vz + slot * W, W, vzero);
      for (int64_t g = 0; g < G; ++g) {
        const float* x = sc + (g * span + (n - n0)) * W;
        float* ls = lsum + g * W;
        float* zs = zsum + g * W;
        for (int64_t t = 0; t < W; ++t) {
          const float p = exp_nonpos(x[t] - m[g]);
          tmp[t] = p;
          ls[t] += p;
          zs[t] += p * vzero[t];
          wts[g * W + t] = p * vscale[t];
        }
        mass[g * NL] = sum_inplace(tmp, W);
      }
      expand_tokens(in.vc + slot * W * vtoken, W, D, vbits, vbuf);
      for (int64_t g = 0; g < G; ++g) {
        float* o = out + g * D;
        if constexpr (kD > 0 && kD % 8 == 0) {
          // the head's output row stays in registers over the window's tokens
          V8 row[kD / 8];
          std::memcpy(row, o, sizeof(row));
          for (int64_t t = 0; t < W; ++t) {
            const float wt = wts[g * W + t];
            for (int64_t c = 0; c < kD / 8; ++c) {
              V8 v;
              std::memcpy(&v, vbuf + t * D + 8 * c, sizeof(V8));
              row[c] += wt * v;
            }
          }
          std::memcpy(o, row, sizeof(row));
        } else {
          for (int64_t t = 0; t < W; ++t) {
            const float wt = wts[g * W + t];
            const float* v = vbuf + t * D;
            for (int64_t d = 0; d < D; ++d) o[d] += wt * v[d];
          }
        }
      }
    }
    float* head_out = out_part + h * G * D;
    for (int64_t g = 0; g < G; ++g) {
      l[g] = sum_inplace(lsum + g * W, W);
      const float z = sum_inplace(zsum + g * W, W);
      for (int64_t e = 0; e < D; ++e) head_out[g * D + order[e]] = out[g * D + e] + z;
    }
  }
}

// attend_range for the RotatedTokens format: slots [n0, n1) of row b; q (already rotated by the caller)
// against keys with one grid per token, no RoPE. The dot products run over the channels in vectors (keys
// are stored token-major), with the grid folded in afterwards; the centered format's offset
// q . RoPE_t(mean) is taken in closed form per rotation pair i (channels i and i + D/2):
//   q1 (m1 c - m2 s) + q2 (m2 c + m1 s) = c (q1 m1 + q2 m2) + s (q2 m1 - q1 m2),
// so each slot needs its RoPE table once, shared by every head, and never a RoPE'd mean.
template <int kW, int kD>
void attend_range_rotated(const Shapes& sh, const Inputs& in, int64_t b, int64_t n0, int64_t n1,
                          float* out_part, float* m_part, float* l_part, float* slot_mass, float* scores) {
  const int64_t G = sh.g, HKV = sh.hkv, NL = sh.nl;
  const int64_t W = kW ? kW : sh.w;
  const int64_t D = kD ? kD : sh.d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t ktoken = D * sh.bits / 8;  // bytes of one token's key codes
  const int64_t H = D / 2;
  const bool centered = in.km != nullptr;
  alignas(64) float kbuf[kMaxWindow * kMaxDim];  // [W, D] key codes of one slot and head
  alignas(64) float kscale[kMaxWindow], kzero[kMaxWindow], dots[kMaxWindow];
  // centered format: RoPE tables of the slot [H, W], the window's pre-RoPE key mean [D], the pair sums of
  // the closed form [H] and the logit offsets [W]
  alignas(64) float cos_oT[kMaxDim / 2 * kMaxWindow], sin_oT[kMaxDim / 2 * kMaxWindow];
  alignas(64) float cosr[kMaxDim / 2 * kMaxWindow], sinr[kMaxDim / 2 * kMaxWindow];
  alignas(64) float mean[kMaxDim], pc[kMaxDim / 2], ps[kMaxDim / 2];
  alignas(64) float offset[kMaxWindow] = {};
  // scaled queries [Hkv, G, D] with their channels in the keys' lane order (expand_lanes), and their sums
  std::vector<float> qs(HKV * G * D), qsum(HKV * G, 0.0f);
  std::vector<float> qps(centered ? HKV * G * D : 0);  // scaled un-rotated queries, channels in order
  int64_t order[kMaxDim];
  token_order(D, sh.bits, order);
  for (int64_t hg = 0; hg < HKV * G; ++hg)
    for (int64_t e = 0; e < D; ++e) {
      const int64_t x = hg * D + e;
      qs[x] = in.q[b * HKV * G * D + hg * D + order[e]] * scale;
      qsum[hg] += in.q[b * HKV * G * D + x] * scale;
      if (centered) qps[x] = in.qp[b * HKV * G * D + x] * scale;
    }
  if (centered) offset_tables(in.inv_freq, H, W, cos_oT, sin_oT);
  const uint8_t* valid = in.valid + b * NL;
  const int64_t span = n1 - n0;
  std::vector<float> mlane(HKV * G * W, kNegInf);
  for (int64_t n = n0; n < n1; ++n) {
    if (!valid[n]) continue;
    if (centered)
      slot_tables(static_cast<float>(in.start[b * NL + n]), in.inv_freq, H, W, cos_oT, sin_oT, cosr, sinr);
    for (int64_t h = 0; h < HKV; ++h) {
      const int64_t slot = (b * HKV + h) * NL + n;
      expand_tokens(in.kc + slot * W * ktoken, W, D, sh.bits, kbuf);
      halves_to_floats(in.ks + slot * W, W, kscale);
      halves_to_floats(in.kz + slot * W, W, kzero);
      if (centered) halves_to_floats(in.km + slot * D, D, mean);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs.data() + (h * G + g) * D;
        const float qz = qsum[h * G + g];
        float* sc = scores + ((h * G + g) * span + (n - n0)) * W;  // [Hkv, G, span, W]
        float* ml = mlane.data() + (h * G + g) * W;
        for (int64_t t = 0; t < W; ++t) dots[t] = dot_product(qg, kbuf + t * D, D);
        if (centered) {
          const float* qp = qps.data() + (h * G + g) * D;
          for (int64_t i = 0; i < H; ++i) {
            pc[i] = qp[i] * mean[i] + qp[i + H] * mean[i + H];
            ps[i] = qp[i + H] * mean[i] - qp[i] * mean[i + H];
          }
          if (W % 8 == 0) {
            // eight tokens per vector, four chains over the pairs (one would wait on every multiply-add);
            // H is a multiple of 4
            for (int64_t c = 0; c < W; c += 8) {
              V8 part[4] = {};
              for (int64_t i = 0; i < H; i += 4)
                for (int64_t j = 0; j < 4; ++j) {
                  V8 cv, sv;
                  std::memcpy(&cv, cosr + (i + j) * W + c, sizeof(V8));
                  std::memcpy(&sv, sinr + (i + j) * W + c, sizeof(V8));
                  part[j] += pc[i + j] * cv + ps[i + j] * sv;
                }
              const V8 sum = (part[0] + part[1]) + (part[2] + part[3]);
              std::memcpy(offset + c, &sum, sizeof(V8));
            }
          } else {
            for (int64_t t = 0; t < W; ++t) offset[t] = 0.0f;
            for (int64_t i = 0; i < H; ++i)
              for (int64_t t = 0; t < W; ++t) offset[t] += pc[i] * cosr[i * W + t] + ps[i] * sinr[i * W + t];
          }
        }
        for (int64_t t = 0; t < W; ++t) {
          const float x = kscale[t] * dots[t] + kzero[t] * qz + offset[t];
          sc[t] = x;
          ml[t] = x > ml[t] ? x : ml[t];
        }
      }
    }
  }
  for (int64_t hg = 0; hg < HKV * G; ++hg) {
    float mx = kNegInf;
    for (int64_t t = 0; t < W; ++t) mx = std::max(mx, mlane[hg * W + t]);
    m_part[hg] = mx;
  }
  values_pass<kW, kD>(sh, in, b, n0, n1, out_part, m_part, l_part, slot_mass, scores);
}

using RangeFn = void (*)(const Shapes&, const Inputs&, int64_t, int64_t, int64_t, float*, float*, float*,
                         float*, float*);

template <int kW, int kD>
RangeFn pick_range(bool rotated) {
  return rotated ? attend_range_rotated<kW, kD> : attend_range<kW, kD>;
}

// The specialization for (W, D) when there is one (the windows and head dims in use), else the generic loop;
// of the "channel" format's range function, or of the rotated format's.
RangeFn range_fn(int64_t w, int64_t d, bool rotated) {
  if (w == 8 && d == 64) return pick_range<8, 64>(rotated);
  if (w == 8 && d == 128) return pick_range<8, 128>(rotated);
  if (w == 32 && d == 64) return pick_range<32, 64>(rotated);
  if (w == 32 && d == 128) return pick_range<32, 128>(rotated);
  return pick_range<0, 0>(rotated);
}

// Run fn(0..n-1) on the intra-op pool and wait for all of them. The caller claims tasks from the same
// counter as the helpers, so it never waits on a helper that has not started: when one process runs several
// devices (a device mesh, e.g. --xla_force_host_platform_device_count), every pool thread may be busy with
// another device's program, and a caller that only waited for its scheduled tasks deadlocked there. The
// state is shared, so a helper that starts after all the work is done touches nothing of the caller's frame.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  const F* f = &fn;
  auto run = [st, f, n] {
    for (int64_t i; (i = st->next.fetch_add(1)) < n;) {
      (*f)(i);
      if (st->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(st->mu);
        st->cv.notify_all();
      }
    }
  };
  for (int64_t i = 1; i < n; ++i) pool.Schedule([run] { run(); });  // an rvalue: Schedule moves it
  run();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == n; });
}

// Every (row, slot range) by ``attend`` on the pool, then the merge of the ranges' partials.
void run_ranges(ffi::ThreadPool& pool, const Shapes& sh, const Inputs& in, RangeFn attend,
                ffi::ResultBuffer<ffi::F32>& out, ffi::ResultBuffer<ffi::F32>& m_out,
                ffi::ResultBuffer<ffi::F32>& l_out, ffi::ResultBuffer<ffi::F32>& mass_out) {
  const int64_t B = sh.b, HG = sh.hkv * sh.g, D = sh.d, NL = sh.nl;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 8));
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, NL));
  const int64_t chunk = (NL + parts - 1) / parts;
  std::vector<float> out_p(B * parts * HG * D), m_p(B * parts * HG), l_p(B * parts * HG);
  std::vector<float> scores(B * parts * HG * chunk * sh.w);
  float* mass = mass_out->typed_data();
  parallel_for(pool, B * parts, [&](int64_t task) {
    const int64_t b = task / parts, part = task % parts;
    const int64_t n0 = std::min(NL, part * chunk), n1 = std::min(NL, n0 + chunk);
    attend(sh, in, b, n0, n1, out_p.data() + task * HG * D, m_p.data() + task * HG,
                 l_p.data() + task * HG, mass, scores.data() + task * HG * chunk * sh.w);
  });
  // merge the partials of every row and rescale each range's slot masses to the common max
  float* o = out->typed_data();
  float* mo = m_out->typed_data();
  float* lo = l_out->typed_data();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hg = 0; hg < HG; ++hg) {
      float big = kNegInf;
      for (int64_t part = 0; part < parts; ++part) big = std::max(big, m_p[(b * parts + part) * HG + hg]);
      float total = 0.0f;
      float* ob = o + (b * HG + hg) * D;
      std::fill_n(ob, D, 0.0f);
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t task = b * parts + part;
        const float r = std::exp(m_p[task * HG + hg] - big);
        total += r * l_p[task * HG + hg];
        const float* op = out_p.data() + (task * HG + hg) * D;
        for (int64_t d = 0; d < D; ++d) ob[d] += r * op[d];
        const int64_t n0 = std::min(NL, part * chunk), n1 = std::min(NL, n0 + chunk);
        float* ms = mass + (b * HG + hg) * NL;
        for (int64_t n = n0; n < n1; ++n) ms[n] *= r;
      }
      mo[b * HG + hg] = big;
      lo[b * HG + hg] = total;
    }
}

ffi::Error LedgerAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> kc,
                           ffi::Buffer<ffi::F16> ks, ffi::Buffer<ffi::F16> kz, ffi::Buffer<ffi::U8> vc,
                           ffi::Buffer<ffi::F16> vs, ffi::Buffer<ffi::F16> vz, ffi::Buffer<ffi::U8> valid,
                           ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::F32> inv_freq, int64_t window,
                           int64_t bits, int64_t v_bits, ffi::ResultBuffer<ffi::F32> out,
                           ffi::ResultBuffer<ffi::F32> m_out,
                           ffi::ResultBuffer<ffi::F32> l_out, ffi::ResultBuffer<ffi::F32> mass_out) {
  auto qd = q.dimensions();
  auto kd = kc.dimensions();
  auto vd = vc.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5)
    return ffi::Error::InvalidArgument("ledger_attention: bad ranks");
  if (bits != 2 && bits != 4) return ffi::Error::InvalidArgument("ledger_attention: bits must be 2 or 4");
  if (v_bits < 2 || v_bits > 4) return ffi::Error::InvalidArgument("ledger_attention: v_bits must be 2, 3 or 4");
  Shapes sh{qd[0], qd[1], qd[2], qd[3], kd[2], window, bits, 8 / bits, kd[4], 0, v_bits};
  sh.db = sh.d / sh.per;
  if (sh.d > kMaxDim || sh.d % 2 || sh.w > kMaxWindow || sh.g > kMaxGroup || sh.wb * sh.per != sh.w ||
      kd[3] != sh.d || vd[3] != sh.w || vd[4] * 8 != sh.d * v_bits || (v_bits == 3 && sh.d % 8))
    return ffi::Error::InvalidArgument("ledger_attention: unsupported shapes");
  Inputs in{q.typed_data(),  kc.typed_data(), ks.typed_data(),    kz.typed_data(),
            vc.typed_data(), vs.typed_data(), vz.typed_data(),    valid.typed_data(),
            start.typed_data(), inv_freq.typed_data()};
  run_ranges(pool, sh, in, range_fn(sh.w, sh.d, false), out, m_out, l_out, mass_out);
  return ffi::Error::Success();
}

// The shapes of a RotatedTokens ledger (either rotated handler), or why they are unsupported.
const char* rotated_shapes(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::U8>& kc,
                           const ffi::Buffer<ffi::U8>& vc, int64_t k_bits, int64_t v_bits, Shapes* sh) {
  auto qd = q.dimensions();
  auto kd = kc.dimensions();
  auto vd = vc.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5) return "rotated_ledger_attention: bad ranks";
  if (k_bits < 2 || k_bits > 4 || v_bits < 2 || v_bits > 4)
    return "rotated_ledger_attention: bits must be 2, 3 or 4";
  *sh = Shapes{qd[0], qd[1], qd[2], qd[3], kd[2], kd[3], k_bits, 0, 0, 0, v_bits};
  if (sh->d > kMaxDim || sh->d % 8 || sh->w > kMaxWindow || sh->g > kMaxGroup || kd[4] * 8 != sh->d * k_bits ||
      vd[4] * 8 != sh->d * v_bits || vd[3] != sh->w)
    return "rotated_ledger_attention: unsupported shapes";
  return nullptr;
}

ffi::Error RotatedLedgerAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> kc,
                                  ffi::Buffer<ffi::F16> ks, ffi::Buffer<ffi::F16> kz, ffi::Buffer<ffi::U8> vc,
                                  ffi::Buffer<ffi::F16> vs, ffi::Buffer<ffi::F16> vz,
                                  ffi::Buffer<ffi::U8> valid, int64_t k_bits, int64_t v_bits,
                                  ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> m_out,
                                  ffi::ResultBuffer<ffi::F32> l_out, ffi::ResultBuffer<ffi::F32> mass_out) {
  Shapes sh{};
  if (const char* err = rotated_shapes(q, kc, vc, k_bits, v_bits, &sh)) return ffi::Error::InvalidArgument(err);
  Inputs in{q.typed_data(),  kc.typed_data(), ks.typed_data(), kz.typed_data(), vc.typed_data(),
            vs.typed_data(), vz.typed_data(), valid.typed_data(), nullptr, nullptr};
  run_ranges(pool, sh, in, range_fn(sh.w, sh.d, true), out, m_out, l_out, mass_out);
  return ffi::Error::Success();
}

// RotatedTokens with centered keys: the rotated handler's inputs plus each window's pre-RoPE key mean, the
// un-rotated query, the slots' start positions and the RoPE inverse frequencies.
ffi::Error CenteredLedgerAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> kc,
                                   ffi::Buffer<ffi::F16> ks, ffi::Buffer<ffi::F16> kz, ffi::Buffer<ffi::U8> vc,
                                   ffi::Buffer<ffi::F16> vs, ffi::Buffer<ffi::F16> vz,
                                   ffi::Buffer<ffi::U8> valid, ffi::Buffer<ffi::F16> km,
                                   ffi::Buffer<ffi::F32> q_plain, ffi::Buffer<ffi::S32> start,
                                   ffi::Buffer<ffi::F32> inv_freq, int64_t k_bits, int64_t v_bits,
                                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> m_out,
                                   ffi::ResultBuffer<ffi::F32> l_out, ffi::ResultBuffer<ffi::F32> mass_out) {
  Shapes sh{};
  if (const char* err = rotated_shapes(q, kc, vc, k_bits, v_bits, &sh)) return ffi::Error::InvalidArgument(err);
  auto md = km.dimensions();
  if (md.size() != 4 || md[2] != sh.nl || md[3] != sh.d || q_plain.element_count() != q.element_count())
    return ffi::Error::InvalidArgument("centered_ledger_attention: key means or query do not match");
  Inputs in{q.typed_data(),  kc.typed_data(), ks.typed_data(),    kz.typed_data(),
            vc.typed_data(), vs.typed_data(), vz.typed_data(),    valid.typed_data(),
            start.typed_data(), inv_freq.typed_data(), km.typed_data(), q_plain.typed_data()};
  run_ranges(pool, sh, in, range_fn(sh.w, sh.d, true), out, m_out, l_out, mass_out);
  return ffi::Error::Success();
}

// The arguments every handler reads first: the query, one ledger tier's codes and grids, keys then values
// (kc, ks, kz, vc, vs, vz; layouts per format in pallas_kernels.quant), and the per-slot validity.
auto BindQueryAndTier() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // q
      .Arg<ffi::Buffer<ffi::U8>>()   // kc
      .Arg<ffi::Buffer<ffi::F16>>()  // ks
      .Arg<ffi::Buffer<ffi::F16>>()  // kz
      .Arg<ffi::Buffer<ffi::U8>>()   // vc
      .Arg<ffi::Buffer<ffi::F16>>()  // vs
      .Arg<ffi::Buffer<ffi::F16>>()  // vz
      .Arg<ffi::Buffer<ffi::U8>>();  // valid
}

// The split-K partials every handler returns: out, m, l and the per-slot attention mass.
template <typename Binding>
auto ReturnPartials(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Ret<ffi::Buffer<ffi::F32>>()   // out
      .template Ret<ffi::Buffer<ffi::F32>>()   // m
      .template Ret<ffi::Buffer<ffi::F32>>()   // l
      .template Ret<ffi::Buffer<ffi::F32>>();  // slot_mass
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QevictLedgerAttention, LedgerAttention,
                              ReturnPartials(BindQueryAndTier()
                                                 .Arg<ffi::Buffer<ffi::S32>>()  // start
                                                 .Arg<ffi::Buffer<ffi::F32>>()  // inv_freq
                                                 .Attr<int64_t>("window")
                                                 .Attr<int64_t>("bits")
                                                 .Attr<int64_t>("v_bits")));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QevictRotatedLedgerAttention, RotatedLedgerAttention,
                              ReturnPartials(BindQueryAndTier().Attr<int64_t>("k_bits").Attr<int64_t>("v_bits")));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QevictCenteredLedgerAttention, CenteredLedgerAttention,
                              ReturnPartials(BindQueryAndTier()
                                                 .Arg<ffi::Buffer<ffi::F16>>()  // k_mean
                                                 .Arg<ffi::Buffer<ffi::F32>>()  // q_plain
                                                 .Arg<ffi::Buffer<ffi::S32>>()  // start
                                                 .Arg<ffi::Buffer<ffi::F32>>()  // inv_freq
                                                 .Attr<int64_t>("k_bits")
                                                 .Attr<int64_t>("v_bits")));
