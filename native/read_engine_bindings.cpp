// Python bindings of the native read engine (moestream._native; the module is made in
// module.cpp).
//
// The GIL is released around every call that can block (open, submit, wait, close,
// crc32 of a large buffer). Destinations are held as buffer exports (Py_buffer) from
// submit until the request's completion is destroyed; the engine's workers never
// destroy them (see read_engine.h), and every path that does runs with the GIL held.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "crc32.h"
#include "read_engine.h"

namespace py = pybind11;
using namespace moestream;

namespace {

constexpr size_t kCrcReleaseGil = 256 * 1024;  // below this, releasing the GIL costs more than it saves

// The buffer exports of one request's destinations. While an export is held the
// exporter cannot move or free the memory (a bytearray refuses to resize).
struct BufferHold {
  std::vector<std::unique_ptr<Py_buffer>> views;  // Py_buffer can point into itself: never moved
  ~BufferHold() {
    for (auto& v : views) PyBuffer_Release(v.get());
  }
};

std::shared_ptr<void> make_owner(std::unique_ptr<BufferHold> hold) {
  // Destroyed with the GIL held on every path we know of; acquiring it here (a no-op
  // when held) keeps any other path safe too.
  return std::shared_ptr<BufferHold>(hold.release(), [](BufferHold* h) {
    py::gil_scoped_acquire gil;
    delete h;
  });
}

struct PyCompletion {
  uint64_t id = 0;
  bool ok = false;
  std::string error;
  uint64_t nbytes = 0;
  uint64_t latency_us = 0;
  py::object data = py::none();
};

// Needs the GIL: builds Python objects and drops the request's owner.
PyCompletion to_python(Completion&& c) {
  PyCompletion p;
  p.id = c.id;
  p.ok = c.ok;
  p.error = std::move(c.error);
  p.nbytes = c.nbytes;
  p.latency_us = c.latency_us;
  if (c.ok && c.data)
    p.data = py::bytes(reinterpret_cast<const char*>(c.data.data() + c.data_offset), c.nbytes);
  c.owner.reset();
  return p;
}

py::list to_python(std::vector<Completion>&& cs) {
  py::list out;
  for (Completion& c : cs) out.append(py::cast(to_python(std::move(c))));
  cs.clear();
  return out;
}

uint64_t non_negative(py::handle value, const std::string& what) {
  long long v;
  try {
    v = value.cast<long long>();
  } catch (const py::cast_error&) {
    throw py::type_error(what + " must be an int, got " + std::string(py::str(py::type::handle_of(value).attr("__name__"))));
  }
  if (v < 0) throw py::value_error(what + " must be >= 0, got " + std::to_string(v));
  return static_cast<uint64_t>(v);
}

std::optional<uint32_t> checksum_arg(py::handle crc, const std::string& what) {
  if (crc.is_none()) return std::nullopt;
  uint64_t v = non_negative(crc, what + "crc32");
  if (v > 0xFFFFFFFFull) throw py::value_error(what + "crc32 " + std::to_string(v) + " is not a 32-bit value");
  return static_cast<uint32_t>(v);
}

// A tuple or list, as a sequence; TypeError otherwise.
py::sequence as_tuple(py::handle item, const std::string& message) {
  if (!PyTuple_Check(item.ptr()) && !PyList_Check(item.ptr())) throw py::type_error(message);
  return py::reinterpret_borrow<py::sequence>(item);
}

// Takes a writable, C-contiguous buffer export of `dest`, kept in `hold`.
Py_buffer* export_dest(py::handle dest, BufferHold& hold, const std::string& what) {
  if (!PyObject_CheckBuffer(dest.ptr()))
    throw py::type_error(what + "dest must support the buffer protocol (bytearray, numpy array, "
                         "memoryview(mx_array)), got " +
                         std::string(py::str(py::type::handle_of(dest).attr("__name__"))));
  auto view = std::make_unique<Py_buffer>();
  if (PyObject_GetBuffer(dest.ptr(), view.get(), PyBUF_RECORDS) != 0) {
    py::error_already_set err;
    throw py::value_error(what + "dest must be a writable buffer: " + std::string(err.what()));
  }
  if (!PyBuffer_IsContiguous(view.get(), 'C')) {
    PyBuffer_Release(view.get());
    throw py::value_error(what + "dest must be C-contiguous (make a contiguous copy, or pass the array it views)");
  }
  hold.views.push_back(std::move(view));
  return hold.views.back().get();
}

ReadRequest make_request(int fid, py::handle offset, py::handle length, py::handle targets, py::handle crc,
                         const std::string& what) {
  ReadRequest r;
  r.fid = fid;
  r.offset = non_negative(offset, what + "offset");
  r.length = non_negative(length, what + "length");
  r.crc32 = checksum_arg(crc, what);
  if (targets.is_none()) {
    r.keep_data = true;
    return r;
  }
  auto hold = std::make_unique<BufferHold>();
  size_t j = 0;
  if (!PyTuple_Check(targets.ptr()) && !PyList_Check(targets.ptr()))
    throw py::type_error(what + "targets must be a list of (dest, dest_offset, src_offset, nbytes), or None");
  for (py::handle item : py::reinterpret_borrow<py::sequence>(targets)) {
    const std::string tw = what + "target " + std::to_string(j) + ": ";
    py::sequence t = as_tuple(item, tw + "expected a tuple (dest, dest_offset, src_offset, nbytes)");
    if (t.size() != 4) throw py::value_error(tw + "expected a tuple (dest, dest_offset, src_offset, nbytes)");
    Py_buffer* view = export_dest(t[0], *hold, tw);
    CopyTarget ct;
    ct.dest = static_cast<unsigned char*>(view->buf);
    ct.dest_size = static_cast<size_t>(view->len);
    ct.dest_offset = non_negative(t[1], tw + "dest_offset");
    ct.src_offset = non_negative(t[2], tw + "src_offset");
    ct.nbytes = non_negative(t[3], tw + "nbytes");
    r.targets.push_back(ct);
    ++j;
  }
  if (!hold->views.empty()) r.owner = make_owner(std::move(hold));
  return r;
}

py::dict latency_dict(const LatencySummary& s) {
  py::dict d;
  d["p50"] = s.p50;
  d["p90"] = s.p90;
  d["p99"] = s.p99;
  d["max"] = s.max;
  d["count"] = s.count;
  return d;
}

class PyReadEngine {
 public:
  PyReadEngine(int threads, bool direct, bool verify, bool huge_pages) {
    EngineOptions o;
    o.threads = threads;
    o.direct = direct;
    o.verify = verify;
    o.huge_pages = huge_pages;
    engine_ = std::make_unique<ReadEngine>(o);
  }

  ~PyReadEngine() { close(); }

  int open(const std::string& path) {
    py::gil_scoped_release nogil;
    return engine_->open(path);
  }

  py::dict file_info(int fid) const { return info_dict(engine_->file_info(fid)); }

  static py::dict info_dict(const FileInfo& info) {
    py::dict d;
    d["path"] = info.path;
    d["size"] = info.size;
    d["direct"] = info.direct;
    d["fallback_reason"] = info.fallback_reason.empty() ? py::object(py::none()) : py::str(info.fallback_reason);
    return d;
  }

  uint64_t submit(int fid, py::handle offset, py::handle length, py::handle targets, py::handle crc) {
    std::vector<ReadRequest> reqs;
    reqs.push_back(make_request(fid, offset, length, targets, crc, "[submit] "));
    return enqueue(reqs).at(0);
  }

  std::vector<uint64_t> submit_batch(py::iterable requests) {
    std::vector<ReadRequest> reqs;
    size_t i = 0;
    for (py::handle item : requests) {
      const std::string what = "[submit_batch] request " + std::to_string(i) + ": ";
      py::sequence t = as_tuple(item, what + "expected a tuple (fid, offset, length, targets[, crc32])");
      if (t.size() != 4 && t.size() != 5)
        throw py::value_error(what + "expected a tuple (fid, offset, length, targets[, crc32])");
      const int fid = static_cast<int>(non_negative(t[0], what + "fid"));
      py::object crc = t.size() == 5 ? py::object(t[4]) : py::object(py::none());
      reqs.push_back(make_request(fid, t[1], t[2], t[3], crc, what));
      ++i;
    }
    return enqueue(reqs);
  }

  py::list wait(std::optional<std::vector<uint64_t>> ids, std::optional<double> timeout) {
    if (timeout && *timeout < 0) throw py::value_error("[wait] timeout must be >= 0 or None");
    std::vector<Completion> done;  // destroyed after the GIL is back
    {
      py::gil_scoped_release nogil;
      done = engine_->wait(ids ? &*ids : nullptr, timeout);
    }
    return to_python(std::move(done));
  }

  py::list poll() { return to_python(engine_->poll()); }

  py::object take(uint64_t id) {
    std::optional<Completion> c = engine_->take(id);
    if (!c) return py::none();
    return py::cast(to_python(std::move(*c)));
  }

  size_t pending() const { return engine_->pending(); }

  py::dict stats() const {
    EngineStats s = engine_->stats();
    py::dict d;
    d["bytes"] = s.bytes;
    d["bytes_read"] = s.bytes_read;
    d["reads"] = s.reads;
    d["errors"] = s.errors;
    d["direct_reads"] = s.direct_reads;
    d["buffered_reads"] = s.buffered_reads;
    d["checksum_failures"] = s.checksum_failures;
    d["latency_us"] = latency_dict(s.latency_us);
    d["read_latency_us"] = latency_dict(s.read_latency_us);
    d["seconds_busy"] = s.seconds_busy;
    d["pending"] = engine_->pending();
    d["threads"] = engine_->options().threads;
    py::list files;
    for (const FileInfo& info : engine_->files()) files.append(info_dict(info));
    d["files"] = files;
    return d;
  }

  void reset_stats() { engine_->reset_stats(); }

  void close() {
    if (!engine_) return;
    std::vector<Completion> left;  // their owners are released after the GIL is back
    {
      py::gil_scoped_release nogil;
      left = engine_->close();
    }
    left.clear();
  }

  bool closed() const { return engine_->closed(); }
  const EngineOptions& options() const { return engine_->options(); }

 private:
  std::vector<uint64_t> enqueue(std::vector<ReadRequest>& reqs) {
    // On failure nothing is consumed, and `reqs` (holding buffer exports) is destroyed
    // by the caller with the GIL held.
    py::gil_scoped_release nogil;
    return engine_->submit(reqs);
  }

  std::unique_ptr<ReadEngine> engine_;
};

uint32_t py_crc32(py::handle data, py::handle value) {
  std::optional<uint32_t> start = checksum_arg(value, "[crc32] start ");
  Py_buffer view;
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_STRIDES) != 0) throw py::error_already_set();
  std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> guard(&view, PyBuffer_Release);
  if (!PyBuffer_IsContiguous(&view, 'C')) throw py::value_error("[crc32] the buffer must be C-contiguous");
  const size_t n = static_cast<size_t>(view.len);
  if (n < kCrcReleaseGil) return crc32(view.buf, n, start.value_or(0));
  py::gil_scoped_release nogil;
  return crc32(view.buf, n, start.value_or(0));
}

}  // namespace

void bind_read_engine(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      // OSError(errno, strerror, filename) picks the subclass (FileNotFoundError, ...).
      py::object exc = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(PyExc_OSError, "isN", e.error_number(), e.reason().c_str(),
                                PyUnicode_DecodeFSDefault(e.path().c_str())));
      if (exc) PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (const WaitTimeout& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const UnknownRequest& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const EngineClosed& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.attr("DIRECT_ALIGN") = kDirectAlign;
  m.attr("CRC32_IMPLEMENTATION") = crc32_implementation();

  m.def("crc32", &py_crc32, py::arg("buffer"), py::arg("value") = 0,
        "crc32(buffer, value=0) -> int\n\n"
        "CRC-32 of a C-contiguous buffer, continuing from `value`; equal to zlib.crc32.");

  py::class_<PyCompletion>(m, "Completion", "The outcome of one read request.")
      .def_readonly("id", &PyCompletion::id, "The request id returned by submit.")
      .def_readonly("ok", &PyCompletion::ok, "True when the block was read (and verified) and copied.")
      .def_readonly("error", &PyCompletion::error,
                    "'' when ok; else '[function] path offset=.. length=..: reason'.")
      .def_readonly("nbytes", &PyCompletion::nbytes, "Bytes of the block delivered (its length) when ok, else 0.")
      .def_readonly("latency_us", &PyCompletion::latency_us, "Microseconds from submit to completion.")
      .def_readonly("data", &PyCompletion::data,
                    "The block as bytes when it was submitted with targets=None, else None.")
      .def("__repr__", [](const PyCompletion& c) {
        std::string s = "Completion(id=" + std::to_string(c.id) + ", ok=" + (c.ok ? "True" : "False") +
                        ", nbytes=" + std::to_string(c.nbytes) + ", latency_us=" + std::to_string(c.latency_us);
        if (!c.ok) s += ", error=" + std::string(py::repr(py::str(c.error)));
        return s + ")";
      });

  py::class_<PyReadEngine>(m, "ReadEngine",
                           "Reads whole expert blocks on a pool of C++ threads.\n\n"
                           "ReadEngine(threads=4, direct=True, verify=False). With direct=True files "
                           "bypass the page cache (O_DIRECT on Linux, F_NOCACHE on macOS), falling back "
                           "to buffered reads where the filesystem refuses (see file_info). With "
                           "verify=True a request's crc32, when given, is checked over its block. With "
                           "huge_pages=True (Linux) staging buffers of 2 MiB or more use transparent huge "
                           "pages, so that a large direct read becomes fewer, larger device requests.")
      .def(py::init<int, bool, bool, bool>(), py::arg("threads") = 4, py::arg("direct") = true,
           py::arg("verify") = false, py::arg("huge_pages") = true)
      .def("open", &PyReadEngine::open, py::arg("path"),
           "open(path) -> int\n\nOpen a file for reading; returns its id. Raises OSError (with "
           "errno and filename) when it cannot be opened or is not a regular file.")
      .def("file_info", &PyReadEngine::file_info, py::arg("fid"),
           "file_info(fid) -> dict\n\n{'path', 'size', 'direct': bool, 'fallback_reason': str | None}: "
           "whether reads of this file bypass the page cache, and if not, why.")
      .def("submit", &PyReadEngine::submit, py::arg("fid"), py::arg("offset"), py::arg("length"),
           py::arg("targets"), py::arg("crc32") = py::none(),
           "submit(fid, offset, length, targets, crc32=None) -> int\n\n"
           "Queue a read of bytes [offset, offset+length) of file `fid`. targets is a list of "
           "(dest, dest_offset, src_offset, nbytes): after the read, bytes [src_offset, "
           "src_offset+nbytes) of the block are copied to dest at dest_offset. dest is any "
           "writable C-contiguous buffer (bytearray, numpy array, memoryview(mx_array)); the "
           "engine holds it until the completion is taken. targets=[] reads and drops the "
           "block; targets=None keeps it and hands it over as Completion.data (bytes). "
           "crc32 is checked over the block when the engine has verify=True. Bounds are "
           "checked here (ValueError); nothing is queued when they fail. Returns the id.")
      .def("submit_batch", &PyReadEngine::submit_batch, py::arg("requests"),
           "submit_batch([(fid, offset, length, targets, crc32_or_None), ...]) -> list[int]\n\n"
           "submit() for many requests at once, all or none.")
      .def("wait", &PyReadEngine::wait, py::arg("ids") = py::none(), py::arg("timeout") = py::none(),
           "wait(ids=None, timeout=None) -> list[Completion]\n\n"
           "Block (GIL released) until the given requests, or all pending and completed ones "
           "when ids is None, are done; return their completions in id order and forget them. "
           "Raises TimeoutError after `timeout` seconds (they stay pending), KeyError for an id "
           "that is unknown or already taken.")
      .def("poll", &PyReadEngine::poll,
           "poll() -> list[Completion]\n\nThe completions not yet taken, in id order; never blocks.")
      .def("take", &PyReadEngine::take, py::arg("id"),
           "take(id) -> Completion | None\n\nThat request's completion if it is done (and forget "
           "it), else None. KeyError for an id that is unknown or already taken.")
      .def("pending", &PyReadEngine::pending, "pending() -> int\n\nRequests queued or being read.")
      .def("stats", &PyReadEngine::stats,
           "stats() -> dict\n\nbytes (delivered), bytes_read (from files, alignment included), "
           "reads, errors, direct_reads, buffered_reads, checksum_failures, latency_us and "
           "read_latency_us ({p50, p90, p99, max, count} over the most recent reads: submit to "
           "completion, and the pread calls alone), seconds_busy (wall time with a request "
           "pending), pending, threads, files (file_info of every open file: direct or "
           "buffered, and why).")
      .def("reset_stats", &PyReadEngine::reset_stats, "Zero the statistics.")
      .def("close", &PyReadEngine::close,
           "close()\n\nStop the engine: reads in progress finish, queued ones are cancelled, "
           "threads are joined, files closed, held destinations released. Idempotent.")
      .def_property_readonly("closed", &PyReadEngine::closed)
      .def_property_readonly("threads", [](const PyReadEngine& e) { return e.options().threads; })
      .def_property_readonly("direct", [](const PyReadEngine& e) { return e.options().direct; })
      .def_property_readonly("verify", [](const PyReadEngine& e) { return e.options().verify; })
      .def_property_readonly("huge_pages", [](const PyReadEngine& e) { return e.options().huge_pages; })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyReadEngine& e, py::handle, py::handle, py::handle) {
        e.close();
        return false;
      })
      .def("__repr__", [](const PyReadEngine& e) {
        return "ReadEngine(threads=" + std::to_string(e.options().threads) +
               ", direct=" + (e.options().direct ? "True" : "False") +
               ", verify=" + (e.options().verify ? "True" : "False") + (e.closed() ? ", closed" : "") + ")";
      });
}
