"""macOS as the main target, tested on Linux where that is honest: a daemon whose lock and
pid files were deleted under it (macOS's daily /tmp cleanup did that), the launchd
service's file and its reinstall, durable writes, privacy permissions, case-insensitive
folders, and what `--help` and `bench io` say per platform.

The platform-specific functions take the platform as a parameter, so the darwin branch
runs here too; where a check can only mean something on a Mac, the test says what it
checks there.
"""

from __future__ import annotations

import json
import os
import plistlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_cli import clean_env, started_daemon
from tiny_models import tiny_store

from moestream.shared import service_files as sf
from moestream.shared.runtime_dir import (
    DaemonAlreadyRunning,
    InstanceLock,
    RuntimePaths,
    daemon_running,
    lock_is_held,
    socket_answers,
)
from moestream.shared.settings import default_runtime_dir

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def store():
    with tiny_store("msmac") as path:
        yield path


# ---- 1. lock and pid files deleted under a running daemon ------------------------------


def cli(*args: str):
    """`moestreamctl ARGS` in this process, without the developer's moestream settings."""
    from click.testing import CliRunner

    from moestream.client.cli import main

    env = {k: None for k in os.environ if k.startswith("MOESTREAM_")} | {"XDG_CONFIG_HOME": None}
    return CliRunner().invoke(main, list(args), env=env)


def test_a_daemon_whose_lock_and_pid_files_were_deleted_is_still_found_and_used(store):
    with started_daemon(store, "msmc") as paths:
        pid = int(paths.pid_file.read_text())
        paths.lock.unlink()
        paths.pid_file.unlink()
        assert not lock_is_held(paths)  # what `status` used to go by
        assert socket_answers(paths) and daemon_running(paths)
        rt = ("--runtime-dir", str(paths.dir))

        status = cli("status", "--json", *rt)
        assert status.exit_code == 0, status.output
        assert json.loads(status.output)["pid"] == pid

        again = cli("start", "--model", str(store), *rt)
        assert again.exit_code == 1 and f"already running (pid {pid})" in again.output

        # The daemon's own check, without the client's: its lock is free (a new file),
        # but the socket answers, so it refuses rather than unlink that socket.
        with pytest.raises(DaemonAlreadyRunning, match="already running"):
            InstanceLock.acquire(paths)
        assert socket_answers(paths)

        gen = cli("generate", "--model", str(store), *rt, "--max-tokens", "3", "--json", "hi")
        assert gen.exit_code == 0, gen.output
        assert "starting one" not in gen.output
        after = json.loads(cli("status", "--json", *rt).output)
        assert after["pid"] == pid and after["requests"]["completed"] == 1

        stop = cli("stop", *rt)
        assert stop.exit_code == 0 and f"stopped (pid {pid})" in stop.output, stop.output
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert not daemon_running(paths)


def test_the_default_runtime_folder_is_one_no_cleanup_empties():
    env = {"HOME": "/Users/ann", "XDG_RUNTIME_DIR": "/run/user/501"}
    assert default_runtime_dir(env, "darwin") == Path("/Users/ann/Library/Caches/moestream")
    assert default_runtime_dir(env, "linux") == Path("/run/user/501/moestream")
    fallback = Path(f"/tmp/moestream-{os.getuid()}")
    assert default_runtime_dir({"HOME": "/home/ann"}, "linux") == fallback
    # A home so long that the socket would pass macOS's 103 bytes: /tmp, still checked.
    assert default_runtime_dir({"HOME": "/Users/" + "a" * 80}, "darwin") == fallback
    assert default_runtime_dir({}, "darwin") == fallback


def test_a_daemon_of_an_earlier_version_is_looked_for_where_it_ran():
    from moestream.shared.settings import earlier_runtime_dir

    # macOS's default moved from /tmp/moestream-UID: `start` looks there too, so that an
    # upgrade does not start a second daemon beside the running one.
    assert earlier_runtime_dir({"HOME": "/Users/ann"}, "darwin") == Path(f"/tmp/moestream-{os.getuid()}")
    assert earlier_runtime_dir({"HOME": "/Users/" + "a" * 80}, "darwin") is None  # that is the default still
    assert earlier_runtime_dir({"HOME": "/home/ann"}, "linux") is None


def test_a_stale_socket_file_is_no_daemon(tmp_path):
    import socket

    paths = RuntimePaths(dir=tmp_path, log=tmp_path / "daemon.log")
    assert not socket_answers(paths)  # no file
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(paths.socket))
    assert not socket_answers(paths)  # a file nobody listens on: a crashed daemon's
    s.listen(1)
    assert socket_answers(paths)
    s.close()


# ---- 5, 7, 9. the launchd plist ---------------------------------------------------------


def _unit_stop_timeout(service: sf.Service) -> int:
    (line,) = [x for x in sf.load_template(service.unit_template).splitlines() if x.startswith("TimeoutStopSec=")]
    return int(line.removeprefix("TimeoutStopSec="))


@pytest.mark.parametrize("service", [sf.DAEMON, sf.OPENAI], ids=lambda s: s.log_stem)
def test_the_plist_gives_the_units_stop_time_and_enough_open_files(service, tmp_path):
    argv = sf.daemon_argv("/usr/bin/python3", ["--model", "/m"], "darwin")
    rendered = sf.render_service_file("darwin", tmp_path, argv, {"PATH": "/usr/bin"}, service)
    doc = plistlib.loads(rendered.content)
    assert type(doc["ExitTimeOut"]) is int and doc["ExitTimeOut"] == _unit_stop_timeout(service)
    assert service is not sf.DAEMON or doc["ExitTimeOut"] == 30
    # launchd's default soft limit is 256; the hard limit it leaves is unlimited.
    assert doc["SoftResourceLimits"] == {"NumberOfFiles": 10240}


def test_under_launchd_the_daemon_logs_once_to_a_rotated_file(tmp_path):
    # The plist runs the daemon with --no-log-to-stderr: launchd's StandardErrorPath
    # only catches what comes before the log is open. Linux keeps stderr (the journal).
    assert "--no-log-to-stderr" in sf.daemon_argv("/usr/bin/python3", (), "darwin")
    assert "--no-log-to-stderr" not in sf.daemon_argv("/usr/bin/python3", (), "linux")

    from moestream.daemon.main import close_log, open_log

    paths = RuntimePaths(dir=tmp_path, log=tmp_path / "daemon.log")
    log = open_log(paths, to_stderr=False, rotate_bytes=4000)
    try:
        for i in range(200):
            log.info("line %d of a daemon that runs for weeks", i)
    finally:
        close_log(log)
    assert paths.log.stat().st_size <= 4000
    old = tmp_path / "daemon.log.1"
    assert 0 < old.stat().st_size <= 4000
    assert "line 199 " in paths.log.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["daemon.log", "daemon.log.1"]  # one old file kept


def test_start_in_the_foreground_without_stderr_logs_only_to_its_file(store, tmp_path):
    import shutil
    import tempfile
    import time

    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msfg"))
    paths = RuntimePaths(dir=rt, log=rt / "daemon.log")
    err = tmp_path / "err.log"
    argv = [sys.executable, "-m", "moestream.client.cli", "start", "--foreground", "--no-log-to-stderr"]
    try:
        with open(err, "wb") as f:
            proc = subprocess.Popen(
                [*argv, "--model", str(store), "--runtime-dir", str(rt)], env=clean_env(), stderr=f, cwd="/"
            )
        deadline = time.monotonic() + 60
        while "model ready" not in (paths.log.read_text() if paths.log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        logged = paths.log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(rt, ignore_errors=True)
    assert "starting (pid" in logged and "lock released" in logged
    assert "starting (pid" not in err.read_text() and "model ready" not in err.read_text()


# ---- 4. durability ----------------------------------------------------------------------


def test_every_sync_goes_through_the_durability_helper():
    bare = re.compile(r"\bos\.f(data)?sync\(")
    found = []
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in (".venv", "build", "tests") or rel == Path("shared/durable.py"):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if bare.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "use moestream.shared.durable.sync_fd / sync_file:\n" + "\n".join(found)


def test_the_durability_helper_asks_macos_for_a_full_flush(tmp_path):
    from moestream.shared.durable import FSYNC, FULLFSYNC, sync_fd

    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x")
        assert sync_fd(fd, platform="linux") == FSYNC
        # macOS: F_FULLFSYNC, which flushes the drive's cache (fsync does not). Elsewhere
        # Python's fcntl has no F_FULLFSYNC, so the darwin branch falls back to fsync.
        assert sync_fd(fd, platform="darwin") == (FULLFSYNC if sys.platform == "darwin" else FSYNC)
    finally:
        os.close(fd)


# ---- 10. what --help says ---------------------------------------------------------------


def test_runtime_dir_help_names_this_platforms_default():
    from moestream.shared.settings import definition

    d = definition("runtime_dir")
    assert d.default_text("darwin") == "~/Library/Caches/moestream"
    assert "XDG_RUNTIME_DIR" in d.default_text("linux") and "Caches" not in d.default_text("linux")
    assert "Caches" in d.default_text() and "XDG_RUNTIME_DIR" in d.default_text()  # the README names both
    from click.testing import CliRunner

    from moestream.client.cli import main

    mine = d.default_text(sys.platform)
    for command in ("start", "status", "stop", "logs", "serve-openai"):
        out = CliRunner().invoke(main, [command, "--help"])
        assert out.exit_code == 0, out.output
        assert mine in " ".join(out.output.split()), (command, out.output)


# ---- 2. reinstalling the launchd service ------------------------------------------------

# A stand-in for macOS's launchctl: it keeps the label known for two `print`s after
# `bootout`, and fails the first $BUSY_BOOTSTRAPS bootstraps with launchd's exit 5, as
# the real one does while the label is still going away. Every call is logged.
FAKE_LAUNCHCTL = r"""#!/bin/sh
d="$FAKE_LAUNCHCTL_DIR"
echo "$*" >> "$d/calls"
count() { n=$(cat "$d/$1" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$d/$1"; echo $n; }
case "$1" in
  print)
    if [ -f "$d/booted_out" ] && [ "$(count prints_after)" -le 2 ]; then echo "state = exiting"; exit 0; fi
    if [ -f "$d/loaded" ] && [ ! -f "$d/booted_out" ]; then echo "state = running"; exit 0; fi
    echo "Could not find service" >&2; exit 113;;
  bootout) touch "$d/booted_out"; exit 0;;
  enable) exit 0;;
  bootstrap)
    if [ "$(count bootstraps)" -gt "$BUSY_BOOTSTRAPS" ]; then exit 0; fi
    echo "Bootstrap failed: 5: Input/output error" >&2; exit 5;;
esac
exit 64
"""


def _fake_launchctl(tmp_path: Path, busy: int) -> dict[str, str]:
    bin_dir, state = tmp_path / "bin", tmp_path / "launchd"
    bin_dir.mkdir()
    state.mkdir()
    exe = bin_dir / "launchctl"
    exe.write_text(FAKE_LAUNCHCTL)
    exe.chmod(0o755)
    (state / "loaded").touch()  # an earlier install is loaded
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LAUNCHCTL_DIR": str(state), "BUSY_BOOTSTRAPS": str(busy)}


def test_reinstall_waits_for_launchd_to_let_go_and_retries_a_busy_bootstrap(store, tmp_path):
    from click.testing import CliRunner

    from moestream.client.cli import main

    home = tmp_path / "home"
    env = {k: None for k in os.environ if k.startswith("MOESTREAM_")} | {"HOME": str(home), "XDG_CONFIG_HOME": None}
    env |= _fake_launchctl(tmp_path, busy=2)
    out = CliRunner().invoke(main, ["service", "install", "--platform", "darwin", "--model", str(store)], env=env)
    assert out.exit_code == 0, out.output
    assert "loaded dev.moestream.daemon" in out.output
    calls = [line.split()[0] for line in (tmp_path / "launchd" / "calls").read_text().splitlines()]
    # loaded? -> bootout -> still there, still there, gone -> enable -> busy, busy, loaded
    assert calls == ["print", "bootout", "print", "print", "print", "enable", "bootstrap", "bootstrap", "bootstrap"]


def test_a_bootstrap_that_stays_busy_fails_saying_so(tmp_path):
    from moestream.client.cli.service import ManagerError, check_retrying

    env = dict(os.environ) | _fake_launchctl(tmp_path, busy=1000)
    with pytest.raises(ManagerError, match=r"exited with status 5 \(\d+ tries over 1 s\): Bootstrap failed: 5"):
        check_retrying(["launchctl", "bootstrap", "gui/501", "/x.plist"], env, within_s=1.0, every_s=0.2)
    with pytest.raises(ManagerError, match="status 64"):  # any other failure is not retried
        check_retrying(["launchctl", "kickstart"], env, within_s=5.0)
    assert (tmp_path / "launchd" / "calls").read_text().count("kickstart") == 1


# ---- 6. privacy permissions --------------------------------------------------------------


def test_install_warns_when_the_service_would_read_where_macos_protects(tmp_path):
    import shutil

    from click.testing import CliRunner

    from moestream.client.cli import main
    from moestream.shared.settings import demo_store_path

    home = tmp_path / "home"
    documents = home / "Documents" / "models" / "demo"
    shutil.copytree(demo_store_path(), documents)
    env = {k: None for k in os.environ if k.startswith("MOESTREAM_")} | {"HOME": str(home), "XDG_CONFIG_HOME": None}
    args = ["service", "install", "--no-load", "--model", str(documents)]
    out = CliRunner().invoke(main, [*args, "--platform", "darwin"], env=env)
    assert out.exit_code == 0, out.output
    assert f"warning: --model {documents} is in ~/Documents, which macOS protects" in out.output
    assert "Full Disk Access" in out.output and "Operation not permitted" in out.output
    # Linux has no such protection; nothing to warn about.
    out = CliRunner().invoke(main, [*args, "--platform", "linux"], env=env)
    assert out.exit_code == 0, out.output
    assert "macOS protects" not in out.output


def test_the_protected_places_are_found_whatever_their_case():
    home = Path("/Users/ann")
    assert sf.protected_place("/Users/ann/Documents/m", home) == "~/Documents"
    assert sf.protected_place("/Users/ann/desktop/m", home) == "~/Desktop"  # APFS ignores case
    assert sf.protected_place("/Users/ann/Downloads", home) == "~/Downloads"
    assert sf.protected_place("/Volumes/T7/models/x", home) == "/Volumes/T7"
    assert sf.protected_place("/Users/ann/models/x", home) is None
    assert sf.protected_place("/Users/ann/Documentsx/m", home) is None


def test_a_refused_read_on_macos_says_what_to_grant():
    import errno

    from moestream.shared.store_format import permission_advice

    eperm = PermissionError(errno.EPERM, "Operation not permitted", "/Users/ann/Documents/s/manifest.json")
    advice = permission_advice(eperm, platform="darwin", executable="/opt/py/bin/python3")
    assert "Full Disk Access" in advice and "Files and Folders" in advice and "/opt/py/bin/python3" in advice
    # Not privacy protection: an ordinary permission (EACCES), or not macOS.
    assert permission_advice(PermissionError(errno.EACCES, "Permission denied"), platform="darwin") == ""
    assert permission_advice(eperm, platform="linux") == ""


# ---- 8. case-insensitive folders ---------------------------------------------------------


def test_stores_are_compared_by_device_and_inode(tmp_path):
    from moestream.shared.store_format import canonical_folder, same_folder

    a = tmp_path / "models" / "x"
    a.mkdir(parents=True)
    (tmp_path / "Models").symlink_to(tmp_path / "models")
    # Another spelling of one folder (on macOS: ~/Models/X for ~/models/x; here a link).
    assert same_folder(tmp_path / "Models" / "x", a)
    b = tmp_path / "models" / "y"
    b.mkdir()
    assert not same_folder(a, b) and not same_folder(a, tmp_path / "none")
    # macOS: F_GETPATH spells a folder as on disk, so ~/Models/X names the heat folder of
    # ~/models/x; elsewhere the resolved path (case-sensitive filesystems need no more).
    assert canonical_folder(tmp_path / "Models" / "x", platform="darwin") == a.resolve()
    assert canonical_folder(tmp_path / "Models" / "x", platform="linux") == a.resolve()


def test_generate_takes_another_spelling_of_the_store_a_loading_daemon_serves(tmp_path):
    """On a case-insensitive filesystem (macOS's default APFS) the other spelling is the
    same path in other case, which realpath keeps as it is; on a case-sensitive one here,
    a symlink stands in for it."""
    import shutil

    import click

    from moestream.client.cli.generate import _check_served_store
    from moestream.shared.settings import demo_store_path

    served = tmp_path / "models" / "demo"
    shutil.copytree(demo_store_path(), served)
    if (tmp_path / "MODELS").exists():  # case-insensitive: the macOS case
        alias = tmp_path / "MODELS" / "DEMO"
    else:
        (tmp_path / "Models").symlink_to(tmp_path / "models")
        alias = tmp_path / "Models" / "demo"
    from moestream.shared.status import Status

    loading = Status(state="loading", model=str(served), store_id=None)  # a loading daemon knows no id yet
    _check_served_store(str(alias), loading)  # one folder: accepted
    other = tmp_path / "other"
    shutil.copytree(demo_store_path(), other)
    with pytest.raises(click.ClickException, match="serves the store"):
        _check_served_store(str(other), loading)


def test_bench_io_says_huge_pages_only_where_the_engine_has_them():
    from moestream.daemon.bench.io import huge_pages_used

    # The engine advises huge pages with MADV_HUGEPAGE, which only Linux has; on macOS
    # the option is accepted and does nothing, so the report must say False there.
    assert huge_pages_used(True, "linux") is True
    assert huge_pages_used(True, "darwin") is False
    assert huge_pages_used(False, "linux") is False
