// The CPU projections `x W^T + b` on AVX-512 with the weight packed once into panels of 32
// output columns (`[ceil(out / 32), in, 32]`, zero-padded): a register-blocked kernel that holds
// 14 rows x 32 columns of the result in 28 vector registers, streams a panel once per 14 rows
// from L2, and asks for the thread's next panel while it works on this one. At the decode
// step's 64 rows the weights come from memory each step (the 27M-parameter model streams
// ~107 MB of them), where oneDNN's inner product reached ~350-400 GFLOP/s on two Zen 5 cores
// and this kernel ~420-470 (decision 060). Rows run in chunks of 256, so a prefill's rows stay
// in L2 while the panels go by. Built by build.rs; the Rust side is `runner/cpu_kernels.rs`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "shim.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;     // output columns per panel: two vectors of 16 floats
constexpr int64_t kRowChunk = 256;  // rows per chunk (a chunk of x stays in L2)
constexpr int64_t kDepth = 512;     // inputs per slice of a tile's sums

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")

// Rows [0, R) of x (row stride ldx) times panel p ([k, 32]) into y (row stride ldy; `cols`
// of the panel's 32 columns are stored), plus bias (`cols` floats, or null). The inputs run in
// slices of kDepth, each summed in registers and added to y after: a sum of ~k/256 partial
// sums rounds closer to the exact product than one running sum over all k (within 1e-5 of
// MKL's blocked sums on the engine's log-probs at k = 2048). `ask`, when given, is this tile's
// share of the next panel (`share` of its rows of 32 floats), asked for in L2 one row every
// `every` inputs: the panel's tiles spread the next panel's lines between them, so the misses
// in flight stay within what the core tracks.
template <int R>
inline __attribute__((always_inline)) void tile(const float* x, int64_t ldx, const float* p,
                                                int64_t k, const float* bias, float* y,
                                                int64_t ldy, int64_t cols, const float* ask,
                                                int64_t share, int64_t every) {
  int64_t asked = 0, wait = 0;
  const __mmask16 m0 = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? __mmask16(0xFFFF)
                       : cols > 16 ? __mmask16((1u << (cols - 16)) - 1)
                                   : __mmask16(0);
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    const int64_t k1 = std::min(k, k0 + kDepth);
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = k0; i < k1; ++i) {
      const __m512 w0 = _mm512_loadu_ps(p + i * kPanel);
      const __m512 w1 = _mm512_loadu_ps(p + i * kPanel + 16);
      if (ask != nullptr && asked < share && --wait < 0) {
        _mm_prefetch(reinterpret_cast<const char*>(ask + asked * kPanel), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(ask + asked * kPanel + 16), _MM_HINT_T1);
        ++asked;
        wait = every - 1;
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 xr = _mm512_set1_ps(x[r * ldx + i]);
        acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
      }
    }
    // The first slice starts from the bias (or zero), later ones from what y holds.
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (k0 == 0 && bias != nullptr) {
      b0 = _mm512_maskz_loadu_ps(m0, bias);
      b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    }
    for (int r = 0; r < R; ++r) {
      float* yr = y + r * ldy;
      if (k0 > 0) {
        b0 = _mm512_maskz_loadu_ps(m0, yr);
        b1 = _mm512_maskz_loadu_ps(m1, yr + 16);
      }
      _mm512_mask_storeu_ps(yr, m0, _mm512_add_ps(b0, acc[r][0]));
      _mm512_mask_storeu_ps(yr + 16, m1, _mm512_add_ps(b1, acc[r][1]));
    }
  }
}

// Rows [0, rows) of one panel: 14 at a time, then 8, 4, 2, 1; `next` (or null) the panel to
// ask for meanwhile, each tile its share in proportion to its rows (its time).
void panel_rows(const float* x, int64_t ldx, int64_t rows, const float* p, int64_t k,
                const float* bias, float* y, int64_t ldy, int64_t cols, const float* next) {
  int64_t r = 0;
  const auto run = [&](auto size) {
    constexpr int kRows = decltype(size)::value;
    const int64_t from = k * r / rows, to = k * (r + kRows) / rows;
    const int64_t share = to - from;
    const float* ask = next != nullptr && share > 0 ? next + from * kPanel : nullptr;
    const int64_t every = std::max<int64_t>(1, k / std::max<int64_t>(1, share));
    tile<kRows>(x + r * ldx, ldx, p, k, bias, y + r * ldy, ldy, cols, ask, share, every);
    r += kRows;
  };
  while (r + 14 <= rows) run(std::integral_constant<int, 14>());
  if (r + 8 <= rows) run(std::integral_constant<int, 8>());
  if (r + 4 <= rows) run(std::integral_constant<int, 4>());
  if (r + 2 <= rows) run(std::integral_constant<int, 2>());
  if (r + 1 <= rows) run(std::integral_constant<int, 1>());
}

#pragma GCC pop_options
#endif

}  // namespace

extern "C" {

// Whether this CPU runs the kernel (AVX-512F).
int rtrun_gemm_supported() { return rtrun::has_avx512() ? 1 : 0; }

// `weight` ([out, in], float32, CPU) packed into panels `[ceil(out / 32), in, 32]` (column c of
// the weight's row n at [n / 32, c, n % 32]; padding zeros). `*out` receives a new tensor.
int rtrun_gemm_pack(const at::Tensor* weight, at::Tensor** out, char* err, size_t len) {
  return rtrun::return_tensor(out, err, len, [&] {
    if (weight->dim() != 2 || weight->scalar_type() != at::kFloat || !weight->device().is_cpu()) {
      throw std::invalid_argument("packing wants a 2-D float32 CPU weight, found " +
                                  c10::str(weight->sizes()) + " " +
                                  c10::toString(weight->scalar_type()));
    }
    const int64_t n = weight->size(0), k = weight->size(1);
    const int64_t panels = (n + kPanel - 1) / kPanel;
    at::Tensor padded = at::zeros({panels * kPanel, k}, weight->options());
    padded.narrow(0, 0, n).copy_(*weight);
    // [panels, 32, k] -> [panels, k, 32]
    return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
  });
}

// `x W^T + b` for rows `x: [T, in]` (float32, last dimension contiguous) and a weight packed by
// `rtrun_gemm_pack` for `out` columns; `bias` ([out]) may be null. `*out_tensor` receives a
// new contiguous `[T, out]`.
int rtrun_gemm(const at::Tensor* x, const at::Tensor* packed, const at::Tensor* bias,
               int64_t out, at::Tensor** out_tensor, char* err, size_t len) {
  return rtrun::return_tensor(out_tensor, err, len, [&]() -> at::Tensor {
    rtrun::check(*x, "the projection's input", 2, at::kFloat);
    const int64_t rows = x->size(0), k = x->size(1);
    const int64_t panels = (out + kPanel - 1) / kPanel;
    if (packed->dim() != 3 || packed->scalar_type() != at::kFloat || !packed->is_contiguous() ||
        packed->size(0) != panels || packed->size(1) != k || packed->size(2) != kPanel ||
        out <= 0) {
      throw std::invalid_argument("the packed weight " + c10::str(packed->sizes()) +
                                  " does not fit rows " + c10::str(x->sizes()) + " and " +
                                  std::to_string(out) + " outputs");
    }
    if (bias != nullptr) {
      rtrun::check(*bias, "the projection's bias", 1, at::kFloat);
      if (bias->size(0) != out) throw std::invalid_argument("the bias does not fit the outputs");
    }
    if (!rtrun::has_avx512()) throw std::invalid_argument("the packed projection needs AVX-512");
    if (k == 0) {
      // No inputs: the bias alone (the tiles would write nothing).
      at::Tensor y = at::zeros({rows, out}, x->options());
      if (bias != nullptr) y.add_(*bias);
      return y;
    }
    at::Tensor y = at::empty({rows, out}, x->options());
#if defined(__x86_64__)
    const float* xp = x->data_ptr<float>();
    const float* pp = packed->data_ptr<float>();
    const float* bp = bias != nullptr ? bias->data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const int64_t ldx = x->stride(0);
    // Panels split over the intra-op threads in contiguous ranges, so each thread asks for the
    // next panel of its own range.
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
        const int64_t chunk = std::min(kRowChunk, rows - r0);
        for (int64_t p = begin; p < end; ++p) {
          const int64_t cols = std::min(kPanel, out - p * kPanel);
          const float* next = p + 1 < end ? pp + (p + 1) * k * kPanel : nullptr;
          panel_rows(xp + r0 * ldx, ldx, chunk, pp + p * k * kPanel, k,
                     bp != nullptr ? bp + p * kPanel : nullptr, yp + r0 * out + p * kPanel, out,
                     cols, next);
        }
      }
    });
#endif
    return y;
  });
}
}
