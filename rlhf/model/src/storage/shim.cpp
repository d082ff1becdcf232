// What tch does not bind of a tensor's storage and autograd slots, for sharded training:
// freeing a storage's memory and allocating it again in place (what FSDP does with
// `storage.resize_(0)`: every view of the storage, including those autograd saved for the
// backward pass, follows), dropping a tensor's `.grad`, and counting the bytes of host
// tensors (a wrapper around c10's CPU allocator). Device-generic c10 interfaces only, so no
// CUDA headers are needed and the CPU build compiles it too.
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>

namespace {

int fail(const std::exception& e, char* err, size_t len) {
  if (len > 0) {
    std::strncpy(err, e.what(), len - 1);
    err[len - 1] = 0;
  }
  return -1;
}

// Counts the bytes of live host allocations (current and peak) and forwards to the allocator
// it replaced. Each allocation's context remembers its size and the inner DataPtr, whose own
// deleter frees the memory.
struct CountingAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};

  struct Context {
    c10::DataPtr inner;
    int64_t bytes;
    CountingAllocator* owner;
  };

  static void release(void* raw) {
    auto* context = static_cast<Context*>(raw);
    context->owner->current.fetch_sub(context->bytes);
    delete context;  // Frees the memory through the inner DataPtr's deleter.
  }

  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = base->allocate(nbytes);
    void* data = inner.get();
    c10::Device device = inner.device();
    auto* context = new Context{std::move(inner), static_cast<int64_t>(nbytes), this};
    int64_t now = current.fetch_add(context->bytes) + context->bytes;
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return c10::DataPtr(data, context, &CountingAllocator::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

CountingAllocator* counting() {
  // Never destroyed: tensors freed during static destruction still call back into it.
  static CountingAllocator* allocator = new CountingAllocator();
  return allocator;
}

}  // namespace

extern "C" {

// Frees the memory of `t`'s storage (nbytes == 0) or gives it a fresh allocation of
// `nbytes` from the storage's own allocator; the tensor's and its views' shapes are unchanged.
int rtrun_storage_resize(at::Tensor* t, size_t nbytes, char* err, size_t len) {
  try {
    c10::StorageImpl* storage = t->storage().unsafeGetStorageImpl();
    if (nbytes == 0) {
      storage->set_data_ptr_noswap(c10::DataPtr(nullptr, storage->device()));
      storage->set_nbytes(0);
    } else {
      c10::Allocator* allocator = storage->allocator();
      if (allocator == nullptr) {
        throw std::runtime_error("the tensor's storage has no allocator to allocate from");
      }
      storage->set_data_ptr_noswap(allocator->allocate(nbytes));
      storage->set_nbytes(nbytes);
    }
    return 0;
  } catch (const std::exception& e) {
    return fail(e, err, len);
  }
}

// The bytes of `t`'s storage (0 once freed).
int64_t rtrun_storage_nbytes(at::Tensor* t) {
  return static_cast<int64_t>(t->storage().nbytes());
}

// Drops `t.grad` (the tensor is released when nothing else holds it).
int rtrun_clear_grad(at::Tensor* t, char* err, size_t len) {
  try {
    t->mutable_grad() = at::Tensor();
    return 0;
  } catch (const std::exception& e) {
    return fail(e, err, len);
  }
}

// Routes every later host allocation through the counting allocator (idempotent).
int rtrun_track_host_allocations(char* err, size_t len) {
  try {
    CountingAllocator* allocator = counting();
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current != allocator) {
      allocator->base = current;
      c10::SetCPUAllocator(allocator, /*priority=*/100);
    }
    return 0;
  } catch (const std::exception& e) {
    return fail(e, err, len);
  }
}

// out: current bytes, peak bytes of tracked host tensors.
void rtrun_host_allocations(int64_t* out) {
  out[0] = counting()->current.load();
  out[1] = counting()->peak.load();
}

void rtrun_reset_host_peak() {
  counting()->peak.store(counting()->current.load());
}

}  // extern "C"
