/* Shim for the store-fault tests: pread (pread64) on the file named by MS_EIO_PATH fails
 * with EIO while the file named by MS_EIO_GATE exists; everything else passes through to
 * the real function. The native read engine calls libc's pread through the PLT (Linux)
 * or a stub (macOS), so this interposes on it: loaded with LD_PRELOAD on Linux, and on
 * macOS with DYLD_INSERT_LIBRARIES through dyld's __interpose section. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

static int failing(int fd) {
  const char *path = getenv("MS_EIO_PATH");
  const char *gate = getenv("MS_EIO_GATE");
  struct stat target, mine;
  if (path == NULL || gate == NULL || access(gate, F_OK) != 0) return 0;
  if (stat(path, &target) != 0 || fstat(fd, &mine) != 0) return 0;
  return target.st_dev == mine.st_dev && target.st_ino == mine.st_ino;
}

#if defined(__APPLE__)
/* dyld applies the pairs in __DATA,__interpose to every image but this one, so the call
 * to pread below reaches the real function. */
static ssize_t eio_pread(int fd, void *buf, size_t n, off_t off) {
  if (failing(fd)) {
    errno = EIO;
    return -1;
  }
  return pread(fd, buf, n, off);
}

__attribute__((used)) static const struct {
  const void *replacement;
  const void *replacee;
} interposers[] __attribute__((section("__DATA,__interpose"))) = {{(const void *)eio_pread, (const void *)pread}};
#else
typedef ssize_t (*pread_fn)(int, void *, size_t, off_t);

static ssize_t call(const char *name, int fd, void *buf, size_t n, off_t off) {
  pread_fn real = (pread_fn)dlsym(RTLD_NEXT, name);
  if (failing(fd)) {
    errno = EIO;
    return -1;
  }
  return real(fd, buf, n, off);
}

ssize_t pread(int fd, void *buf, size_t n, off_t off) { return call("pread", fd, buf, n, off); }
ssize_t pread64(int fd, void *buf, size_t n, off_t off) { return call("pread64", fd, buf, n, off); }
#endif
