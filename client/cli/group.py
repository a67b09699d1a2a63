"""`moestreamctl start --distributed B --distributed-launch '...'`: an expert-parallel daemon
(docs/scale-out.md) started the way a plain one is, detached.

`start` runs `mlx.launch <the options> --backend B -- python -m moestream.daemon.main ...` in
a session of its own, its output (every rank's, `mlx.launch` forwards them) appended to the
daemon's log, and waits for rank 0's socket like a plain start. The launcher's pid goes to
`group.pid` in the runtime folder: `stop` first stops rank 0 (which tells every other rank
to end), then waits for the launcher, which exits once every rank has; one that does not
within the timeout gets SIGTERM, then SIGKILL, for its whole process group (the ranks it
started on this machine and their heat keepers). Ranks on other machines end on rank 0's
STOP, or with their ssh session when `mlx.launch` is ended.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import psutil

from ...shared.runtime_dir import RuntimePaths
from ...shared.settings import Settings

# In the runtime folder: the pid of the `mlx.launch` that runs the group `start` began.
GROUP_PID = "group.pid"
# How long the launcher has to end after SIGTERM before its process group gets SIGKILL.
KILL_GRACE_SECONDS = 5.0


def launch_argv(settings: Settings, daemon_argv: list[str]) -> list[str]:
    """The `mlx.launch` command line that runs `daemon_argv` (python -m moestream.daemon.main
    and its flags) on every rank; click.UsageError for launch options it cannot take."""
    if not settings.distributed_launch:
        raise click.UsageError(
            f"--distributed {settings.distributed} needs --distributed-launch: mlx.launch's options for the "
            "group, such as '--hosts IP0,IP1' or '-n 2' (ranks on this machine)"
        )
    try:
        options = shlex.split(settings.distributed_launch)
    except ValueError as e:
        raise click.UsageError(f"--distributed-launch {settings.distributed_launch!r}: {e}") from None
    for option in options:
        if option == "--" or option.split("=")[0] == "--backend":
            raise click.UsageError(
                f"--distributed-launch: {option} is moestream's to give (the backend is --distributed's, the "
                "command is the daemon)"
            )
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        found = shutil.which("mlx.launch")
        if found is None:
            raise click.ClickException("mlx.launch is not installed beside this Python, nor on PATH (pip install mlx)")
        launcher = Path(found)
    backend = [] if settings.distributed == "any" else ["--backend", settings.distributed]
    return [str(launcher), *options, *backend, "--", *daemon_argv]


def spawn_group(argv: list[str], paths: RuntimePaths, log) -> subprocess.Popen:
    """Start the launcher detached, output to `log` (an open file); its pid to GROUP_PID."""
    # mlx.launch copies its stdin to every rank and polls it: a pipe that never ends (this
    # write end stays open in the launcher and is never written) gives it nothing to read,
    # where /dev/null would be readable, at its end, on every poll.
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=read_end,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
            pass_fds=(write_end,),
            cwd="/",
        )
    finally:
        os.close(read_end)
        os.close(write_end)
    (paths.dir / GROUP_PID).write_text(f"{proc.pid}\n")
    return proc


def _launcher(paths: RuntimePaths) -> psutil.Process | None:
    """The launcher GROUP_PID names, if it still runs (not a pid since reused: it leads its
    own session and runs mlx.launch)."""
    try:
        pid = int((paths.dir / GROUP_PID).read_text().strip())
        proc = psutil.Process(pid)
        alive = proc.status() != psutil.STATUS_ZOMBIE
        ours = alive and os.getsid(pid) == pid and any(a.endswith("mlx.launch") for a in proc.cmdline())
    except (OSError, ValueError, psutil.Error):
        return None
    return proc if ours else None


def _gone(proc: psutil.Process, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def stop_group(paths: RuntimePaths, timeout: float) -> int | None:
    """After rank 0 has stopped: wait up to `timeout` for the launcher of the group (and so
    every rank) to end, then end its process group. Returns the launcher's pid, or None
    where no group of `start`'s runs."""
    proc = _launcher(paths)
    if proc is not None and not _gone(proc, timeout):
        click.echo(f"the ranks of the group have not ended after {timeout:g} s: SIGTERM to mlx.launch's", err=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            if _gone(proc, KILL_GRACE_SECONDS):
                break
    (paths.dir / GROUP_PID).unlink(missing_ok=True)
    return None if proc is None else proc.pid
