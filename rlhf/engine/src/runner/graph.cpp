// CUDA graphs of the static decode step (issue 42): capture a step once per shape and replay
// it, through libtorch's `at::cuda::CUDAGraph` (what `torch.cuda.CUDAGraph` wraps), which tch
// does not bind. Built by build.rs with the `cuda` feature only, against the CUDA runtime
// headers of the nvidia-cuda-runtime wheel scripts/setup-libtorch.sh installs beside libtorch.
// The Rust side is `runner/graph.rs`.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

namespace {

int fail(const char* what, char* err, size_t len) {
  if (len > 0) {
    std::strncpy(err, what, len - 1);
    err[len - 1] = 0;
  }
  return -1;
}

}  // namespace

extern "C" {

// Captures what `body(ctx)` launches on `device` into a new graph (`*out`), on a side stream
// as PyTorch's capture does, its memory from the pool `pool` ({0, 0}: a new one; the pool of
// an earlier graph shares its memory). `body` returns 0, or nonzero after a failure it
// reports itself; the capture is then ended and discarded. `*pool_out` receives the graph's
// pool. Returns 0, or -1 with the reason in `err`.
int rtrun_graph_capture(int device, int (*body)(void*), void* ctx, uint64_t pool_first,
                        uint64_t pool_second, void** out, uint64_t* pool_out, char* err,
                        size_t len) {
  try {
    c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device));
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    auto stream = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device));
    // The capture starts after what the current stream has queued (once per shape: a host
    // wait costs nothing that matters).
    c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).synchronize();
    int status = 0;
    {
      c10::cuda::CUDAStreamGuard stream_guard(stream);
      graph->capture_begin({pool_first, pool_second});
      try {
        status = body(ctx);
      } catch (...) {
        status = -1;
      }
      if (status != 0) {
        try {
          graph->capture_end();
        } catch (...) {
        }
        return fail("the step failed while it was being captured", err, len);
      }
      graph->capture_end();
    }
    stream.synchronize();
    const auto pool = graph->pool();
    pool_out[0] = pool.first;
    pool_out[1] = pool.second;
    *out = graph.release();
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what(), err, len);
  }
}

// Replays a graph of `rtrun_graph_capture` on the current stream.
int rtrun_graph_replay(void* graph, char* err, size_t len) {
  try {
    static_cast<at::cuda::CUDAGraph*>(graph)->replay();
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what(), err, len);
  }
}

// Frees a graph of `rtrun_graph_capture` (its memory returns to its pool).
void rtrun_graph_free(void* graph) { delete static_cast<at::cuda::CUDAGraph*>(graph); }

}  // extern "C"
