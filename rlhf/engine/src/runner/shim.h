// What the runner's C++ shims share: the calling convention of their `extern "C"` functions.
#pragma once

#include <ATen/ATen.h>

#include <cstring>
#include <exception>
#include <utility>

namespace rtrun {

// Runs `make` (which returns a tensor) and hands the result to the caller as a new tensor in
// `*out`; returns 0. If it throws, copies the message into `err` (at most `len` bytes,
// NUL-terminated) and returns -1.
template <typename F>
int return_tensor(at::Tensor** out, char* err, size_t len, F&& make) {
  try {
    *out = new at::Tensor(std::forward<F>(make)());
    return 0;
  } catch (const std::exception& e) {
    if (len > 0) {
      std::strncpy(err, e.what(), len - 1);
      err[len - 1] = 0;
    }
    return -1;
  }
}

// Runs `work` (which returns nothing); returns 0, or -1 with the message of what it threw in
// `err` as in `return_tensor`.
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

}  // namespace rtrun
