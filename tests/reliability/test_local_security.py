"""Local security of the daemon: a private runtime folder (0700) and socket (0600),
another user cannot connect, a runtime folder someone else owns is refused, and there
is no TCP listener.

"Another user" is a real second uid: the probes run under `setpriv --reuid nobody`,
which needs root (the tests skip, saying so, when not root or without setpriv).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from moestream.daemon.bench.soak.driver import DaemonProcess, child_env

NOBODY = 65534

CONNECT_AS_OTHER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(type(e).__name__, e.errno)
    sys.exit(3)
print("connected")
"""


def as_nobody(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a probe as a second uid")
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env or child_env())


@pytest.fixture
def daemon(rel_store, start_daemon) -> DaemonProcess:
    return start_daemon(rel_store)


def test_folder_0700_socket_0600_and_another_uid_cannot_connect(daemon):
    folder, sock = daemon.paths.dir, daemon.paths.socket
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    for leftover in folder.iterdir():  # everything the daemon made is private
        assert stat.S_IMODE(os.lstat(leftover).st_mode) & 0o077 == 0, leftover

    out = as_nobody(sys.executable, "-c", CONNECT_AS_OTHER, str(sock))
    assert out.returncode == 3 and out.stdout.split() == ["PermissionError", "13"], out.stdout + out.stderr

    # The socket's own mode holds even if the folder is opened for traversal.
    os.chmod(folder, 0o711)
    try:
        out = as_nobody(sys.executable, "-c", CONNECT_AS_OTHER, str(sock))
    finally:
        os.chmod(folder, 0o700)
    assert out.returncode == 3 and out.stdout.split() == ["PermissionError", "13"], out.stdout + out.stderr

    # The CLI as the other user: a clear refusal, not a hang.
    out = as_nobody(sys.executable, "-m", "moestream.client.cli", "status", "--runtime-dir", str(folder))
    assert out.returncode != 0
    assert str(folder) in out.stderr and ("Permission denied" in out.stderr or "belongs to uid" in out.stderr), (
        out.stderr
    )
    # and the daemon serves its owner as before
    assert daemon.ready()


def test_the_daemon_refuses_a_runtime_folder_it_does_not_own(rel_store, workdir):
    folder = workdir / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    if os.stat(folder).st_uid != NOBODY:
        pytest.skip("cannot chown here")
    with pytest.raises(RuntimeError, match="exited with status") as info:
        DaemonProcess.start(rel_store, folder)
    assert f"belongs to uid {NOBODY}" in str(info.value) and str(folder) in str(info.value)
    assert list(folder.iterdir()) == []  # nothing was created in it

    link = workdir / "link"
    link.symlink_to(workdir / "store-less")
    (workdir / "store-less").mkdir(mode=0o700)
    with pytest.raises(RuntimeError, match="not a folder"):
        DaemonProcess.start(rel_store, link)


def test_no_tcp_listener_only_the_unix_sockets(daemon):
    procs = [psutil.Process(daemon.pid), *psutil.Process(daemon.pid).children(recursive=True)]
    assert len(procs) >= 2, "the daemon and its heat keeper"
    for p in procs:
        inet = p.net_connections(kind="inet")
        assert inet == [], f"{p.pid} {p.name()}: {inet}"
        unix = [c.laddr for c in p.net_connections(kind="unix") if c.laddr]
        for path in unix:
            assert Path(path).parent == daemon.paths.dir, f"{p.pid}: a unix socket outside the runtime folder: {path}"
    assert str(daemon.paths.socket) in {c.laddr for c in procs[0].net_connections(kind="unix")}
