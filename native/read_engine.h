// The native read engine: a pool of threads that read whole expert blocks from the
// expert store's layer files with pread, bypassing the page cache, and copy the bytes
// into caller-owned destinations (the expert pool's arrays).
//
// Why bypass the cache: the store is larger than memory by construction, so cached
// expert pages only evict the resident weights and the pool; the pool is the cache.
// Files are opened with O_DIRECT on Linux and F_NOCACHE on macOS. A filesystem that
// refuses direct I/O (EINVAL at open, or at the first read) is read buffered instead,
// and the file's info says so and why.
//
// Reads are aligned: each read starts at the block's offset rounded down to
// kDirectAlign and covers its length rounded up, into an aligned staging buffer taken
// from a reusable pool; the requested bytes are then copied out to each target. The
// store pads every block to a multiple of 16 KiB, so the rounded read stays inside
// the file. A read that ends before the block does (a truncated file) is an error,
// never a zero fill.
//
// Threading: submit, wait, poll, take, stats may be called from any thread. Worker
// threads never call back into the caller: a request's `owner` (which keeps its
// destinations alive) is moved into its Completion and destroyed only by whoever
// destroys that Completion, so the Python bindings can make sure that happens with
// the GIL held.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace moestream {

// Alignment of offsets, lengths and buffers for direct I/O (the largest logical block
// size in practice).
constexpr size_t kDirectAlign = 4096;

// An I/O failure where there is no request to report it on (opening a file). Carries
// errno so the bindings can raise the matching OSError subclass.
class IoError : public std::runtime_error {
 public:
  // what() is "[function] path: reason"; reason() is "[function] reason".
  IoError(int error_number, const char* function, std::string path, const std::string& reason)
      : std::runtime_error(std::string("[") + function + "] " + path + ": " + reason),
        errno_(error_number),
        path_(std::move(path)),
        reason_(std::string("[") + function + "] " + reason) {}
  int error_number() const noexcept { return errno_; }
  const std::string& path() const noexcept { return path_; }
  const std::string& reason() const noexcept { return reason_; }

 private:
  int errno_;
  std::string path_;
  std::string reason_;
};

// wait() ran out of time; the requests stay pending and can be waited on again.
class WaitTimeout : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A request id that was never issued or whose completion was already taken.
class UnknownRequest : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The engine was closed; it accepts no more work.
class EngineClosed : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Memory aligned to kDirectAlign, freed on destruction.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Throws std::bad_alloc when the memory cannot be had. With huge_pages, a buffer of
  // 2 MiB or more is 2 MiB aligned and asks for transparent huge pages (Linux): a
  // direct read into physically contiguous memory needs far fewer DMA segments, so
  // the block layer splits it into fewer, larger device requests.
  static AlignedBuffer allocate(size_t capacity, bool huge_pages = false);
  unsigned char* data() const noexcept { return ptr_.get(); }
  size_t capacity() const noexcept { return capacity_; }
  explicit operator bool() const noexcept { return static_cast<bool>(ptr_); }

 private:
  struct Free {
    void operator()(unsigned char* p) const noexcept;
  };
  std::unique_ptr<unsigned char, Free> ptr_;
  size_t capacity_ = 0;
};

// After the read, bytes [src_offset, src_offset + nbytes) of the block are copied to
// dest + dest_offset. dest_size is the size of the memory at dest (for bounds checks).
struct CopyTarget {
  unsigned char* dest = nullptr;
  size_t dest_size = 0;
  size_t dest_offset = 0;
  size_t src_offset = 0;
  size_t nbytes = 0;
};

struct ReadRequest {
  int fid = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::vector<CopyTarget> targets;
  // Keep the block in engine-owned memory and hand it over in Completion::data.
  bool keep_data = false;
  // Checked over [0, length) when the engine was built with verify = true.
  std::optional<uint32_t> crc32;
  // Opaque; keeps the destinations alive. Moved into the Completion, never destroyed
  // by a worker thread.
  std::shared_ptr<void> owner;
};

struct Completion {
  uint64_t id = 0;
  bool ok = false;
  std::string error;  // "" when ok; else "[function] path offset=.. length=..: reason"
  uint64_t nbytes = 0;  // bytes of the block delivered (the request's length) when ok
  uint64_t latency_us = 0;  // from submit to completion
  AlignedBuffer data;  // when keep_data and ok: the block starts at data_offset
  size_t data_offset = 0;
  std::shared_ptr<void> owner;
};

struct FileInfo {
  std::string path;
  uint64_t size = 0;  // at open
  bool direct = false;  // reads bypass the page cache
  std::string fallback_reason;  // why not, when direct was asked for; "" otherwise
};

struct LatencySummary {
  uint64_t count = 0;  // samples in the window
  double p50 = 0, p90 = 0, p99 = 0, max = 0;
};

struct EngineStats {
  uint64_t bytes = 0;  // bytes delivered (sum of completed lengths)
  uint64_t bytes_read = 0;  // bytes read from files, alignment included
  uint64_t reads = 0;  // requests completed, ok or not
  uint64_t errors = 0;
  uint64_t direct_reads = 0;
  uint64_t buffered_reads = 0;
  uint64_t checksum_failures = 0;
  LatencySummary latency_us;  // submit to completion, over the last window
  LatencySummary read_latency_us;  // the pread calls alone, over the last window
  double seconds_busy = 0;  // wall time with at least one request pending
};

struct EngineOptions {
  int threads = 4;
  bool direct = true;
  bool verify = false;
  // Staging buffers of 2 MiB or more on transparent huge pages (see AlignedBuffer).
  bool huge_pages = true;
  size_t latency_window = 8192;
};

class ReadEngine {
 public:
  // Starts `threads` worker threads. Throws std::invalid_argument on bad options.
  explicit ReadEngine(const EngineOptions& options);
  // Closes the engine (see close()) and discards what is left.
  ~ReadEngine();
  ReadEngine(const ReadEngine&) = delete;
  ReadEngine& operator=(const ReadEngine&) = delete;

  // Opens a file for reading and returns its id. Throws IoError (with errno) when it
  // cannot be opened or is not a regular file.
  int open(const std::string& path);
  // Throws std::invalid_argument for an unknown id.
  FileInfo file_info(int fid) const;
  // file_info of every open file, by id; empty once closed.
  std::vector<FileInfo> files() const;

  // Queues the requests and returns their ids, in order. All or none: if one request
  // is invalid (unknown file, bounds) std::invalid_argument is thrown, nothing is
  // queued and `requests` is left as it was. On success its elements are moved from.
  std::vector<uint64_t> submit(std::vector<ReadRequest>& requests);

  // Blocks until the given requests (when ids is null: all that are pending or
  // completed at the call) are done, then returns their completions, in id order, and
  // forgets them. Throws WaitTimeout after timeout_s seconds (none: no limit), and
  // UnknownRequest for an id that is not pending or whose completion was taken.
  std::vector<Completion> wait(const std::vector<uint64_t>* ids, std::optional<double> timeout_s);
  // The completions not yet taken, in id order; never blocks.
  std::vector<Completion> poll();
  // The completion of `id` if it is done (and forgets it), else nothing. Throws
  // UnknownRequest for an id that is not pending or whose completion was taken.
  std::optional<Completion> take(uint64_t id);
  // Requests queued or being read.
  size_t pending() const;

  EngineStats stats() const;
  void reset_stats();
  const EngineOptions& options() const noexcept;

  // Stops the workers: reads in progress finish, queued ones complete with an error
  // ("cancelled"). Joins the threads and closes the files. Returns every completion
  // not yet taken so that the caller decides where their owners are destroyed.
  // Idempotent; afterwards every call but stats/pending/close throws EngineClosed.
  std::vector<Completion> close();
  bool closed() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace moestream
