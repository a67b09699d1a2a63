/* LD_PRELOAD shim for the store-fault tests: pread/pread64 on the file named by
 * MS_EIO_PATH fail with EIO while the file named by MS_EIO_GATE exists. The native read
 * engine calls libc's pread through the PLT, so this interposes on it; everything else
 * passes through to the real function. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

typedef ssize_t (*pread_fn)(int, void *, size_t, off_t);

static int failing(int fd) {
  const char *path = getenv("MS_EIO_PATH");
  const char *gate = getenv("MS_EIO_GATE");
  struct stat target, mine;
  if (path == NULL || gate == NULL || access(gate, F_OK) != 0) return 0;
  if (stat(path, &target) != 0 || fstat(fd, &mine) != 0) return 0;
  return target.st_dev == mine.st_dev && target.st_ino == mine.st_ino;
}

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
