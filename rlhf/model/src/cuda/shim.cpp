// The two things of libtorch's CUDA caching allocator that tch does not bind: releasing the
// cached blocks to the driver (torch.cuda.empty_cache) and the allocator's statistics
// (torch.cuda.memory_stats). Built by build.rs with the `cuda` feature only. It goes through
// c10's device-generic allocator interface, which needs no CUDA headers.
#include <c10/core/CachingDeviceAllocator.h>
#include <cstdint>
#include <cstring>
#include <exception>

extern "C" {

// Copies the exception's message into `err` (at most `len` bytes, NUL-terminated); returns -1.
static int rtrun_fail(const std::exception& e, char* err, size_t len) {
  if (len > 0) {
    std::strncpy(err, e.what(), len - 1);
    err[len - 1] = 0;
  }
  return -1;
}

int rtrun_cuda_empty_cache(char* err, size_t len) {
  try {
    c10::getDeviceAllocator(c10::DeviceType::CUDA)->emptyCache();
    return 0;
  } catch (const std::exception& e) {
    return rtrun_fail(e, err, len);
  }
}

// out: allocated current, allocated peak, reserved current, reserved peak (bytes).
int rtrun_cuda_memory_stats(int device, int64_t* out, char* err, size_t len) {
  try {
    auto stats = c10::getDeviceAllocator(c10::DeviceType::CUDA)
                     ->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[all].current;
    out[1] = stats.allocated_bytes[all].peak;
    out[2] = stats.reserved_bytes[all].current;
    out[3] = stats.reserved_bytes[all].peak;
    return 0;
  } catch (const std::exception& e) {
    return rtrun_fail(e, err, len);
  }
}

int rtrun_cuda_reset_peak(int device, char* err, size_t len) {
  try {
    c10::getDeviceAllocator(c10::DeviceType::CUDA)
        ->resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return 0;
  } catch (const std::exception& e) {
    return rtrun_fail(e, err, len);
  }
}
}
