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

// Expand the codes of one token's D channels (per-token groups, pallas_kernels.quant.pack_tokens): 2 or 4
// bits interleaved, 3 bits as a 2-bit plane of D/4 bytes then a 1-bit plane of D/8 bytes.
inline void expand_token(const uint8_t* bytes, int64_t d, int64_t bits, float* out) {
  if (bits != 3) {
    expand(bytes, d * bits / 8, bits, out);
    return;
  }
  expand(bytes, d / 4, 2, out);
  const uint8_t* high = bytes + d / 4;
  for (int64_t j = 0; j < d / 8; ++j)
    for (int k = 0; k < 8; ++k) out[8 * j + k] += static_cast<float>(((high[j] >> k) & 1) << 2);
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

typedef float V8 __attribute__((vector_size(32)));  // eight floats (GCC/Clang vector extension)

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
  alignas(64) float vbuf[kMaxWindow * kMaxDim];  // [W, D] value codes of one slot
  alignas(64) float wts[kMaxGroup * kMaxWindow];
  alignas(64) float vscale[kMaxWindow], vzero[kMaxWindow];
  for (int64_t h = 0; h < HKV; ++h) {
    const int64_t bh = b * HKV + h;
    float* m = m_part + h * G;
    float* l = l_part + h * G;
    float* out = out_part + h * G * D;
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
      for (int64_t t = 0; t < W; ++t) {
        vscale[t] = half_to_float(in.vs[slot * W + t]);
        vzero[t] = half_to_float(in.vz[slot * W + t]);
      }
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
      for (int64_t t = 0; t < W; ++t) expand_token(in.vc + (slot * W + t) * vtoken, D, vbits, vbuf + t * D);
      for (int64_t g = 0; g < G; ++g) {
        float* o = out + g * D;
        for (int64_t t = 0; t < W; ++t) {
          const float wt = wts[g * W + t];
          const float* v = vbuf + t * D;
          for (int64_t d = 0; d < D; ++d) o[d] += wt * v[d];
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      l[g] = sum_inplace(lsum + g * W, W);
      const float z = sum_inplace(zsum + g * W, W);
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += z;
    }
  }
}

// attend_range for the RotatedTokens format: slots [n0, n1) of row b; q (already rotated by the caller)
// against keys with one grid per token, no RoPE.
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
  alignas(64) float kscale[kMaxWindow], kzero[kMaxWindow];
  // centered format: RoPE tables of the slot [H, W], the window's key mean RoPE'd at its tokens [D, W], and
  // the logit offsets q . RoPE_t(mean) [W]
  alignas(64) float cos_oT[kMaxDim / 2 * kMaxWindow], sin_oT[kMaxDim / 2 * kMaxWindow];
  alignas(64) float cosr[kMaxDim / 2 * kMaxWindow], sinr[kMaxDim / 2 * kMaxWindow];
  alignas(64) float mrot[kMaxDim * kMaxWindow];
  alignas(64) float offset[kMaxWindow] = {};
  std::vector<float> qs(HKV * G * D), qsum(HKV * G, 0.0f);  // scaled queries [Hkv, G, D] and their sums
  std::vector<float> qps(centered ? HKV * G * D : 0);    // scaled un-rotated queries
  for (int64_t x = 0; x < HKV * G * D; ++x) {
    qs[x] = in.q[b * HKV * G * D + x] * scale;
    qsum[x / D] += qs[x];
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
      for (int64_t t = 0; t < W; ++t) {
        expand_token(in.kc + (slot * W + t) * ktoken, D, sh.bits, kbuf + t * D);
        kscale[t] = half_to_float(in.ks[slot * W + t]);
        kzero[t] = half_to_float(in.kz[slot * W + t]);
      }
      if (centered)
        for (int64_t i = 0; i < H; ++i) {
          const float m1 = half_to_float(in.km[slot * D + i]), m2 = half_to_float(in.km[slot * D + i + H]);
          for (int64_t t = 0; t < W; ++t) {
            mrot[i * W + t] = m1 * cosr[i * W + t] - m2 * sinr[i * W + t];
            mrot[(i + H) * W + t] = m2 * cosr[i * W + t] + m1 * sinr[i * W + t];
          }
        }
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs.data() + (h * G + g) * D;
        const float qz = qsum[h * G + g];
        float* sc = scores + ((h * G + g) * span + (n - n0)) * W;  // [Hkv, G, span, W]
        float* ml = mlane.data() + (h * G + g) * W;
        if (centered) {
          const float* qp = qps.data() + (h * G + g) * D;
          for (int64_t t = 0; t < W; ++t) offset[t] = 0.0f;
          for (int64_t d = 0; d < D; ++d)
            for (int64_t t = 0; t < W; ++t) offset[t] += qp[d] * mrot[d * W + t];
        }
        for (int64_t t = 0; t < W; ++t) {
          const float* kt = kbuf + t * D;
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
          const float x = kscale[t] * dot + kzero[t] * qz + offset[t];
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
