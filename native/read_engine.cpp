// The native read engine; see read_engine.h for the contract.
#include "read_engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "crc32.h"

namespace moestream {

using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kStagingGranule = 64 * 1024;  // staging sizes are rounded to this
constexpr uint64_t kMaxLength = uint64_t{1} << 30;
constexpr int kMaxThreads = 256;
constexpr size_t kHugePage = 2 * 1024 * 1024;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

double micros_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

std::string errno_text(int err) {
  char buf[256];
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
  return std::string(strerror_r(err, buf, sizeof buf));  // the GNU variant returns char*
#else
  if (strerror_r(err, buf, sizeof buf) != 0) std::snprintf(buf, sizeof buf, "error %d", err);
  return std::string(buf);
#endif
}

std::string where(const char* function, const std::string& path, uint64_t offset, uint64_t length) {
  return std::string("[") + function + "] " + path + " offset=" + std::to_string(offset) +
         " length=" + std::to_string(length);
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// Percentiles over a bounded ring of the most recent samples (nearest rank).
class LatencyWindow {
 public:
  explicit LatencyWindow(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)) {
    samples_.reserve(capacity_);
  }
  void add(double us) {
    if (samples_.size() < capacity_) {
      samples_.push_back(us);
    } else {
      samples_[next_] = us;
      next_ = (next_ + 1) % capacity_;
    }
  }
  void clear() {
    samples_.clear();
    next_ = 0;
  }
  LatencySummary summary() const {
    LatencySummary s;
    s.count = samples_.size();
    if (samples_.empty()) return s;
    std::vector<double> v(samples_);
    std::sort(v.begin(), v.end());
    auto rank = [&](double q) {
      size_t i = static_cast<size_t>(q * static_cast<double>(v.size()));
      return v[std::min(i, v.size() - 1)];
    };
    s.p50 = rank(0.50);
    s.p90 = rank(0.90);
    s.p99 = rank(0.99);
    s.max = v.back();
    return s;
  }

 private:
  size_t capacity_;
  std::vector<double> samples_;
  size_t next_ = 0;
};

// Turns direct I/O off on an open file (shared by every thread reading it).
bool disable_direct(int fd) {
#if defined(__APPLE__)
  return ::fcntl(fd, F_NOCACHE, 0) == 0;
#elif defined(O_DIRECT)
  int flags = ::fcntl(fd, F_GETFL);
  return flags != -1 && ::fcntl(fd, F_SETFL, flags & ~O_DIRECT) == 0;
#else
  (void)fd;
  return true;
#endif
}

}  // namespace

// ---- AlignedBuffer -------------------------------------------------------------------

void AlignedBuffer::Free::operator()(unsigned char* p) const noexcept { std::free(p); }

AlignedBuffer AlignedBuffer::allocate(size_t capacity, bool huge_pages) {
  void* p = nullptr;
  size_t align = kDirectAlign;
#if defined(MADV_HUGEPAGE)
  if (huge_pages && capacity >= kHugePage) {
    align = kHugePage;
    capacity = round_up(capacity, kHugePage);
  }
#endif
  if (capacity == 0 || ::posix_memalign(&p, align, capacity) != 0) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
  if (align == kHugePage) ::madvise(p, capacity, MADV_HUGEPAGE);
#endif
  AlignedBuffer b;
  b.ptr_.reset(static_cast<unsigned char*>(p));
  b.capacity_ = capacity;
  return b;
}

// ---- Impl ----------------------------------------------------------------------------

namespace {

struct File {
  std::string path;
  int fd = -1;
  uint64_t size = 0;
  std::atomic<bool> direct{false};
  // Set after the first successful direct read: from then on EINVAL is a real error,
  // not the filesystem refusing direct I/O.
  std::atomic<bool> direct_confirmed{false};
  std::mutex mu;  // guards fallback_reason and the switch to buffered reads
  std::string fallback_reason;

  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

struct Job {
  uint64_t id = 0;
  File* file = nullptr;
  ReadRequest req;
  Clock::time_point submitted;
};

// What a worker learned about one read, for the statistics.
struct Outcome {
  bool attempted = false;  // a pread was issued
  bool direct = false;
  bool checksum_failed = false;
  uint64_t bytes_read = 0;
  double read_us = 0;
};

}  // namespace

struct ReadEngine::Impl {
  explicit Impl(const EngineOptions& o)
      : opt(o), latency(o.latency_window), read_latency(o.latency_window) {}

  EngineOptions opt;

  mutable std::mutex mu;  // guards everything below except the staging pool
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  std::deque<Job> queue;
  std::unordered_set<uint64_t> inflight;  // queued or being read
  std::unordered_map<uint64_t, Completion> done;  // completed, not yet taken
  std::vector<std::unique_ptr<File>> files;
  std::vector<std::thread> workers;
  uint64_t next_id = 1;
  bool stopping = false;
  bool closed = false;

  EngineStats counters;
  LatencyWindow latency;
  LatencyWindow read_latency;
  bool busy = false;  // at least one request in flight since busy_since
  Clock::time_point busy_since;
  double busy_seconds = 0;

  std::mutex pool_mu;
  std::vector<AlignedBuffer> free_buffers;

  AlignedBuffer acquire(size_t n) {
    {
      std::lock_guard<std::mutex> lk(pool_mu);
      size_t best = free_buffers.size();
      for (size_t i = 0; i < free_buffers.size(); ++i) {
        if (free_buffers[i].capacity() >= n &&
            (best == free_buffers.size() || free_buffers[i].capacity() < free_buffers[best].capacity()))
          best = i;
      }
      if (best != free_buffers.size()) {
        AlignedBuffer b = std::move(free_buffers[best]);
        free_buffers.erase(free_buffers.begin() + static_cast<std::ptrdiff_t>(best));
        return b;
      }
    }
    return AlignedBuffer::allocate(round_up(n, kStagingGranule), opt.huge_pages);
  }

  void release(AlignedBuffer b) {
    std::lock_guard<std::mutex> lk(pool_mu);
    // One buffer per worker is all the reuse there is; more would only hold memory.
    if (free_buffers.size() < static_cast<size_t>(opt.threads)) free_buffers.push_back(std::move(b));
  }

  File* file_locked(int fid, const char* function) const {
    if (fid < 0 || static_cast<size_t>(fid) >= files.size())
      throw std::invalid_argument(std::string("[") + function + "] unknown file id " +
                                  std::to_string(fid) + " (use an id returned by open())");
    return files[static_cast<size_t>(fid)].get();
  }

  void switch_to_buffered(File& f, int err) {
    std::lock_guard<std::mutex> lk(f.mu);
    if (!f.direct.load()) return;  // another worker got there first
    if (!disable_direct(f.fd)) return;  // the next pread reports the error
    f.direct.store(false);
    f.fallback_reason = "the first direct read failed: " + errno_text(err) +
                        " (the filesystem refuses direct I/O); reading buffered";
  }

  std::string short_read(const File& f, const ReadRequest& r, size_t got, size_t skip) {
    struct stat st;
    std::string size = ::fstat(f.fd, &st) == 0 ? std::to_string(st.st_size) : "unknown";
    size_t delivered = got > skip ? got - skip : 0;
    return where("pread", f.path, r.offset, r.length) + ": short read: got " +
           std::to_string(std::min<uint64_t>(delivered, r.length)) + " of " + std::to_string(r.length) +
           " bytes; the file is " + size + " bytes long (truncated or rewritten?)";
  }

  // Reads [start, start + need) into buf (span = need rounded up to kDirectAlign),
  // falling back to buffered reads when the filesystem refuses direct ones. Returns
  // an error message, "" on success.
  std::string read_block(File& f, uint64_t start, unsigned char* buf, size_t span, size_t need,
                         size_t skip, const ReadRequest& r, Outcome& o) {
    for (;;) {
      const bool direct = f.direct.load();
      bool retry_buffered = false;
      size_t got = 0;
      while (got < need) {
        ssize_t n = ::pread(f.fd, buf + got, span - got, static_cast<off_t>(start + got));
        o.attempted = true;
        if (n < 0) {
          const int err = errno;
          if (err == EINTR) continue;
          if (err == EINVAL && direct && !f.direct_confirmed.load()) {
            switch_to_buffered(f, err);
            if (!f.direct.load()) {
              retry_buffered = true;
              break;
            }
          }
          return where("pread", f.path, r.offset, r.length) + ": " + errno_text(err);
        }
        if (n == 0) return short_read(f, r, got, skip);
        got += static_cast<size_t>(n);
        // A direct read that stops short of the request at an unaligned point has hit
        // the end of the file; the next pread would fail with EINVAL, not return 0.
        if (direct && got < need && got % kDirectAlign) return short_read(f, r, got, skip);
      }
      if (retry_buffered) continue;
      if (direct) f.direct_confirmed.store(true);
      o.direct = direct;
      o.bytes_read = got;
      return "";
    }
  }

  void run(Job& job, Completion& c, Outcome& o) {
    c.id = job.id;
    c.owner = std::move(job.req.owner);
    const ReadRequest& r = job.req;
    File& f = *job.file;
    try {
      const uint64_t start = r.offset / kDirectAlign * kDirectAlign;
      const size_t skip = static_cast<size_t>(r.offset - start);
      const size_t need = skip + static_cast<size_t>(r.length);
      const size_t span = round_up(need, kDirectAlign);
      AlignedBuffer buf = r.keep_data ? AlignedBuffer::allocate(span) : acquire(span);

      const auto t0 = Clock::now();
      std::string err = read_block(f, start, buf.data(), span, need, skip, r, o);
      o.read_us = micros_between(t0, Clock::now());

      if (err.empty() && opt.verify && r.crc32) {
        const uint32_t got = crc32(buf.data() + skip, static_cast<size_t>(r.length));
        if (got != *r.crc32) {
          o.checksum_failed = true;
          err = where("verify", f.path, r.offset, r.length) + ": checksum mismatch: expected " +
                hex32(*r.crc32) + " got " + hex32(got) + " (the store is damaged; convert it again)";
        }
      }
      if (err.empty()) {
        for (const CopyTarget& t : r.targets)
          std::memcpy(t.dest + t.dest_offset, buf.data() + skip + t.src_offset, t.nbytes);
        c.ok = true;
        c.nbytes = r.length;
        if (r.keep_data) {
          c.data = std::move(buf);
          c.data_offset = skip;
        }
      } else {
        c.error = std::move(err);
      }
      if (buf && !r.keep_data) release(std::move(buf));
    } catch (const std::bad_alloc&) {
      c.error = where("staging", f.path, r.offset, r.length) + ": cannot allocate an aligned buffer";
    } catch (const std::exception& e) {
      c.error = where("read", f.path, r.offset, r.length) + ": " + e.what();
    }
    c.latency_us = static_cast<uint64_t>(micros_between(job.submitted, Clock::now()));
  }

  // Called with mu held.
  void account(const Completion& c, const Outcome& o) {
    counters.reads += 1;
    if (c.ok) {
      counters.bytes += c.nbytes;
      (o.direct ? counters.direct_reads : counters.buffered_reads) += 1;
    } else {
      counters.errors += 1;
    }
    if (o.checksum_failed) counters.checksum_failures += 1;
    counters.bytes_read += o.bytes_read;
    latency.add(static_cast<double>(c.latency_us));
    if (o.attempted) read_latency.add(o.read_us);
  }

  // Called with mu held, after requests left `inflight`.
  void mark_idle_if_empty(Clock::time_point now) {
    if (busy && inflight.empty()) {
      busy_seconds += std::chrono::duration<double>(now - busy_since).count();
      busy = false;
    }
  }

  void worker_loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lk(mu);
        work_cv.wait(lk, [&] { return stopping || !queue.empty(); });
        if (stopping) return;  // close() has cancelled what was queued
        job = std::move(queue.front());
        queue.pop_front();
      }
      Completion c;
      Outcome o;
      run(job, c, o);
      {
        std::lock_guard<std::mutex> lk(mu);
        account(c, o);
        inflight.erase(job.id);
        mark_idle_if_empty(Clock::now());
        done.emplace(job.id, std::move(c));
      }
      done_cv.notify_all();
    }
  }

  std::string validate_locked(const ReadRequest& r, size_t index, File*& out) const {
    const std::string which = "[submit] request " + std::to_string(index) + ": ";
    if (r.fid < 0 || static_cast<size_t>(r.fid) >= files.size())
      return which + "unknown file id " + std::to_string(r.fid) + " (use an id returned by open())";
    File* f = files[static_cast<size_t>(r.fid)].get();
    if (r.length == 0 || r.length > kMaxLength)
      return which + "length " + std::to_string(r.length) + " is not in 1.." + std::to_string(kMaxLength);
    if (r.offset > f->size || r.length > f->size - r.offset)
      return which + "offset=" + std::to_string(r.offset) + " length=" + std::to_string(r.length) +
             " goes past the end of " + f->path + " (" + std::to_string(f->size) + " bytes)";
    for (size_t i = 0; i < r.targets.size(); ++i) {
      const CopyTarget& t = r.targets[i];
      const std::string tw = which + "target " + std::to_string(i) + ": ";
      if (t.src_offset > r.length || t.nbytes > r.length - t.src_offset)
        return tw + "source range [" + std::to_string(t.src_offset) + ", " +
               std::to_string(t.src_offset + t.nbytes) + ") is outside the block of " +
               std::to_string(r.length) + " bytes";
      if (t.dest_offset > t.dest_size || t.nbytes > t.dest_size - t.dest_offset)
        return tw + "destination range [" + std::to_string(t.dest_offset) + ", " +
               std::to_string(t.dest_offset + t.nbytes) + ") is outside the destination of " +
               std::to_string(t.dest_size) + " bytes";
      if (t.nbytes > 0 && t.dest == nullptr) return tw + "null destination";
    }
    out = f;
    return "";
  }
};

// ---- ReadEngine ----------------------------------------------------------------------

ReadEngine::ReadEngine(const EngineOptions& options) {
  if (options.threads < 1 || options.threads > kMaxThreads)
    throw std::invalid_argument("[ReadEngine] threads must be in 1.." + std::to_string(kMaxThreads) +
                                ", got " + std::to_string(options.threads));
  impl_ = std::make_unique<Impl>(options);
  try {
    for (int i = 0; i < options.threads; ++i) impl_->workers.emplace_back([this] { impl_->worker_loop(); });
  } catch (...) {
    close();
    throw;
  }
}

ReadEngine::~ReadEngine() {
  if (impl_) close();
}

const EngineOptions& ReadEngine::options() const noexcept { return impl_->opt; }

int ReadEngine::open(const std::string& path) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (impl_->stopping) throw EngineClosed("[open] the engine is closed");
  }
  const int flags = O_RDONLY | O_CLOEXEC;
  int fd = -1;
  bool direct = false;
  std::string reason;
  if (impl_->opt.direct) {
#if defined(__APPLE__)
    fd = ::open(path.c_str(), flags);
    if (fd < 0) {
      const int err = errno;
      throw IoError(err, "open", path, errno_text(err));
    }
    if (::fcntl(fd, F_NOCACHE, 1) == 0)
      direct = true;
    else
      reason = "fcntl(F_NOCACHE) failed: " + errno_text(errno) + "; reading buffered";
#elif defined(O_DIRECT)
    fd = ::open(path.c_str(), flags | O_DIRECT);
    if (fd >= 0) {
      direct = true;
    } else if (errno == EINVAL) {
      reason = "open with O_DIRECT failed: " + errno_text(EINVAL) +
               " (the filesystem refuses direct I/O); reading buffered";
    } else {
      const int err = errno;
      throw IoError(err, "open", path, errno_text(err));
    }
#else
    reason = "direct I/O is not available on this platform; reading buffered";
#endif
  } else {
    reason = "direct I/O was turned off (ReadEngine(direct=False))";
  }
  if (fd < 0) {
    fd = ::open(path.c_str(), flags);
    if (fd < 0) {
      const int err = errno;
      throw IoError(err, "open", path, errno_text(err));
    }
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(err, "open", path, "fstat failed: " + errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const int err = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
    throw IoError(err, "open", path, "not a regular file");
  }
  auto f = std::make_unique<File>();
  f->path = path;
  f->fd = fd;
  f->size = static_cast<uint64_t>(st.st_size);
  f->direct.store(direct);
  f->fallback_reason = reason;

  std::lock_guard<std::mutex> lk(impl_->mu);
  if (impl_->stopping) throw EngineClosed("[open] the engine is closed");  // f closes the fd
  impl_->files.push_back(std::move(f));
  return static_cast<int>(impl_->files.size() - 1);
}

FileInfo ReadEngine::file_info(int fid) const {
  std::lock_guard<std::mutex> lk(impl_->mu);  // files are freed only under it, by close()
  if (impl_->closed) throw EngineClosed("[file_info] the engine is closed");
  File* f = impl_->file_locked(fid, "file_info");
  std::lock_guard<std::mutex> flk(f->mu);
  return FileInfo{f->path, f->size, f->direct.load(), f->fallback_reason};
}

std::vector<FileInfo> ReadEngine::files() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  std::vector<FileInfo> out;
  out.reserve(impl_->files.size());
  for (const auto& f : impl_->files) {
    std::lock_guard<std::mutex> flk(f->mu);  // always taken after mu, never before
    out.push_back(FileInfo{f->path, f->size, f->direct.load(), f->fallback_reason});
  }
  return out;
}

std::vector<uint64_t> ReadEngine::submit(std::vector<ReadRequest>& requests) {
  Impl& s = *impl_;
  std::vector<uint64_t> ids;
  ids.reserve(requests.size());
  {
    std::lock_guard<std::mutex> lk(s.mu);
    if (s.stopping) throw EngineClosed("[submit] the engine is closed");
    std::vector<File*> resolved(requests.size(), nullptr);
    for (size_t i = 0; i < requests.size(); ++i) {
      std::string err = s.validate_locked(requests[i], i, resolved[i]);
      if (!err.empty()) throw std::invalid_argument(err);
    }
    const auto now = Clock::now();
    if (!s.busy && !requests.empty()) {
      s.busy = true;
      s.busy_since = now;
    }
    for (size_t i = 0; i < requests.size(); ++i) {
      const uint64_t id = s.next_id++;
      s.inflight.insert(id);
      s.queue.push_back(Job{id, resolved[i], std::move(requests[i]), now});
      ids.push_back(id);
    }
  }
  if (ids.size() == 1)
    s.work_cv.notify_one();
  else if (!ids.empty())
    s.work_cv.notify_all();
  return ids;
}

std::vector<Completion> ReadEngine::wait(const std::vector<uint64_t>* ids, std::optional<double> timeout_s) {
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lk(s.mu);
  if (s.closed) throw EngineClosed("[wait] the engine is closed");
  const bool explicit_ids = ids != nullptr;
  std::vector<uint64_t> want;
  if (explicit_ids) {
    want = *ids;
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end()), want.end());
    for (uint64_t id : want)
      if (!s.inflight.count(id) && !s.done.count(id))
        throw UnknownRequest("[wait] request " + std::to_string(id) +
                             " is unknown or its completion was already taken");
  } else {
    want.assign(s.inflight.begin(), s.inflight.end());
    for (const auto& kv : s.done) want.push_back(kv.first);
    std::sort(want.begin(), want.end());
  }
  const auto deadline =
      timeout_s ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(std::max(0.0, *timeout_s)))
                : Clock::time_point::max();
  size_t k = 0;  // want[0, k) are done
  for (;;) {
    if (s.closed || s.stopping) throw EngineClosed("[wait] the engine was closed while waiting");
    while (k < want.size()) {
      const uint64_t id = want[k];
      if (s.done.count(id)) {
        ++k;
      } else if (s.inflight.count(id)) {
        break;
      } else if (explicit_ids) {
        throw UnknownRequest("[wait] the completion of request " + std::to_string(id) +
                             " was taken by another caller");
      } else {
        want.erase(want.begin() + static_cast<std::ptrdiff_t>(k));
      }
    }
    if (k == want.size()) break;
    if (timeout_s) {
      if (Clock::now() >= deadline) {
        size_t left = 0;
        for (size_t i = k; i < want.size(); ++i) left += s.inflight.count(want[i]);
        throw WaitTimeout("[wait] timed out after " + std::to_string(*timeout_s) + " s with " +
                          std::to_string(left) + " of " + std::to_string(want.size()) +
                          " requests still pending");
      }
      s.done_cv.wait_until(lk, deadline);
    } else {
      s.done_cv.wait(lk);
    }
  }
  std::vector<Completion> out;
  out.reserve(want.size());
  for (uint64_t id : want) {
    auto it = s.done.find(id);
    if (it == s.done.end()) {
      if (explicit_ids)
        throw UnknownRequest("[wait] the completion of request " + std::to_string(id) +
                             " was taken by another caller");
      continue;
    }
    out.push_back(std::move(it->second));
    s.done.erase(it);
  }
  return out;
}

std::vector<Completion> ReadEngine::poll() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.closed) throw EngineClosed("[poll] the engine is closed");
  std::vector<Completion> out;
  out.reserve(s.done.size());
  for (auto& kv : s.done) out.push_back(std::move(kv.second));
  s.done.clear();
  std::sort(out.begin(), out.end(), [](const Completion& a, const Completion& b) { return a.id < b.id; });
  return out;
}

std::optional<Completion> ReadEngine::take(uint64_t id) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.closed) throw EngineClosed("[take] the engine is closed");
  auto it = s.done.find(id);
  if (it != s.done.end()) {
    Completion c = std::move(it->second);
    s.done.erase(it);
    return c;
  }
  if (s.inflight.count(id)) return std::nullopt;
  throw UnknownRequest("[take] request " + std::to_string(id) + " is unknown or its completion was already taken");
}

size_t ReadEngine::pending() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->inflight.size();
}

EngineStats ReadEngine::stats() const {
  const Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  EngineStats st = s.counters;
  st.latency_us = s.latency.summary();
  st.read_latency_us = s.read_latency.summary();
  st.seconds_busy = s.busy_seconds;
  if (s.busy) st.seconds_busy += std::chrono::duration<double>(Clock::now() - s.busy_since).count();
  return st;
}

void ReadEngine::reset_stats() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  s.counters = EngineStats{};
  s.latency.clear();
  s.read_latency.clear();
  s.busy_seconds = 0;
  s.busy_since = Clock::now();
}

std::vector<Completion> ReadEngine::close() {
  Impl& s = *impl_;
  std::vector<Completion> left;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    if (s.stopping) return left;
    s.stopping = true;
    const auto now = Clock::now();
    for (Job& job : s.queue) {
      Completion c;
      c.id = job.id;
      c.owner = std::move(job.req.owner);
      c.error = where("close", job.file->path, job.req.offset, job.req.length) +
                ": cancelled, the engine was closed before this read started";
      c.latency_us = static_cast<uint64_t>(micros_between(job.submitted, now));
      s.inflight.erase(job.id);
      s.done.emplace(job.id, std::move(c));
    }
    s.queue.clear();
    s.mark_idle_if_empty(now);
  }
  s.work_cv.notify_all();
  s.done_cv.notify_all();
  for (std::thread& t : s.workers)
    if (t.joinable()) t.join();
  std::lock_guard<std::mutex> lk(s.mu);
  s.workers.clear();
  s.inflight.clear();  // the workers have finished every read they started
  s.mark_idle_if_empty(Clock::now());
  left.reserve(s.done.size());
  for (auto& kv : s.done) left.push_back(std::move(kv.second));
  s.done.clear();
  s.files.clear();
  {
    std::lock_guard<std::mutex> plk(s.pool_mu);
    s.free_buffers.clear();
  }
  s.closed = true;
  return left;
}

bool ReadEngine::closed() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->stopping;
}

}  // namespace moestream
