// What the runner's C++ shims share: the calling convention of their `extern "C"` functions, the
// check of their tensor arguments, the CPU feature test and a vectorisable exp.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

namespace rtrun {

// Runs `make` (which returns a tensor) and hands the result to the caller as a new tensor in
// `*out`; returns 0. If it throws, copies the message into `err` (at most `len` bytes,
// NUL-terminated) and returns -1.
// Runs `work` (which returns nothing); returns 0. If it throws, copies the message into `err`
// (at most `len` bytes, NUL-terminated) and returns -1.
template <typename F>
int run(char* err, size_t len, F&& work) {
  try {
    std::forward<F>(work)();
    return 0;
  } catch (const std::exception& e) {
    if (len > 0) {
      std::strncpy(err, e.what(), len - 1);
      err[len - 1] = 0;
    }
    return -1;
  }
}

// Runs `make` (which returns a tensor) and hands the result to the caller as a new tensor in
// `*out`, as `run` does.
template <typename F>
int return_tensor(at::Tensor** out, char* err, size_t len, F&& make) {
  return run(err, len, [&] { *out = new at::Tensor(std::forward<F>(make)()); });
}

// Throws unless `t` is a `dims`-D CPU tensor of `kind` with a contiguous last dimension.
inline void check(const at::Tensor& t, const char* name, int64_t dims, at::ScalarType kind) {
  if (t.dim() != dims || t.scalar_type() != kind || !t.device().is_cpu() ||
      t.stride(-1) != 1) {
    throw std::invalid_argument(std::string(name) + " should be a " + std::to_string(dims) +
                                "-D " + c10::toString(kind) +
                                " CPU tensor with a contiguous last dimension, found sizes " +
                                c10::str(t.sizes()) + ", strides " + c10::str(t.strides()) +
                                ", " + c10::toString(t.scalar_type()));
  }
}

// Whether this CPU has AVX2 and FMA (the kernels' vector builds).
inline bool has_avx2() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// Whether this CPU also has AVX-512F (the kernels' widest builds).
inline bool has_avx512() {
#if defined(__x86_64__)
  return has_avx2() && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// exp(x) for x <= 0: Cody-Waite reduction and Cephes' polynomial, within 2 ulp; below -87.33
// (where float32 leaves normal numbers) it gives exp(-87.33). Branch and select free, so that
// loops over it vectorise.
inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  const float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer.
  const float clamped = std::max(x, -87.33f);
  const float shifted = clamped * 1.44269504088896341f + round;
  const float n = shifted - round;
  const float r = clamped - n * 0.693359375f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = __builtin_bit_cast(int32_t, shifted);
  const float scale = __builtin_bit_cast(float, (bits - 0x4B400000 + 127) << 23);  // 2^n
  return e * scale;
}

}  // namespace rtrun
