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

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -1e30f;  // models.attention.NEG_INF
constexpr int kMaxDim = 256;       // head_dim
constexpr int kMaxWindow = 64;     // W
constexpr int kMaxGroup = 16;      // query heads per KV head

struct Shapes {
  int64_t b, hkv, g, d, nl, w, bits, per, wb, db;
};

struct Inputs {
  const float* q;         // [B, Hkv, G, D]
  const uint8_t* kc;      // [B, Hkv, NL, D, Wb]
  const float* ks;        // [B, Hkv, NL, D]
  const float* kz;        // [B, Hkv, NL, D]
  const uint8_t* vc;      // [B, Hkv, NL, W, Db]
  const float* vs;        // [B, Hkv, NL, W]
  const float* vz;        // [B, Hkv, NL, W]
  const uint8_t* valid;   // [B, NL]
  const float* cos_s;     // [B, NL, D/2] cos of the slot-start angles
  const float* sin_s;     // [B, NL, D/2]
  const float* cos_o;     // [W, D/2] cos of the offset angles
  const float* sin_o;     // [W, D/2]
};

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

// One thread's share: slots [n0, n1) of row b, every KV head and query head. Writes the partial
// (out [Hkv, G, D] unnormalized, m [Hkv, G], l [Hkv, G]) and slot_mass relative to its own max.
void attend_range(const Shapes& sh, const Inputs& in, int64_t b, int64_t n0, int64_t n1, float* out_part,
                  float* m_part, float* l_part, float* slot_mass, float* scores) {
  const int64_t G = sh.g, D = sh.d, W = sh.w, H = D / 2, NL = sh.nl;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  alignas(64) float cosr[kMaxDim / 2 * kMaxWindow];  // [H, W] rotation of each (pair, offset) in the slot
  alignas(64) float sinr[kMaxDim / 2 * kMaxWindow];
  alignas(64) float cos_oT[kMaxDim / 2 * kMaxWindow];  // offset tables transposed to [H, W]
  alignas(64) float sin_oT[kMaxDim / 2 * kMaxWindow];
  alignas(64) float kbuf[kMaxDim * kMaxWindow];  // [D, W] dequantized pre-RoPE keys of one slot
  alignas(64) float vbuf[kMaxWindow * kMaxDim];  // [W, D] value codes of one slot
  alignas(64) float acc[kMaxGroup * kMaxWindow];
  alignas(64) float qs[kMaxGroup * kMaxDim];
  alignas(64) float wts[kMaxGroup * kMaxWindow];
  for (int64_t t = 0; t < W; ++t)
    for (int64_t i = 0; i < H; ++i) {
      cos_oT[i * W + t] = in.cos_o[t * H + i];
      sin_oT[i * W + t] = in.sin_o[t * H + i];
    }
  const uint8_t* valid = in.valid + b * NL;
  const int64_t span = n1 - n0;
  for (int64_t h = 0; h < sh.hkv; ++h) {
    const int64_t bh = b * sh.hkv + h;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) qs[g * D + d] = in.q[(bh * G + g) * D + d] * scale;
    float* m = m_part + h * G;
    float* l = l_part + h * G;
    float* out = out_part + h * G * D;
    float* sc = scores + h * G * span * W;  // [G, span, W]
    for (int64_t g = 0; g < G; ++g) m[g] = kNegInf;
    // pass 1: logits of every valid token
    for (int64_t n = n0; n < n1; ++n) {
      if (!valid[n]) continue;
      const int64_t slot = bh * NL + n;
      const float* cs = in.cos_s + (b * NL + n) * H;
      const float* ss = in.sin_s + (b * NL + n) * H;
      for (int64_t i = 0; i < H; ++i)
        for (int64_t t = 0; t < W; ++t) {
          cosr[i * W + t] = cs[i] * cos_oT[i * W + t] - ss[i] * sin_oT[i * W + t];
          sinr[i * W + t] = ss[i] * cos_oT[i * W + t] + cs[i] * sin_oT[i * W + t];
        }
      expand(in.kc + slot * D * sh.wb, D * sh.wb, sh.bits, kbuf);
      const float* kscale = in.ks + slot * D;
      const float* kzero = in.kz + slot * D;
      for (int64_t d = 0; d < D; ++d)
        for (int64_t t = 0; t < W; ++t) kbuf[d * W + t] = kbuf[d * W + t] * kscale[d] + kzero[d];
      std::fill_n(acc, G * W, 0.0f);
      for (int64_t i = 0; i < H; ++i) {
        const float* k1 = kbuf + i * W;
        const float* k2 = kbuf + (i + H) * W;
        const float* c = cosr + i * W;
        const float* s = sinr + i * W;
        for (int64_t g = 0; g < G; ++g) {
          const float q1 = qs[g * D + i], q2 = qs[g * D + i + H];
          float* a = acc + g * W;
          for (int64_t t = 0; t < W; ++t) {
            const float r1 = k1[t] * c[t] - k2[t] * s[t];
            const float r2 = k2[t] * c[t] + k1[t] * s[t];
            a[t] += q1 * r1 + q2 * r2;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < W; ++t) {
          const float x = acc[g * W + t];
          sc[(g * span + (n - n0)) * W + t] = x;
          m[g] = std::max(m[g], x);
        }
    }
    // pass 2: probabilities, per-slot mass and values from their codes
    float zsum[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) {
      l[g] = 0.0f;
      zsum[g] = 0.0f;
    }
    std::fill_n(out, G * D, 0.0f);
    for (int64_t n = n0; n < n1; ++n) {
      float* mass = slot_mass + (bh * G) * NL + n;  // [G] with stride NL
      if (!valid[n]) {
        for (int64_t g = 0; g < G; ++g) mass[g * NL] = 0.0f;
        continue;
      }
      const int64_t slot = bh * NL + n;
      const float* vscale = in.vs + slot * W;
      const float* vzero = in.vz + slot * W;
      for (int64_t g = 0; g < G; ++g) {
        float sum = 0.0f, zs = 0.0f;
        const float* x = sc + (g * span + (n - n0)) * W;
        for (int64_t t = 0; t < W; ++t) {
          const float p = std::exp(x[t] - m[g]);
          sum += p;
          zs += p * vzero[t];
          wts[g * W + t] = p * vscale[t];
        }
        mass[g * NL] = sum;
        l[g] += sum;
        zsum[g] += zs;
      }
      expand(in.vc + slot * W * sh.db, W * sh.db, sh.bits, vbuf);
      for (int64_t g = 0; g < G; ++g) {
        float* o = out + g * D;
        for (int64_t t = 0; t < W; ++t) {
          const float wt = wts[g * W + t];
          const float* v = vbuf + t * D;
          for (int64_t d = 0; d < D; ++d) o[d] += wt * v[d];
        }
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += zsum[g];
  }
}

// Run fn(0..n-1) on the intra-op pool (the caller takes task 0) and wait for all of them.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F fn) {
  std::mutex mu;
  std::condition_variable cv;
  int64_t pending = n - 1;
  for (int64_t i = 1; i < n; ++i)
    pool.Schedule([&, i] {
      fn(i);
      std::lock_guard<std::mutex> lock(mu);
      if (--pending == 0) cv.notify_one();
    });
  fn(0);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return pending == 0; });
}

ffi::Error LedgerAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> kc,
                           ffi::Buffer<ffi::F32> ks, ffi::Buffer<ffi::F32> kz, ffi::Buffer<ffi::U8> vc,
                           ffi::Buffer<ffi::F32> vs, ffi::Buffer<ffi::F32> vz, ffi::Buffer<ffi::U8> valid,
                           ffi::Buffer<ffi::F32> cos_s, ffi::Buffer<ffi::F32> sin_s,
                           ffi::Buffer<ffi::F32> cos_o, ffi::Buffer<ffi::F32> sin_o, int64_t window,
                           int64_t bits, ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> m_out,
                           ffi::ResultBuffer<ffi::F32> l_out, ffi::ResultBuffer<ffi::F32> mass_out) {
  auto qd = q.dimensions();
  auto kd = kc.dimensions();
  if (qd.size() != 4 || kd.size() != 5) return ffi::Error::InvalidArgument("ledger_attention: bad ranks");
  if (bits != 2 && bits != 4) return ffi::Error::InvalidArgument("ledger_attention: bits must be 2 or 4");
  Shapes sh{qd[0], qd[1], qd[2], qd[3], kd[2], window, bits, 8 / bits, kd[4], 0};
  sh.db = sh.d / sh.per;
  if (sh.d > kMaxDim || sh.d % 2 || sh.w > kMaxWindow || sh.g > kMaxGroup || sh.wb * sh.per != sh.w ||
      kd[3] != sh.d)
    return ffi::Error::InvalidArgument("ledger_attention: unsupported shapes");
  Inputs in{q.typed_data(),  kc.typed_data(),    ks.typed_data(),    kz.typed_data(),
            vc.typed_data(), vs.typed_data(),    vz.typed_data(),    valid.typed_data(),
            cos_s.typed_data(), sin_s.typed_data(), cos_o.typed_data(), sin_o.typed_data()};
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
    attend_range(sh, in, b, n0, n1, out_p.data() + task * HG * D, m_p.data() + task * HG,
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
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QevictLedgerAttention, LedgerAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::U8>>()   // kc
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ks
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kz
                                  .Arg<ffi::Buffer<ffi::U8>>()   // vc
                                  .Arg<ffi::Buffer<ffi::F32>>()  // vs
                                  .Arg<ffi::Buffer<ffi::F32>>()  // vz
                                  .Arg<ffi::Buffer<ffi::U8>>()   // valid
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos_s
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin_s
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos_o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin_o
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("bits")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m
                                  .Ret<ffi::Buffer<ffi::F32>>()  // l
                                  .Ret<ffi::Buffer<ffi::F32>>());  // slot_mass
