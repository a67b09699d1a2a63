// The CUDA runtime, loaded at run time; see device_copy.h.
#include "device_copy.h"

#include "copy_kernel_ptx.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

namespace moestream {

namespace {

// The few runtime ABI details used here (stable since CUDA 11).
constexpr int kSuccess = 0;
constexpr int kMemcpyDefault = 4;
constexpr unsigned kStreamNonBlocking = 1;
constexpr int kAdviseSetPreferredLocation = 3;
constexpr int kAdviseSetAccessedBy = 5;
constexpr int kLocationDevice = 1;
constexpr int kLocationHost = 2;
constexpr int kCpuDeviceId = -1;

struct MemLocation {  // cudaMemLocation
  int type;
  int id;
};


// Sonames tried in order; MLX's CUDA 13 build brings libcudart.so.13.
const char* const kLibraries[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so", "libcudart.dylib"};

// The copy kernel's parameter, laid out as its `Spans` (native/gen_copy_kernel.py).
struct KernelSpan {
  uint64_t dst, src, n;
};
struct KernelSpans {
  uint64_t count;
  KernelSpan s[kCopyKernelMaxSpans];
};
static_assert(sizeof(KernelSpans) == 8 + 24 * kCopyKernelMaxSpans, "the kernel's parameter layout");
constexpr unsigned kCopyThreads = 256;

}  // namespace

struct CudaRuntime::Api {
  int (*GetDeviceCount)(int*) = nullptr;
  int (*RuntimeGetVersion)(int*) = nullptr;
  const char* (*GetErrorString)(int) = nullptr;
  int (*HostAlloc)(void**, size_t, unsigned) = nullptr;
  int (*FreeHost)(void*) = nullptr;
  int (*Malloc)(void**, size_t) = nullptr;
  int (*Free)(void*) = nullptr;
  int (*StreamCreateWithFlags)(void**, unsigned) = nullptr;
  int (*StreamDestroy)(void*) = nullptr;
  int (*StreamSynchronize)(void*) = nullptr;
  int (*MemcpyAsync)(void*, const void*, size_t, int, void*) = nullptr;
  int (*PointerGetAttributes)(void*, const void*) = nullptr;
  // Prefetch and advise changed signature in CUDA 13 (a location instead of a device);
  // 12.2+ has the new form as *_v2. Exactly one pair is set.
  int (*PrefetchLoc)(const void*, size_t, MemLocation, unsigned, void*) = nullptr;
  int (*AdviseLoc)(const void*, size_t, int, MemLocation) = nullptr;
  int (*PrefetchDev)(const void*, size_t, int, void*) = nullptr;
  int (*AdviseDev)(const void*, size_t, int, int) = nullptr;
};

// The CUDA driver API, for the copy kernel only: the runtime API cannot load PTX.
struct CudaRuntime::Driver {
  void* handle = nullptr;
  int (*CtxGetCurrent)(void**) = nullptr;
  int (*ModuleLoadData)(void**, const void*) = nullptr;
  int (*ModuleGetFunction)(void**, void*, const char*) = nullptr;
  int (*LaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                      void**) = nullptr;
  int (*GetErrorString)(int, const char**) = nullptr;
  void* function = nullptr;

  void check(int err, const char* what) const {
    if (err == kSuccess) return;
    const char* text = nullptr;
    if (GetErrorString) GetErrorString(err, &text);
    throw CudaError(std::string(what) + " failed: " + (text ? text : std::to_string(err)));
  }
};

std::unique_ptr<CudaRuntime> CudaRuntime::load(int streams) {
  if (streams < 1 || streams > 16) throw CudaError("streams must be between 1 and 16");
  std::unique_ptr<CudaRuntime> rt(new CudaRuntime());
  rt->api_ = std::make_unique<Api>();
  std::string tried;
  for (int pass = 0; pass < 2 && !rt->handle_; ++pass) {
    // First the runtime already in the process (the one MLX uses), then any.
    const int flags = RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0);
    for (const char* name : kLibraries) {
      rt->handle_ = ::dlopen(name, flags);
      if (rt->handle_) {
        rt->library_ = name;
        break;
      }
    }
  }
  if (!rt->handle_) throw CudaError("no CUDA runtime (libcudart) could be loaded");

  auto sym = [&](const char* name, bool required) -> void* {
    void* p = ::dlsym(rt->handle_, name);
    if (!p && required) throw CudaError(rt->library_ + " has no symbol " + name);
    return p;
  };
  Api& a = *rt->api_;
  a.GetDeviceCount = reinterpret_cast<decltype(a.GetDeviceCount)>(sym("cudaGetDeviceCount", true));
  a.RuntimeGetVersion = reinterpret_cast<decltype(a.RuntimeGetVersion)>(sym("cudaRuntimeGetVersion", true));
  a.GetErrorString = reinterpret_cast<decltype(a.GetErrorString)>(sym("cudaGetErrorString", true));
  a.HostAlloc = reinterpret_cast<decltype(a.HostAlloc)>(sym("cudaHostAlloc", true));
  a.FreeHost = reinterpret_cast<decltype(a.FreeHost)>(sym("cudaFreeHost", true));
  a.Malloc = reinterpret_cast<decltype(a.Malloc)>(sym("cudaMalloc", true));
  a.Free = reinterpret_cast<decltype(a.Free)>(sym("cudaFree", true));
  a.StreamCreateWithFlags = reinterpret_cast<decltype(a.StreamCreateWithFlags)>(sym("cudaStreamCreateWithFlags", true));
  a.StreamDestroy = reinterpret_cast<decltype(a.StreamDestroy)>(sym("cudaStreamDestroy", true));
  a.StreamSynchronize = reinterpret_cast<decltype(a.StreamSynchronize)>(sym("cudaStreamSynchronize", true));
  a.MemcpyAsync = reinterpret_cast<decltype(a.MemcpyAsync)>(sym("cudaMemcpyAsync", true));
  a.PointerGetAttributes = reinterpret_cast<decltype(a.PointerGetAttributes)>(sym("cudaPointerGetAttributes", true));

  a.RuntimeGetVersion(&rt->runtime_version_);
  if (rt->runtime_version_ >= 13000) {
    a.PrefetchLoc = reinterpret_cast<decltype(a.PrefetchLoc)>(sym("cudaMemPrefetchAsync", true));
    a.AdviseLoc = reinterpret_cast<decltype(a.AdviseLoc)>(sym("cudaMemAdvise", true));
  } else if (sym("cudaMemPrefetchAsync_v2", false) && sym("cudaMemAdvise_v2", false)) {
    a.PrefetchLoc = reinterpret_cast<decltype(a.PrefetchLoc)>(sym("cudaMemPrefetchAsync_v2", true));
    a.AdviseLoc = reinterpret_cast<decltype(a.AdviseLoc)>(sym("cudaMemAdvise_v2", true));
  } else {
    a.PrefetchDev = reinterpret_cast<decltype(a.PrefetchDev)>(sym("cudaMemPrefetchAsync", true));
    a.AdviseDev = reinterpret_cast<decltype(a.AdviseDev)>(sym("cudaMemAdvise", true));
  }

  int devices = 0;
  int err = a.GetDeviceCount(&devices);
  if (err != kSuccess) throw CudaError(std::string("CUDA has no usable device: ") + a.GetErrorString(err));
  if (devices < 1) throw CudaError("CUDA reports no device");
  for (int i = 0; i < streams; ++i) {
    void* stream = nullptr;
    rt->check(a.StreamCreateWithFlags(&stream, kStreamNonBlocking), "cudaStreamCreateWithFlags");
    rt->streams_.push_back(stream);
  }
  return rt;
}

CudaRuntime::~CudaRuntime() {
  // The libraries stay loaded, and so does the copy kernel's module (it lives as long as
  // the CUDA context): MLX (or the driver) may still use them.
  if (api_)
    for (void* stream : streams_) api_->StreamDestroy(stream);
}

void CudaRuntime::check(int err, const char* what) const {
  if (err != kSuccess) throw CudaError(std::string(what) + " failed: " + api_->GetErrorString(err));
}

void* CudaRuntime::alloc_host(size_t n) {
  void* p = nullptr;
  check(api_->HostAlloc(&p, n, 0), "cudaHostAlloc");
  return p;
}

void CudaRuntime::free_host(void* p) noexcept {
  if (p) api_->FreeHost(p);
}

void* CudaRuntime::alloc_device(size_t n) {
  void* p = nullptr;
  check(api_->Malloc(&p, n), "cudaMalloc");
  return p;
}

void CudaRuntime::free_device(void* p) noexcept {
  if (p) api_->Free(p);
}

void* CudaRuntime::copy_kernel() {
  std::lock_guard<std::mutex> lock(driver_mutex_);
  if (driver_) return driver_->function;
  auto d = std::make_unique<Driver>();
  for (int pass = 0; pass < 2 && !d->handle; ++pass)
    d->handle = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
  if (!d->handle) throw CudaError("the copy kernel needs the CUDA driver (libcuda.so.1), which could not be loaded");
  auto sym = [&](const char* name) -> void* {
    void* p = ::dlsym(d->handle, name);
    if (!p) throw CudaError(std::string("libcuda.so.1 has no symbol ") + name);
    return p;
  };
  d->CtxGetCurrent = reinterpret_cast<decltype(d->CtxGetCurrent)>(sym("cuCtxGetCurrent"));
  d->ModuleLoadData = reinterpret_cast<decltype(d->ModuleLoadData)>(sym("cuModuleLoadData"));
  d->ModuleGetFunction = reinterpret_cast<decltype(d->ModuleGetFunction)>(sym("cuModuleGetFunction"));
  d->LaunchKernel = reinterpret_cast<decltype(d->LaunchKernel)>(sym("cuLaunchKernel"));
  d->GetErrorString = reinterpret_cast<decltype(d->GetErrorString)>(sym("cuGetErrorString"));
  // The module goes into the runtime's (primary) context; a runtime call makes it
  // current on this thread if nothing has yet.
  void* ctx = nullptr;
  d->check(d->CtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (!ctx) {
    check(api_->Free(nullptr), "cudaFree");
    d->check(d->CtxGetCurrent(&ctx), "cuCtxGetCurrent");
    if (!ctx) throw CudaError("no CUDA context is current for the copy kernel");
  }
  void* module = nullptr;
  d->check(d->ModuleLoadData(&module, kCopyKernelPtx), "cuModuleLoadData (the copy kernel's PTX)");
  d->check(d->ModuleGetFunction(&d->function, module, kCopyKernelName), "cuModuleGetFunction");
  driver_ = std::move(d);
  return driver_->function;
}

void CudaRuntime::launch_copies(const std::vector<CopySpan>& spans, void* stream, size_t max_blocks) {
  void* function = copy_kernel();
  // The driver launches in the calling thread's current context, which a thread that
  // has made no runtime call yet lacks: a runtime call binds the runtime's context.
  void* ctx = nullptr;
  driver_->check(driver_->CtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (!ctx) check(api_->Free(nullptr), "cudaFree");
  // The parameter is copied at launch, so one on the stack serves every launch.
  KernelSpans params{};
  for (size_t first = 0; first < spans.size(); first += kCopyKernelMaxSpans) {
    const size_t count = std::min(spans.size() - first, static_cast<size_t>(kCopyKernelMaxSpans));
    size_t largest = 0;
    for (size_t j = 0; j < count; ++j) {
      const CopySpan& s = spans[first + j];
      params.s[j] = {reinterpret_cast<uint64_t>(s.dst), reinterpret_cast<uint64_t>(s.src), s.n};
      largest = std::max(largest, s.n);
    }
    params.count = count;
    const size_t blocks = std::clamp<size_t>((largest + 16 * kCopyThreads - 1) / (16 * kCopyThreads), 1, max_blocks);
    void* args[] = {&params};
    driver_->check(driver_->LaunchKernel(function, static_cast<unsigned>(blocks), static_cast<unsigned>(count), 1,
                                         kCopyThreads, 1, 1, 0, stream, args, nullptr),
                   "cuLaunchKernel (the copy kernel)");
    launches_ += 1;
  }
}

double CudaRuntime::copy(std::vector<CopySpan> spans, bool wait, bool kernel, size_t kernel_blocks) {
  if (kernel_blocks > kCopyKernelMaxBlocks)
    throw CudaError("kernel_blocks must be at most " + std::to_string(kCopyKernelMaxBlocks));
  const auto start = std::chrono::steady_clock::now();
  std::stable_sort(spans.begin(), spans.end(), [](const CopySpan& a, const CopySpan& b) { return a.n > b.n; });
  const size_t k = streams_.size();
  std::vector<size_t> load(k, 0);
  size_t queued = 0, bytes = 0;
  if (kernel && !kernel_failed_.load()) {
    // The kernel's share, all on the first stream (one launch moves them all at once);
    // the rest below, spread over the streams as usual.
    std::vector<CopySpan> through_kernel;
    std::vector<CopySpan> rest;
    for (const CopySpan& s : spans) {
      if (s.n == 0) continue;
      (s.gpu_visible ? through_kernel : rest).push_back(s);
    }
    if (!through_kernel.empty()) {
      try {
        launch_copies(through_kernel, streams_[0], kernel_blocks ? kernel_blocks : kCopyKernelDefaultBlocks);
        for (const CopySpan& s : through_kernel) {
          load[0] += s.n;
          ++queued;
          bytes += s.n;
        }
      } catch (const CudaError& e) {
        // A driver without libcuda, or one that cannot read the PTX: copy these spans,
        // and every later call's, the way the runtime does, and say why in the counters.
        // Spans an earlier launch of this call already copied are copied again, with
        // the same bytes.
        {
          std::lock_guard<std::mutex> lock(driver_mutex_);
          kernel_error_ = e.what();
        }
        kernel_failed_ = true;
        rest.insert(rest.end(), through_kernel.begin(), through_kernel.end());
      }
    }
    spans = std::move(rest);
  }
  for (const CopySpan& s : spans) {
    if (s.n == 0) continue;
    const size_t i = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    load[i] += s.n;
    check(api_->MemcpyAsync(s.dst, s.src, s.n, kMemcpyDefault, streams_[i]), "cudaMemcpyAsync");
    ++queued;
    bytes += s.n;
  }
  const auto enqueued = std::chrono::steady_clock::now();
  auto ns = [](std::chrono::steady_clock::duration d) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  };
  calls_ += 1;
  spans_ += queued;
  bytes_ += bytes;
  enqueue_ns_ += ns(enqueued - start);
  if (!wait) return 0.0;
  for (size_t i = 0; i < k; ++i)
    if (load[i]) check(api_->StreamSynchronize(streams_[i]), "cudaStreamSynchronize");
  const auto done = std::chrono::steady_clock::now();
  wait_ns_ += ns(done - enqueued);
  return std::chrono::duration<double>(done - start).count();
}

CopyCounters CudaRuntime::counters() const {
  CopyCounters c;
  c.calls = calls_.load();
  c.spans = spans_.load();
  c.bytes = bytes_.load();
  c.kernel_launches = launches_.load();
  c.enqueue_seconds = enqueue_ns_.load() * 1e-9;
  c.wait_seconds = wait_ns_.load() * 1e-9;
  if (kernel_failed_.load()) {
    std::lock_guard<std::mutex> lock(driver_mutex_);
    c.kernel_error = kernel_error_;
  }
  return c;
}

double CudaRuntime::sync() {
  const auto start = std::chrono::steady_clock::now();
  for (void* s : streams_) check(api_->StreamSynchronize(s), "cudaStreamSynchronize");
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void CudaRuntime::place(const void* p, size_t n, bool on_device) { place_many({{p, n, on_device}}, true, true); }

void CudaRuntime::place_many(const std::vector<PlaceSpan>& spans, bool map_for_gpu, bool wait) {
  const Api& a = *api_;
  const MemLocation gpu{kLocationDevice, 0};
  for (const PlaceSpan& s : spans) {
    if (s.n == 0) continue;
    const MemLocation where = s.on_device ? gpu : MemLocation{kLocationHost, 0};
    const int where_dev = s.on_device ? 0 : kCpuDeviceId;
    if (a.AdviseLoc) {
      check(a.AdviseLoc(s.p, s.n, kAdviseSetPreferredLocation, where), "cudaMemAdvise");
      if (map_for_gpu) check(a.AdviseLoc(s.p, s.n, kAdviseSetAccessedBy, gpu), "cudaMemAdvise");
      check(a.PrefetchLoc(s.p, s.n, where, 0, streams_[0]), "cudaMemPrefetchAsync");
    } else {
      check(a.AdviseDev(s.p, s.n, kAdviseSetPreferredLocation, where_dev), "cudaMemAdvise");
      if (map_for_gpu) check(a.AdviseDev(s.p, s.n, kAdviseSetAccessedBy, 0), "cudaMemAdvise");
      check(a.PrefetchDev(s.p, s.n, where_dev, streams_[0]), "cudaMemPrefetchAsync");
    }
  }
  if (wait) check(a.StreamSynchronize(streams_[0]), "cudaStreamSynchronize");
}

MemoryKind CudaRuntime::kind_of(const void* p) {
  // cudaPointerAttributes starts with {int type; int device; ...}; room to spare for
  // fields later runtimes add.
  alignas(16) unsigned char attrs[256];
  std::memset(attrs, 0, sizeof attrs);
  check(api_->PointerGetAttributes(attrs, p), "cudaPointerGetAttributes");
  int type = 0;
  std::memcpy(&type, attrs, sizeof type);
  return static_cast<MemoryKind>(type);
}

}  // namespace moestream
