"""The daemon's private runtime folder: its socket, single-instance lock, pid file and log.

The folder is `$XDG_RUNTIME_DIR/moestream` or `/tmp/moestream-<uid>` on Linux and
`~/Library/Caches/moestream` on macOS (see `default_runtime_dir` in shared/settings.py):
never macOS's `/tmp`, whose daily cleanup deletes files untouched for 3 days, and the
lock and pid files are never touched after the daemon starts. It must be a real folder
owned by the user with no group or other permissions, because whoever can reach the
socket can use the daemon.

Single instance: the daemon takes an exclusive `flock` on `daemon.lock` before it binds
its socket, and holds it for its whole life. ZeroMQ's ipc bind silently unlinks a socket
file that a live daemon still listens on, so binding first would steal the socket from
the running daemon. Because the kernel drops the lock when its holder dies, a free lock
with a socket or pid file left behind means a daemon crashed: those files are stale
and are removed before the new daemon binds.

The files can still vanish under a running daemon (a cleanup job, a user's `rm`), so a
socket that accepts a connection counts as a running daemon whatever the files say
(`daemon_running`): the next daemon refuses to start rather than unlink that socket, and
clients go on finding the daemon.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .file_lock import lock_exclusive

SOCKET_NAME = "moestream.sock"
# The socket's name while the daemon takes no new connections (near its open-file limit:
# daemon/limits.py); a client that finds it hears busy.
PAUSED_SOCKET_NAME = ".moestream.sock.paused"
LOCK_NAME = "daemon.lock"
PID_NAME = "daemon.pid"
LOG_NAME = "daemon.log"


class RuntimeDirError(RuntimeError):
    """The runtime folder cannot be used safely; the message says why and what to do."""


class DaemonAlreadyRunning(RuntimeDirError):
    """Another daemon holds the single-instance lock of this runtime folder."""

    def __init__(self, pid: int | None, runtime_dir: Path) -> None:
        self.pid = pid
        who = f"pid {pid}" if pid is not None else "pid unknown (its pid file is missing)"
        super().__init__(
            f"a moestream daemon is already running ({who}, runtime folder {runtime_dir}); "
            "stop it with `moestreamctl stop`, or give another --runtime-dir / MOESTREAM_RUNTIME_DIR"
        )


def max_socket_path_bytes(platform: str | None = None) -> int:
    """The longest ipc socket path this OS accepts (sun_path less its NUL byte)."""
    return 103 if (sys.platform if platform is None else platform) == "darwin" else 107


@dataclass(frozen=True)
class RuntimePaths:
    """Where one daemon keeps its files."""

    dir: Path
    log: Path

    @classmethod
    def from_settings(cls, settings, env: Mapping[str, str] | None = None) -> "RuntimePaths":
        """The paths for `settings` (a `moestream.shared.settings.Settings`)."""
        folder = Path(settings.runtime_path(env))
        log = Path(settings.log_file) if settings.log_file else folder / LOG_NAME
        return cls(dir=folder, log=log)

    @property
    def socket(self) -> Path:
        return self.dir / SOCKET_NAME

    @property
    def paused_socket(self) -> Path:
        return self.dir / PAUSED_SOCKET_NAME

    @property
    def lock(self) -> Path:
        return self.dir / LOCK_NAME

    @property
    def pid_file(self) -> Path:
        return self.dir / PID_NAME

    def check_socket_path(self) -> None:
        """Raise `RuntimeDirError` when the socket path is too long for this OS to bind."""
        path = str(self.socket)
        limit = max_socket_path_bytes()
        if len(os.fsencode(path)) > limit:
            raise RuntimeDirError(
                f"the socket path {path} is {len(os.fsencode(path))} bytes, over this system's "
                f"limit of {limit}; choose a shorter runtime folder with --runtime-dir or "
                "MOESTREAM_RUNTIME_DIR (for example /tmp/moestream-$UID)"
            )

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint of the daemon's socket (checked with `check_socket_path`)."""
        self.check_socket_path()
        return f"ipc://{self.socket}"


RUNTIME_DIR_OPTION = "--runtime-dir / MOESTREAM_RUNTIME_DIR"


def ensure_private_dir(
    folder: Path,
    *,
    what: str = "runtime folder",
    option: str = RUNTIME_DIR_OPTION,
    error: type[Exception] = RuntimeDirError,
    cannot_create: type[Exception] | None = None,
) -> Path:
    """Create `folder` with mode 0700 if needed, then check that it is private to us
    (`check_private_dir`, with the same `what`, `option` and `error`); a folder that
    cannot be made raises `cannot_create` (default `error`)."""
    try:
        # An existing folder is checked below exactly like one made here.
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise (cannot_create or error)(f"cannot create the {what} {folder}: {e.strerror}") from e
    check_private_dir(folder, what=what, option=option, error=error)
    return folder


def check_private_dir(
    folder: Path,
    *,
    what: str = "runtime folder",
    option: str = RUNTIME_DIR_OPTION,
    error: type[Exception] = RuntimeDirError,
) -> None:
    """Raise `error` unless `folder` is a real folder of ours, mode 0700 or stricter;
    the messages call it the `what` and name the `option` that chooses another."""
    try:
        st = os.lstat(folder)
    except OSError as e:
        raise error(f"cannot inspect the {what} {folder}: {e.strerror}") from e
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise error(
            f"the {what} {folder} is not a folder (a symlink or a file is there); "
            f"remove it or choose another with {option}"
        )
    if st.st_uid != os.getuid():
        raise error(
            f"the {what} {folder} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
            f"someone else may be using it: choose another with {option}"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise error(
            f"the {what} {folder} has mode {mode:04o}, open to other users; "
            f"make it private with `chmod 700 {folder}` or choose another folder"
        )


def read_pid(paths: RuntimePaths) -> int | None:
    """The pid in the pid file, or None when there is no readable one."""
    try:
        text = paths.pid_file.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RuntimeDirError(f"cannot read {paths.pid_file}: {e.strerror}") from e
    return int(text) if text.isdigit() else None


def lock_is_held(paths: RuntimePaths) -> bool:
    """Whether a daemon holds the single-instance lock (that is: one is running)."""
    try:
        fd = os.open(paths.lock, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise RuntimeDirError(f"cannot open {paths.lock}: {e.strerror}") from e
    try:
        # A shared lock is refused only while the daemon holds its exclusive one; this
        # probe holds it for microseconds (the daemon retries around it).
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# What connecting to a socket file with no listener gives: the file left by a daemon that
# died (ECONNREFUSED), none at all, or something else in its place.
_NOBODY_LISTENS = (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK, errno.EPROTOTYPE)


def socket_answers(paths: RuntimePaths, timeout: float = 1.0) -> bool:
    """Whether a process listens on the daemon's socket: a plain connect, closed at once
    (ZeroMQ drops a peer that leaves before its handshake)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(os.fsencode(paths.socket))
    except OSError as e:
        if e.errno in _NOBODY_LISTENS:
            return False
        if isinstance(e, TimeoutError) or e.errno == errno.EAGAIN:
            return True  # a listener whose backlog is full is a busy daemon, not none
        raise RuntimeDirError(f"cannot connect to {paths.socket} to see whether a daemon listens: {e}") from e
    finally:
        s.close()
    return True


def daemon_running(paths: RuntimePaths) -> bool:
    """Whether a daemon runs in this runtime folder: it holds the lock, or, its lock file
    gone, its socket still answers."""
    return lock_is_held(paths) or socket_answers(paths)


class InstanceLock:
    """The daemon's single-instance lock; hold it from before bind until after close."""

    def __init__(self, paths: RuntimePaths, fd: int, stale_pid: int | None, removed: list[Path]) -> None:
        self.paths = paths
        self._fd: int | None = fd
        # What a crashed predecessor left behind and this lock removed (for the log).
        self.stale_pid = stale_pid
        self.removed = removed

    @classmethod
    def acquire(cls, paths: RuntimePaths, *, wait: float = 0.5) -> "InstanceLock":
        """Take the lock, clear a crashed daemon's files, write our pid file.

        Raises `DaemonAlreadyRunning` naming the running daemon's pid.
        """
        ensure_private_dir(paths.dir)
        try:
            fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise RuntimeDirError(f"cannot open the lock file {paths.lock}: {e.strerror}") from e
        try:
            # A client's `lock_is_held` probe holds a shared lock for an instant; a
            # running daemon holds it for good.
            locked = lock_exclusive(fd, wait)
        except OSError as e:
            os.close(fd)
            raise RuntimeDirError(f"cannot lock {paths.lock}: {e.strerror}") from e
        if not locked:
            os.close(fd)
            raise DaemonAlreadyRunning(read_pid(paths), paths.dir)
        try:
            # A lock of our own but a socket that answers: the running daemon's lock
            # file was deleted under it. Binding would unlink its live socket.
            if socket_answers(paths):
                raise DaemonAlreadyRunning(read_pid(paths), paths.dir)
            stale_pid = read_pid(paths)
            removed = []
            for leftover in (paths.socket, paths.paused_socket, paths.pid_file):
                try:
                    leftover.unlink()
                    removed.append(leftover)
                except FileNotFoundError:
                    continue
            _write_pid(paths.pid_file, os.getpid())
        except BaseException:
            os.close(fd)
            raise
        return cls(paths, fd, stale_pid, removed)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the pid file and socket file, then drop the lock. Idempotent."""
        if self._fd is None:
            return
        try:
            for path in (self.paths.pid_file, self.paths.socket, self.paths.paused_socket):
                path.unlink(missing_ok=True)
        finally:
            # The lock file itself stays: unlinking it would let two daemons lock two
            # different files of the same name.
            os.close(self._fd)
            self._fd = None


def _write_pid(path: Path, pid: int) -> None:
    tmp = path.with_name(f".{path.name}.{pid}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{pid}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
