// Python bindings of the host buffers and the CUDA copier (see device_copy.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "device_copy.h"

namespace py = pybind11;
using namespace moestream;

namespace {

constexpr size_t kPageAlign = 4096;  // enough for O_DIRECT reads into the buffer
constexpr size_t kHugePage = 2 * 1024 * 1024;

// Host memory for expert bytes: page-locked through CUDA when a copier is given (DMA
// needs it to run at the link's speed), else page-aligned (huge pages where offered).
class HostBuffer {
 public:
  HostBuffer(size_t nbytes, std::shared_ptr<CudaRuntime> cuda) : nbytes_(nbytes), cuda_(std::move(cuda)) {
    if (nbytes == 0) throw py::value_error("HostBuffer: nbytes must be > 0");
    py::gil_scoped_release nogil;  // pinning gigabytes takes a while
    if (cuda_) {
      data_ = cuda_->alloc_host(nbytes);
    } else {
      const size_t align = nbytes >= kHugePage ? kHugePage : kPageAlign;
      const size_t size = (nbytes + align - 1) / align * align;
      void* p = nullptr;
      if (::posix_memalign(&p, align, size) != 0) throw std::bad_alloc();
      data_ = p;
    }
  }
  ~HostBuffer() {
    if (cuda_) {
      cuda_->free_host(data_);
    } else {
      std::free(data_);
    }
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  size_t nbytes() const { return nbytes_; }
  bool pinned() const { return cuda_ != nullptr; }
  void* data() const { return data_; }

 private:
  size_t nbytes_;
  std::shared_ptr<CudaRuntime> cuda_;
  void* data_ = nullptr;
};

// Buffer exports of the objects named in one copy call, released when it returns.
class Exports {
 public:
  ~Exports() {
    for (auto& v : views_) PyBuffer_Release(v.get());
  }
  // The export of `obj` (taken once per call, writable when asked).
  Py_buffer* of(py::handle obj, bool writable, const std::string& what) {
    auto it = index_.find(obj.ptr());
    if (it != index_.end()) {
      Py_buffer* v = views_[it->second].get();
      if (writable && v->readonly) throw py::value_error(what + " is read-only");
      return v;
    }
    if (!PyObject_CheckBuffer(obj.ptr()))
      throw py::type_error(what + " must support the buffer protocol (HostBuffer, numpy or MLX array)");
    auto view = std::make_unique<Py_buffer>();
    if (PyObject_GetBuffer(obj.ptr(), view.get(), writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO) != 0)
      throw py::error_already_set();
    if (!PyBuffer_IsContiguous(view.get(), 'C')) {
      PyBuffer_Release(view.get());
      throw py::value_error(what + " must be C-contiguous");
    }
    index_[obj.ptr()] = views_.size();
    views_.push_back(std::move(view));
    return views_.back().get();
  }

 private:
  std::vector<std::unique_ptr<Py_buffer>> views_;
  std::unordered_map<PyObject*, size_t> index_;
};

size_t as_size(py::handle v, const std::string& what) {
  long long x = v.cast<long long>();
  if (x < 0) throw py::value_error(what + " must be >= 0");
  return static_cast<size_t>(x);
}

// One (dst, dst_offset, src, src_offset, nbytes) span, its buffers exported into `exports`
// and its bounds checked; "[call] span i: " prefixes what is wrong with it.
struct HostSpan {
  char* dst;
  const char* src;
  size_t nbytes;
  const void* dst_buffer;  // the buffers' starts (what the CUDA copier asks the driver about)
  const void* src_buffer;
};

HostSpan host_span(py::handle item, Exports& exports, const std::string& what) {
  py::sequence s = py::reinterpret_borrow<py::sequence>(item);
  if (s.size() != 5) throw py::value_error(what + "expected (dst, dst_offset, src, src_offset, nbytes)");
  Py_buffer* dst = exports.of(s[0], true, what + "dst");
  Py_buffer* src = exports.of(s[2], false, what + "src");
  const size_t doff = as_size(s[1], what + "dst_offset");
  const size_t soff = as_size(s[3], what + "src_offset");
  const size_t n = as_size(s[4], what + "nbytes");
  if (doff + n > static_cast<size_t>(dst->len) || soff + n > static_cast<size_t>(src->len))
    throw py::value_error(what + "out of bounds: dst " + std::to_string(doff) + "+" + std::to_string(n) + " of " +
                          std::to_string(dst->len) + ", src " + std::to_string(soff) + "+" + std::to_string(n) +
                          " of " + std::to_string(src->len));
  return {static_cast<char*>(dst->buf) + doff, static_cast<const char*>(src->buf) + soff, n, dst->buf, src->buf};
}

// Host memory to host memory (a CPU or Apple GPU's arrays, the prefetch buffer, the host
// tier): every span in one call, so that a decode layer's promotion of a few experts'
// tensors is one crossing into C++ rather than a Python slice copy per tensor.
void copy_spans(const py::sequence& spans) {
  Exports exports;
  std::vector<HostSpan> out;
  out.reserve(spans.size());
  size_t i = 0;
  for (py::handle item : spans) out.push_back(host_span(item, exports, "[copy_spans] span " + std::to_string(i++) + ": "));
  py::gil_scoped_release nogil;
  for (const HostSpan& c : out) std::memmove(c.dst, c.src, c.nbytes);
}

class CudaCopier {
 public:
  explicit CudaCopier(int streams) {
    try {
      rt_ = std::shared_ptr<CudaRuntime>(CudaRuntime::load(streams).release());
    } catch (const CudaError& e) {
      throw py::import_error(std::string("CUDA is not available: ") + e.what());
    }
  }

  std::shared_ptr<CudaRuntime> runtime() const { return rt_; }

  // spans: [(dst, dst_offset, src, src_offset, nbytes)]; returns seconds spent.
  // kernel: None is the copier's own setting (`kernel`).
  double copy(const py::sequence& spans, bool wait, py::object kernel, py::object blocks) {
    const auto start = std::chrono::steady_clock::now();
    const bool use_kernel = kernel.is_none() ? kernel_ : kernel.cast<bool>();
    Exports exports;
    // Per buffer (by its address): whether a kernel can address it.
    std::unordered_map<const void*, bool> visible;
    auto gpu_visible = [&](const void* p) {
      auto it = visible.find(p);
      if (it == visible.end()) it = visible.emplace(p, rt_->kind_of(p) != MemoryKind::kUnregistered).first;
      return it->second;
    };
    std::vector<CopySpan> out;
    out.reserve(spans.size());
    size_t i = 0;
    for (py::handle item : spans) {
      const HostSpan c = host_span(item, exports, "[copy] span " + std::to_string(i++) + ": ");
      out.push_back({c.dst, c.src, c.nbytes, use_kernel && gpu_visible(c.dst_buffer) && gpu_visible(c.src_buffer)});
    }
    // The Python side of the call: reading the spans and exporting the buffers.
    bind_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const size_t kernel_blocks = blocks.is_none() ? 0 : as_size(blocks, "[copy] blocks");
    if (!blocks.is_none() && (kernel_blocks < 1 || kernel_blocks > kCopyKernelMaxBlocks))
      throw py::value_error("[copy] blocks: between 1 and " + std::to_string(kCopyKernelMaxBlocks));
    py::gil_scoped_release nogil;
    return rt_->copy(out, wait, use_kernel, kernel_blocks);
  }

  bool kernel_ = false;  // copies go through the copy kernel unless a call says otherwise

  py::dict counters() const {
    const CopyCounters c = rt_->counters();
    py::dict d;
    d["calls"] = c.calls;
    d["spans"] = c.spans;
    d["bytes"] = c.bytes;
    d["kernel_launches"] = c.kernel_launches;
    d["kernel_error"] = c.kernel_error;
    d["bind_seconds"] = bind_seconds_;
    d["enqueue_seconds"] = c.enqueue_seconds;
    d["wait_seconds"] = c.wait_seconds;
    return d;
  }

  double sync() {
    py::gil_scoped_release nogil;
    return rt_->sync();
  }

  void place(py::handle obj, const std::string& where, size_t offset, py::object nbytes) {
    if (where != "device" && where != "host") throw py::value_error("[place] where must be 'device' or 'host'");
    Exports exports;
    Py_buffer* v = exports.of(obj, false, "[place] buffer");
    const size_t len = static_cast<size_t>(v->len);
    const size_t n = nbytes.is_none() ? len - std::min(offset, len) : nbytes.cast<size_t>();
    if (offset + n > len) throw py::value_error("[place] range out of bounds");
    py::gil_scoped_release nogil;
    rt_->place(static_cast<const char*>(v->buf) + offset, n, where == "device");
  }

  void place_many(py::iterable items, bool map_for_gpu, bool wait) {
    Exports exports;
    std::vector<PlaceSpan> spans;
    for (py::handle item : items) {
      const std::string what = "[place_many] ";
      py::sequence s = py::reinterpret_borrow<py::sequence>(item);
      if (s.size() != 4) throw py::value_error(what + "expected (buffer, where, offset, nbytes)");
      Py_buffer* v = exports.of(s[0], false, what + "buffer");
      const std::string where = s[1].cast<std::string>();
      if (where != "device" && where != "host") throw py::value_error(what + "where must be 'device' or 'host'");
      const size_t off = as_size(s[2], what + "offset");
      const size_t n = as_size(s[3], what + "nbytes");
      if (off + n > static_cast<size_t>(v->len)) throw py::value_error(what + "range out of bounds");
      spans.push_back({static_cast<const char*>(v->buf) + off, n, where == "device"});
    }
    py::gil_scoped_release nogil;
    rt_->place_many(spans, map_for_gpu, wait);
  }

  std::string memory_kind(py::handle obj) {
    Exports exports;
    Py_buffer* v = exports.of(obj, false, "[memory_kind] buffer");
    switch (rt_->kind_of(v->buf)) {
      case MemoryKind::kHost: return "pinned";
      case MemoryKind::kDevice: return "device";
      case MemoryKind::kManaged: return "managed";
      default: return "pageable";
    }
  }

  // Host -> device bandwidth of large copies from pinned and from pageable memory.
  py::dict probe(size_t nbytes, int repeats) {
    if (nbytes == 0 || repeats < 1) throw py::value_error("[probe] nbytes and repeats must be > 0");
    std::vector<double> pinned, pageable;
    {
      py::gil_scoped_release nogil;
      void* dev = rt_->alloc_device(nbytes);
      void* host = nullptr;
      std::unique_ptr<char[]> plain;
      try {
        host = rt_->alloc_host(nbytes);
        std::memset(host, 1, nbytes);
        plain.reset(new char[nbytes]);
        std::memset(plain.get(), 1, nbytes);
        rt_->copy({{dev, host, nbytes}});  // warm-up: first-touch mappings
        for (int r = 0; r < repeats; ++r) pinned.push_back(nbytes / rt_->copy({{dev, host, nbytes}}));
        for (int r = 0; r < repeats; ++r) pageable.push_back(nbytes / rt_->copy({{dev, plain.get(), nbytes}}));
      } catch (...) {
        rt_->free_host(host);
        rt_->free_device(dev);
        throw;
      }
      rt_->free_host(host);
      rt_->free_device(dev);
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    py::dict d;
    d["nbytes"] = nbytes;
    d["repeats"] = repeats;
    d["pinned_bytes_per_s"] = median(pinned);
    d["pageable_bytes_per_s"] = median(pageable);
    return d;
  }

 private:
  std::shared_ptr<CudaRuntime> rt_;
  double bind_seconds_ = 0;  // only touched with the GIL held
};

}  // namespace

void bind_device_copy(py::module_& m) {
  m.def("copy_spans", &copy_spans, py::arg("spans"),
        "copy_spans([(dst, dst_offset, src, src_offset, nbytes), ...])\n\n"
        "Copy every span between host buffers (HostBuffer, numpy or MLX arrays in host memory), "
        "the GIL released for the copies. Raises ValueError for a span out of its buffers' "
        "bounds and BufferError for a dst that cannot be written, before anything is copied.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CudaError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::class_<CudaCopier>(m, "CudaCopier",
                         "Host <-> GPU copies through the CUDA runtime, loaded at run time.\n\n"
                         "CudaCopier(streams=4) raises ImportError saying why where there is no CUDA "
                         "runtime or device. Copies run on the copier's own streams; `copy` waits "
                         "for them, so the bytes are in place when it returns.")
      .def(py::init<int>(), py::arg("streams") = 4)
      .def_property_readonly("streams", [](const CudaCopier& c) { return c.runtime()->streams(); })
      .def("copy", &CudaCopier::copy, py::arg("spans"), py::arg("wait") = true, py::arg("kernel") = py::none(),
           py::arg("blocks") = py::none(),
           "copy([(dst, dst_offset, src, src_offset, nbytes), ...], wait=True, kernel=None, blocks=None) -> float\n\n"
           "Copy every span (buffers: HostBuffer, numpy or MLX arrays) and wait; returns the "
           "seconds from the first copy queued to the last one done. With wait=False it only "
           "queues the copies and returns 0: the caller keeps every buffer alive and unchanged "
           "until `sync()` returns. kernel=True (None: the copier's `kernel`) copies the spans whose both ends a kernel "
           "can address (pinned, device or managed memory) with one copy-kernel launch per 160 "
           "spans, loaded through the CUDA driver on first use; pageable spans still go by "
           "cudaMemcpyAsync. blocks caps the kernel's blocks per span for this call (None: 64; "
           "fewer leave more of the GPU to kernels running beside a copy queued ahead of use).")
      .def_readwrite("kernel", &CudaCopier::kernel_,
                     "Whether `copy` uses the copy kernel when a call does not say (Settings.copy_kernel).")
      .def("counters", &CudaCopier::counters,
           "counters() -> dict: copy calls, spans and bytes since the copier was made, and the host "
           "seconds spent reading spans and exporting buffers (bind), queuing the copies (enqueue) "
           "and waiting for them in calls that wait (wait)")
      .def("sync", &CudaCopier::sync, "sync() -> float: wait for every copy queued so far; returns the seconds waited.")
      .def("place", &CudaCopier::place, py::arg("buffer"), py::arg("where") = "device", py::arg("offset") = 0,
           py::arg("nbytes") = py::none(),
           "place(buffer, where='device', offset=0, nbytes=None)\n\n"
           "Migrate (a byte range of) a managed buffer, such as an MLX CUDA array, to the GPU or to "
           "host memory, and advise the driver to keep it there; on the host it stays mapped for "
           "the GPU, whose kernels then read it over the link.")
      .def("place_many", &CudaCopier::place_many, py::arg("spans"), py::arg("map_for_gpu") = false, py::arg("wait") = false,
           "place_many([(buffer, 'device'|'host', offset, nbytes), ...], map_for_gpu=False, wait=False)\n\n"
           "`place` for many ranges at once, queued on one stream. The GPU's mapping of a range is "
           "made by `place` or by map_for_gpu=True and kept by later moves; without `wait` the "
           "migrations finish after the call returns (the bytes never change meanwhile).")
      .def("memory_kind", &CudaCopier::memory_kind, py::arg("buffer"),
           "memory_kind(buffer) -> 'device' | 'managed' | 'pinned' | 'pageable'")
      .def("probe", &CudaCopier::probe, py::arg("nbytes") = size_t{1} << 30, py::arg("repeats") = 3,
           "probe(nbytes=1 GiB, repeats=3) -> dict of host->device bytes/s from pinned and pageable memory")
      .def_property_readonly("library", [](const CudaCopier& c) { return c.runtime()->library(); })
      .def_property_readonly("runtime_version", [](const CudaCopier& c) { return c.runtime()->runtime_version(); });

  py::class_<HostBuffer>(m, "HostBuffer", py::buffer_protocol(),
                         "HostBuffer(nbytes, cuda=None): host memory for expert bytes, page-locked "
                         "through `cuda` (a CudaCopier) when given, else page-aligned. A writable "
                         "1-D uint8 buffer; freed when the last reference goes.")
      .def(py::init([](size_t nbytes, py::object cuda) {
             std::shared_ptr<CudaRuntime> rt;
             if (!cuda.is_none()) rt = cuda.cast<CudaCopier&>().runtime();
             return std::make_unique<HostBuffer>(nbytes, rt);
           }),
           py::arg("nbytes"), py::arg("cuda") = py::none())
      .def_property_readonly("nbytes", &HostBuffer::nbytes)
      .def_property_readonly("pinned", &HostBuffer::pinned)
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {py::ssize_t{1}});
      });
}
