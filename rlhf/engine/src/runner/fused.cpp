// Fused element-wise steps of the CPU decode step: RMSNorm, RoPE on the packed query/key rows,
// and SiLU(gate) * up. libtorch runs each as 2-7 operators, and at the decode step's sizes
// (a few thousand to a hundred thousand floats) an operator's fixed cost outweighs its
// arithmetic. Compiled three times (baseline x86-64, AVX2+FMA and AVX-512F, picked at run
// time) without contracting multiplies and adds, and with every sum in explicit lanes, so all
// builds give the same bits. Built by build.rs; the Rust side is `runner/cpu_kernels.rs`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "shim.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace {

// A float32 row argument (`rtrun::check`).
void check_rows(const at::Tensor& t, const char* name, int64_t dims) {
  rtrun::check(t, name, dims, at::kFloat);
}

using rtrun::has_avx2;

#if defined(__x86_64__)
#define RTRUN_AVX2 __attribute__((target("avx2,fma")))
#define RTRUN_AVX512 __attribute__((target("avx512f,avx2,fma")))
#else
#define RTRUN_AVX2
#define RTRUN_AVX512
#endif

// The builds of a kernel: `NAME##_avx512`, `NAME##_avx2` and `NAME##_base`, from one
// always-inline body.
#define RTRUN_BUILDS(NAME, PARAMS, ARGS)                       \
  RTRUN_AVX512 void NAME##_avx512 PARAMS { NAME##_body ARGS; } \
  RTRUN_AVX2 void NAME##_avx2 PARAMS { NAME##_body ARGS; }     \
  void NAME##_base PARAMS { NAME##_body ARGS; }

// The instruction sets this CPU runs, widest first.
enum class Isa { kAvx512, kAvx2, kBase };
Isa isa() {
  static const Isa found = rtrun::has_avx512() ? Isa::kAvx512
                           : has_avx2()        ? Isa::kAvx2
                                               : Isa::kBase;
  return found;
}

// Calls the build of kernel NAME for `which` (an Isa) with ARGS.
#define RTRUN_CALL(which, NAME, ARGS)                   \
  switch (which) {                                      \
    case Isa::kAvx512: NAME##_avx512 ARGS; break;       \
    case Isa::kAvx2: NAME##_avx2 ARGS; break;           \
    case Isa::kBase: NAME##_base ARGS; break;           \
  }

constexpr int kLanes = 8;

// y[r, :] = w * (x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps))) for rows [begin, end), after
// x[r, :] += add[r, :] in place when `add` is given (the residual sum the norm reads).
inline __attribute__((always_inline)) void rms_norm_body(float* x, int64_t x_row,
                                                         const float* add, int64_t add_row,
                                                         const float* w, float* y, int64_t h,
                                                         float eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    float* xr = x + r * x_row;
    if (add != nullptr) {
      const float* ar = add + r * add_row;
      for (int64_t j = 0; j < h; ++j) xr[j] = xr[j] + ar[j];
    }
    float lanes[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + kLanes <= h; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) lanes[l] += xr[i + l] * xr[i + l];
    }
    for (int l = 0; i < h; ++i, ++l) lanes[l] += xr[i] * xr[i];
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
    float* yr = y + r * h;
    for (int64_t j = 0; j < h; ++j) yr[j] = w[j] * (xr[j] * inverse);
  }
}
RTRUN_BUILDS(rms_norm,
             (float* x, int64_t x_row, const float* add, int64_t add_row, const float* w,
              float* y, int64_t h, float eps, int64_t begin, int64_t end),
             (x, x_row, add, add_row, w, y, h, eps, begin, end))

// RoPE (rotate-half form) on rows [begin, end) of x: [rows, heads, d] (row stride x_row, head
// stride x_head); cos, sin: [rows, d] (row strides c_row, s_row). y: [rows, heads, d].
inline __attribute__((always_inline)) void rotary_body(const float* x, int64_t x_row,
                                                       int64_t x_head, const float* cos,
                                                       int64_t c_row, const float* sin,
                                                       int64_t s_row, float* y, int64_t heads,
                                                       int64_t d, int64_t begin, int64_t end) {
  const int64_t half = d / 2;
  for (int64_t r = begin; r < end; ++r) {
    const float* c = cos + r * c_row;
    const float* s = sin + r * s_row;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xh = x + r * x_row + h * x_head;
      float* yh = y + (r * heads + h) * d;
      for (int64_t i = 0; i < half; ++i) yh[i] = xh[i] * c[i] + (-xh[i + half]) * s[i];
      for (int64_t i = half; i < d; ++i) yh[i] = xh[i] * c[i] + xh[i - half] * s[i];
    }
  }
}
RTRUN_BUILDS(rotary,
            (const float* x, int64_t x_row, int64_t x_head, const float* cos, int64_t c_row,
             const float* sin, int64_t s_row, float* y, int64_t heads, int64_t d, int64_t begin,
             int64_t end),
            (x, x_row, x_head, cos, c_row, sin, s_row, y, heads, d, begin, end))

using rtrun::exp_nonpositive;

// y[r, :] = silu(x[r, :width]) * x[r, width:] for rows [begin, end); silu(g) = g * sigmoid(g),
// with sigmoid from e = exp(-|g|) (1 / (1 + e), or e / (1 + e) below 0) so that the exponent
// never overflows.
inline __attribute__((always_inline)) void silu_mul_body(const float* __restrict x,
                                                         int64_t x_row, float* __restrict y,
                                                         int64_t width, int64_t begin,
                                                         int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* gate = x + r * x_row;
    const float* up = gate + width;
    float* yr = y + r * width;
    for (int64_t j = 0; j < width; ++j) {
      const float g = gate[j];
      const float e = exp_nonpositive(-std::fabs(g));
      const float positive = 1.0f / (1.0f + e);
      const float negative = e * positive;
      const float sigmoid = g < 0.0f ? negative : positive;
      yr[j] = (g * sigmoid) * up[j];
    }
  }
}
RTRUN_BUILDS(silu_mul, (const float* x, int64_t x_row, float* y, int64_t width, int64_t begin,
                       int64_t end),
            (x, x_row, y, width, begin, end))

// Runs f over rows [0, rows): on this thread below ~64k floats of work (as libtorch's own
// grain), else split over the intra-op threads with at least ~32k floats each.
template <typename F>
void for_rows(int64_t rows, int64_t per_row, const F& f) {
  per_row = std::max<int64_t>(1, per_row);
  if (rows * per_row < 65536) {
    f(0, rows);
    return;
  }
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / per_row), f);
}

}  // namespace

extern "C" {

// Whether `t` is the one handle to its tensor and the tensor the one holder of its storage:
// then nothing else can write the memory while the Rust side lends it out as a slice.
int rtrun_sole_owner(const at::Tensor* t) {
  return t->defined() && t->use_count() == 1 && t->storage().use_count() == 1 ? 1 : 0;
}

// Runs body(ctx, begin, end) over chunks of [0, n) on the intra-op threads (on this thread alone
// below `grain` items): host work of a step, such as sampling its rows, on the threads the
// step's operators use, rather than on a second pool that would compete with them for the
// cores. `body` must not throw or unwind.
int rtrun_parallel_for(int64_t n, int64_t grain, void (*body)(void*, int64_t, int64_t),
                       void* ctx, char* err, size_t len) {
  return rtrun::run(err, len, [&] {
    if (n <= 0) return;
    if (n <= grain) {
      body(ctx, 0, n);
      return;
    }
    at::parallel_for(0, n, std::max<int64_t>(1, grain), [&](int64_t b, int64_t e) {
      body(ctx, b, e);
    });
  });
}

// x: [rows, h] (row stride any), w: [h]; `*out` receives a new contiguous [rows, h]. With
// `add` ([rows, h], row stride any), x becomes x + add in place first and is normed after: the
// residual sum and the next norm in one pass, the sum the same bits as libtorch's add.
int rtrun_rms_norm(const at::Tensor* x, const at::Tensor* add, const at::Tensor* w, double eps,
                   at::Tensor** out, char* err, size_t len) {
  return rtrun::return_tensor(out, err, len, [&] {
    check_rows(*x, "the norm's input", 2);
    check_rows(*w, "the norm's weight", 1);
    const int64_t rows = x->size(0), h = x->size(1);
    if (w->size(0) != h) throw std::invalid_argument("the norm's weight does not fit its input");
    const float* ap = nullptr;
    int64_t a_row = 0;
    if (add != nullptr) {
      check_rows(*add, "the residual added before the norm", 2);
      if (add->sizes() != x->sizes() || (rows > 1 && x->stride(0) < h)) {
        throw std::invalid_argument("adding " + c10::str(add->sizes()) + " in place to rows " +
                                    c10::str(x->sizes()) + " with strides " +
                                    c10::str(x->strides()) + " that do not own their memory");
      }
      ap = add->data_ptr<float>();
      a_row = add->stride(0);
    }
    at::Tensor y = at::empty({rows, h}, x->options());
    float* xp = x->data_ptr<float>();
    const float* wp = w->data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t x_row = x->stride(0);
    const Isa which = isa();
    for_rows(rows, h, [&](int64_t b, int64_t e) {
      RTRUN_CALL(which, rms_norm, (xp, x_row, ap, a_row, wp, yp, h, static_cast<float>(eps), b, e));
    });
    return y;
  });
}

// x: [rows, heads, d] (last dimension contiguous), cos and sin: [rows, d] (rows strided as
// they come); `*out` receives a new contiguous [rows, heads, d].
int rtrun_rotary(const at::Tensor* x, const at::Tensor* cos, const at::Tensor* sin,
                 at::Tensor** out, char* err, size_t len) {
  return rtrun::return_tensor(out, err, len, [&] {
    check_rows(*x, "the rotated rows", 3);
    check_rows(*cos, "cos", 2);
    check_rows(*sin, "sin", 2);
    const int64_t rows = x->size(0), heads = x->size(1), d = x->size(2);
    if (d % 2 != 0 || cos->size(0) != rows || cos->size(1) != d || sin->sizes() != cos->sizes()) {
      throw std::invalid_argument("cos and sin should be [rows, head_dim] of the rotated rows, "
                                  "head_dim even; found " + c10::str(cos->sizes()) + " for " +
                                  c10::str(x->sizes()));
    }
    const float* xp = x->data_ptr<float>();
    const float* cp = cos->data_ptr<float>();
    const float* sp = sin->data_ptr<float>();
    at::Tensor y = at::empty({rows, heads, d}, x->options());
    float* yp = y.data_ptr<float>();
    const int64_t x_row = x->stride(0), x_head = x->stride(1);
    const int64_t c_row = cos->stride(0), s_row = sin->stride(0);
    const Isa which = isa();
    for_rows(rows, heads * d, [&](int64_t b, int64_t e) {
      RTRUN_CALL(which, rotary, (xp, x_row, x_head, cp, c_row, sp, s_row, yp, heads, d, b, e));
    });
    return y;
  });
}

// x: [rows, 2 * width] (gate then up); `*out` receives a new contiguous [rows, width]. One
// pass at every size: libtorch's silu and mul are two passes over rows that, from a prefill's
// size on, no longer fit the cache (27M-parameter model, 64 prompts on two Zen 5 cores: 25 ms
// of SiLU in the decode and 10 in the prefill against 15 and 9 here).
int rtrun_silu_mul(const at::Tensor* x, at::Tensor** out, char* err, size_t len) {
  return rtrun::return_tensor(out, err, len, [&] {
    check_rows(*x, "the gate/up rows", 2);
    const int64_t rows = x->size(0), width = x->size(1) / 2;
    if (x->size(1) % 2 != 0) throw std::invalid_argument("the gate/up rows have an odd width");
    const float* xp = x->data_ptr<float>();
    at::Tensor y = at::empty({rows, width}, x->options());
    float* yp = y.data_ptr<float>();
    const int64_t x_row = x->stride(0);
    const Isa which = isa();
    for_rows(rows, 4 * width, [&](int64_t b, int64_t e) {
      RTRUN_CALL(which, silu_mul, (xp, x_row, yp, width, b, e));
    });
    return y;
  });
}
}
