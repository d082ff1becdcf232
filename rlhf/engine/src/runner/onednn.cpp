// oneDNN's inner product with a weight packed once into its blocked layout: what
// `torch.compile` (inductor's mkldnn fusion) runs for a CPU linear, and what tch does not bind.
// The two operators are registered by libtorch under the `mkldnn` namespace outside aten's
// generated API, so they are called through the dispatcher by name. Built by build.rs; the
// Rust side is `runner/cpu_kernels.rs`.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "shim.h"

#include <cstdint>
#include <string>

namespace {

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

}  // namespace

extern "C" {

// `weight` ([out, in], float32, CPU, dense) reordered into oneDNN's blocked layout for an
// inner product; `*out` receives a new tensor the caller owns.
int rtrun_onednn_pack(const at::Tensor* weight, at::Tensor** out, char* err, size_t len) {
  return rtrun::return_tensor(out, err, len, [&] {
    static const c10::OperatorHandle reorder = op("mkldnn::_reorder_linear_weight");
    torch::jit::Stack stack{c10::IValue(*weight), c10::IValue()};
    reorder.callBoxed(&stack);
    return stack.at(0).toTensor();
  });
}

// `x W^T + b` for dense rows `x: [T, in]` and a weight packed by `rtrun_onednn_pack`; `bias`
// may be null. `*out` receives a new dense `[T, out]` tensor the caller owns.
int rtrun_onednn_linear(const at::Tensor* x, const at::Tensor* packed, const at::Tensor* bias,
                        at::Tensor** out, char* err, size_t len) {
  return rtrun::return_tensor(out, err, len, [&] {
    static const c10::OperatorHandle linear = op("mkldnn::_linear_pointwise");
    torch::jit::Stack stack{
        c10::IValue(*x),
        c10::IValue(*packed),
        bias ? c10::IValue(*bias) : c10::IValue(),
        c10::IValue(std::string("none")),
        c10::IValue(c10::List<std::optional<at::Scalar>>()),
        c10::IValue(),
    };
    linear.callBoxed(&stack);
    return stack.at(0).toTensor();
  });
}
}
