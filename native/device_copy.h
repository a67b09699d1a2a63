// Host -> GPU copies through the CUDA runtime, loaded at run time.
//
// moestream builds and runs without CUDA: the runtime (libcudart) is found with dlopen,
// preferring the copy the process already has (MLX's CUDA build links one), and every
// entry point is looked up by name. Where it is missing, `CudaRuntime::load` says why and
// callers fall back to plain memory copies (CPU build, Apple Silicon's unified memory).
//
// Why this exists: MLX's own ways of putting bytes on an NVIDIA GPU run at 1-4 GB/s, while
// DMA from page-locked host memory runs at the link's speed (55 GB/s measured on an H200).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace moestream {

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One copy: `n` bytes from `src` to `dst` (any mix of host, pinned, device, managed).
// `gpu_visible`: both ends are memory a kernel can address (pinned, device or managed,
// not pageable), so the span may go through the copy kernel (see `copy`).
struct CopySpan {
  void* dst;
  const void* src;
  size_t n;
  bool gpu_visible = false;
};

// A byte range of managed memory and where it should live.
struct PlaceSpan {
  const void* p;
  size_t n;
  bool on_device;
};

// Totals of `CudaRuntime::copy` since the runtime was loaded: where the host's time
// goes when it queues many small copies (each cudaMemcpyAsync costs microseconds of it).
struct CopyCounters {
  uint64_t calls = 0;
  uint64_t spans = 0;
  uint64_t bytes = 0;
  uint64_t kernel_launches = 0;  // launches of the copy kernel (Settings.copy_kernel)
  double enqueue_seconds = 0;  // queuing the copies
  double wait_seconds = 0;     // waiting for them, in calls that wait
  // Why the copy kernel could not be launched (then every copy goes by cudaMemcpyAsync),
  // empty while it works.
  std::string kernel_error;
};

// Blocks per span of the copy kernel: at most this many unless a call says otherwise
// (enough 16-byte loads in flight to fill the link on their own), and at most the
// second for any call. Fewer leave more of the GPU to the kernels that run beside a copy
// queued ahead of use (prefetch), at the risk of a slower copy.
constexpr size_t kCopyKernelDefaultBlocks = 64;
constexpr size_t kCopyKernelMaxBlocks = 1024;

// What cudaPointerGetAttributes says about an address.
enum class MemoryKind { kUnregistered = 0, kHost = 1, kDevice = 2, kManaged = 3 };

class CudaRuntime {
 public:
  // The runtime and `streams` copy streams on device 0; throws CudaError saying why not.
  static std::unique_ptr<CudaRuntime> load(int streams = 1);
  ~CudaRuntime();
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  const std::string& library() const { return library_; }
  int runtime_version() const { return runtime_version_; }

  // Page-locked host memory (cudaHostAlloc), freed with free_host.
  void* alloc_host(size_t n);
  void free_host(void* p) noexcept;
  void* alloc_device(size_t n);
  void free_device(void* p) noexcept;

  // Enqueue every span on the copy streams (largest first, spread over the streams so
  // that several copy engines work at once), then, with `wait`, wait for all of them.
  // Returns the seconds from the first enqueue to the end of the wait (0 without it).
  // `kernel` copies the gpu_visible spans with one launch of a copy kernel per up to
  // kCopyKernelMaxSpans spans (PTX loaded through the CUDA driver on first use) instead
  // of one cudaMemcpyAsync each, which costs microseconds of host time apiece; the
  // other spans go as before.
  // `kernel_blocks` caps the kernel's blocks per span for this call (0: the default).
  double copy(std::vector<CopySpan> spans, bool wait = true, bool kernel = false, size_t kernel_blocks = 0);
  // Wait for every copy queued so far; returns the seconds waited.
  double sync();
  int streams() const { return static_cast<int>(streams_.size()); }
  // Migrate managed memory to the GPU (or to host memory, still mapped for the GPU to
  // read over the link) and ask the driver to keep it there.
  void place(const void* p, size_t n, bool on_device);
  // The same for many ranges, queued on one stream. `map_for_gpu` also maps each range
  // into the GPU's page tables (needed once per range: later moves keep the mapping);
  // `wait` waits for the migrations, else they finish while the caller goes on (the
  // bytes never change, so kernels reading a range while it moves read the same bytes).
  void place_many(const std::vector<PlaceSpan>& spans, bool map_for_gpu, bool wait);
  MemoryKind kind_of(const void* p);
  CopyCounters counters() const;

 private:
  CudaRuntime() = default;
  void check(int err, const char* what) const;
  // The copy kernel, loaded once (the driver API and the module); throws CudaError.
  void* copy_kernel();
  void launch_copies(const std::vector<CopySpan>& spans, void* stream, size_t max_blocks);

  struct Driver;
  std::unique_ptr<Driver> driver_;
  mutable std::mutex driver_mutex_;

  struct Api;
  void* handle_ = nullptr;
  std::unique_ptr<Api> api_;
  std::vector<void*> streams_;
  std::string library_;
  int runtime_version_ = 0;
  // Updated by `copy`, which may run on several threads at once.
  std::atomic<uint64_t> calls_{0}, spans_{0}, bytes_{0}, launches_{0}, enqueue_ns_{0}, wait_ns_{0};
  // Set once when the driver refuses the copy kernel (guarded by driver_mutex_).
  std::string kernel_error_;
  std::atomic<bool> kernel_failed_{false};
};

}  // namespace moestream
