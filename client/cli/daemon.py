"""`moestreamctl start | stop | restart | status | logs | stats`: the daemon's lifecycle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from ...shared import protocol as proto
from ...shared.file_lock import lock_exclusive
from ...shared.runtime_dir import (
    LOG_NAME,
    RuntimeDirError,
    RuntimePaths,
    daemon_running,
    ensure_private_dir,
    lock_is_held,
    pid_alive,
    read_pid,
)
from ...shared.settings import (
    DAEMON,
    SETTINGS,
    Settings,
    SettingsError,
    demo_store_path,
    earlier_runtime_dir,
    format_size,
    in_scope,
)
from ...shared.status import ElasticStatus, KeepAliveStatus, RequestInfo, Status
from ...shared.store_format import load_manifest
from ..client import Client, ClientError, DaemonDied, DaemonNotRunning
from .group import launch_argv, spawn_group, stop_group
from .values import capacity_note, runtime_dir_option, setting_options, store_option

# The settings `start`, `restart` and `service install` take as options, passed on to
# `python -m moestream.daemon.main` (names of Settings fields).
START_FLAGS = tuple(d.name for d in in_scope(DAEMON))
# Settings that name files or folders.
PATH_SETTINGS = tuple(d.name for d in SETTINGS if d.kind == "path")
LOG_TAIL_LINES = 40
# In the runtime folder: held while one client starts the daemon.
START_LOCK = "start.lock"


class StartError(click.ClickException):
    """The daemon could not be started; the message includes its log's tail."""


def resolve_settings(given: dict[str, Any], *, lenient: bool = False) -> Settings:
    """Settings from the flags given (None = not given), MOESTREAM_* and the config file.
    `lenient`, for the commands that only find a running daemon (`status`, `stop`,
    `logs`, `stats`): a bad value in the config file or the environment is left out with
    a warning, so that they still work when it would stop the daemon from starting."""
    problems: list[str] = []
    try:
        settings = Settings.resolve(given, problems=problems if lenient else None)
    except SettingsError as e:
        raise click.UsageError(str(e)) from None
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)
    return settings


def runtime_paths(settings: Settings) -> RuntimePaths:
    """The runtime folder's paths, checked: a click error naming what is wrong."""
    try:
        paths = RuntimePaths.from_settings(settings)
        paths.check_socket_path()
    except RuntimeDirError as e:
        raise click.ClickException(str(e)) from None
    return paths


def absolute_paths(given: dict[str, Any]) -> dict[str, Any]:
    """`given` with its path settings made absolute: a detached daemon or a service runs in "/"."""
    out = dict(given)
    for key in PATH_SETTINGS:
        if out.get(key) is not None:
            out[key] = os.path.abspath(os.path.expanduser(str(out[key])))
    return out


def _tail(path: Path, lines: int, *, start: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def start_daemon(
    settings: Settings, given: dict[str, Any], *, timeout: float = 120.0, echo: bool = True, join: bool = False
) -> int:
    """Start a detached daemon and wait until it answers as ready; returns its pid.

    `given` holds the flags the user gave (they are passed on; the daemon resolves the
    environment and config file itself). Raises `StartError` with its log's tail.
    Starts are serialized by a lock in the runtime folder, so that of clients starting
    one at once, one starts it; with `join` (auto-start) the others wait for that daemon
    and use it, without it they are refused as a daemon already running.
    """
    _check_store(settings)
    given = absolute_paths(given)
    paths = runtime_paths(settings)
    old = earlier_runtime_dir(os.environ) if settings.runtime_dir is None else None
    if old is not None and _running(RuntimePaths(dir=old, log=old / LOG_NAME)):
        raise click.ClickException(
            f"a moestream daemon of an earlier version runs in {old} (the runtime folder is now {paths.dir}); "
            f"stop it first with `moestreamctl stop --runtime-dir {old}`"
        )
    try:
        ensure_private_dir(paths.dir)
        paths.log.parent.mkdir(parents=True, exist_ok=True)
        start_lock = os.open(paths.dir / START_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except (RuntimeDirError, OSError) as e:
        raise click.ClickException(str(e)) from None
    try:
        tic = time.monotonic()
        if not lock_exclusive(start_lock, timeout):
            raise StartError(f"another client has been starting the daemon for over {timeout:g} s; log {paths.log}")
        # A socket that answers is a running daemon, whatever its lock and pid files say
        # (macOS's daily clean-up of /tmp may have deleted them).
        if _running(paths):
            if not join:
                raise click.ClickException(
                    f"a moestream daemon is already running (pid {running_pid(paths)}); see `moestreamctl status`"
                )
            return _wait_ready(paths, None, max(timeout - (time.monotonic() - tic), 1.0), 0)
        return _spawn(settings, given, paths, timeout, echo)
    finally:
        os.close(start_lock)  # drops the flock


def _check_store(settings: Settings) -> None:
    """The store to serve, checked before the daemon starts: a wrong folder fails here,
    not in the daemon's log."""
    if settings.model is None:
        raise click.UsageError(
            "give --model STORE (an expert store made by `moestreamctl pull` or `convert`), or set MOESTREAM_MODEL"
        )
    store_option(settings.model)


def _spawn(settings: Settings, given: dict[str, Any], paths: RuntimePaths, timeout: float, echo: bool) -> int:
    argv = [sys.executable, "-m", "moestream.daemon.main"]
    for name in START_FLAGS:
        if given.get(name) is not None:
            argv += ["--" + name.replace("_", "-"), str(given[name])]
    group = settings.distributed != "off"
    if group:
        argv = launch_argv(settings, argv)  # refuses bad launch options before anything starts
    offset = paths.log.stat().st_size if paths.log.exists() else 0
    old_umask = os.umask(0o077)
    try:
        log = open(paths.log, "ab")
    finally:
        os.umask(old_umask)
    with log:
        if group:
            proc = spawn_group(argv, paths, log)
        else:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True, cwd="/"
            )
    tic = time.monotonic()
    _wait_ready(paths, proc, timeout, offset)
    pid = (running_pid(paths) or proc.pid) if group else proc.pid
    if echo:
        how = f"rank 0 pid {pid}, under mlx.launch pid {proc.pid}" if group else f"pid {pid}"
        click.echo(
            f"moestream daemon started ({how}, {time.monotonic() - tic:.1f} s): "
            f"model {settings.model}, socket {paths.socket}, log {paths.log}",
            err=True,
        )
    return pid


def _wait_ready(paths: RuntimePaths, proc: subprocess.Popen | None, timeout: float, offset: int) -> int:
    """Wait until the daemon (`proc`, or the one holding the lock) answers as ready; its pid."""
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll() if proc is not None else (None if _running(paths) else "gone")
        if code is not None:
            raise StartError(
                f"the daemon exited with code {code} while starting; log {paths.log}:\n"
                + _tail(paths.log, LOG_TAIL_LINES, start=offset)
            )
        try:
            state = _ping_state(paths)
        except ClientError as e:
            raise StartError(f"the daemon (pid {running_pid(paths)}) answers, but not as expected: {e}") from None
        if state in proto.SERVING_STATES:
            return proc.pid if proc is not None else running_pid(paths) or 0
        if time.monotonic() > deadline:
            raise StartError(
                f"the daemon (pid {read_pid(paths)}) is not ready after {timeout:g} s (state {state}); "
                f"it keeps running; log {paths.log}:\n" + _tail(paths.log, LOG_TAIL_LINES, start=offset)
            )
        time.sleep(0.05)


def _running(paths: RuntimePaths) -> bool:
    try:
        return daemon_running(paths)
    except RuntimeDirError as e:
        raise click.ClickException(str(e)) from None


def running_pid(paths: RuntimePaths) -> int | None:
    """The running daemon's pid: its pid file's, else (the file deleted) its own answer."""
    pid = read_pid(paths)
    if pid is not None:
        return pid
    try:
        with Client(paths, timeout=5.0) as c:
            return c.ping().pid
    except ClientError:
        return None


def _ping_state(paths: RuntimePaths) -> str:
    if not paths.socket.exists():
        return "starting"
    try:
        with Client(paths, timeout=0.5) as c:
            return c.ping().state
    except (DaemonNotRunning, DaemonDied):
        return "starting"


def stop_daemon(paths: RuntimePaths, *, timeout: float = 30.0) -> int | None:
    """Stop the running daemon: a shutdown message, then SIGTERM if it does not answer; and
    every rank of a group `start` began (client/cli/group.py). Returns its pid, or None
    when none was running."""
    try:
        return _stop_rank0(paths, timeout=timeout)
    finally:
        stop_group(paths, timeout)


def _stop_rank0(paths: RuntimePaths, *, timeout: float) -> int | None:
    if not _running(paths):
        return None
    pid = running_pid(paths)
    asked = False
    try:
        with Client(paths, timeout=5.0) as c:
            c.shutdown()
            asked = True
    except ClientError as e:
        click.echo(f"the daemon did not answer the shutdown message ({e})", err=True)
    if not asked or not _wait_stopped(paths, pid, timeout):
        if pid is None:
            raise click.ClickException(f"the daemon does not stop and its pid file {paths.pid_file} is missing")
        click.echo(f"sending SIGTERM to pid {pid}", err=True)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return pid
        if not _wait_stopped(paths, pid, timeout):
            raise click.ClickException(
                f"the daemon (pid {pid}) did not stop within {timeout:g} s of SIGTERM; `kill -9 {pid}` ends it"
            )
    return pid


def _wait_stopped(paths: RuntimePaths, pid: int | None, timeout: float) -> bool:
    # The lock is released after the sockets are closed and the pid file is removed.
    # Where its lock file was deleted, the daemon's socket closes before it is done
    # (heat, files): then only the end of its process says so.
    by_lock = lock_is_held(paths)
    deadline = time.monotonic() + timeout

    def up() -> bool:
        if by_lock:
            return lock_is_held(paths)
        return _running(paths) or (pid is not None and pid_alive(pid))

    while up():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# The daemon's settings as options: `start`, `restart` and `service install` take exactly
# these (START_FLAGS), and hand them on as `given`.
daemon_setting_options = setting_options(DAEMON)


def _start_options(f):
    f = click.option(
        "--timeout", default=120.0, show_default=True, type=float, help="Seconds to wait for the daemon to be ready."
    )(f)
    return daemon_setting_options(f)


@click.command()
@_start_options
@click.option("--foreground", is_flag=True, help="Run in this process (for launchd/systemd).")
@click.option(
    "--log-to-stderr/--no-log-to-stderr",
    default=True,
    show_default=True,
    help="With --foreground: log to stderr as well as to the log file (systemd's journal keeps it; the launchd "
    "service turns it off, since nothing rotates its stderr file).",
)
def start(given, timeout, foreground, log_to_stderr) -> None:
    """Start the daemon: it loads the model once and serves every client.

    A --model of the form OWNER/NAME that is no folder here is a Hugging Face
    repository: its store (where `moestreamctl pull` puts it) is pulled first where it
    is missing, with the pull's progress, and then served."""
    settings = _pulled(given)
    if foreground:
        if settings.distributed != "off":
            raise click.UsageError(
                "an expert-parallel daemon runs one process per rank: drop --foreground (start runs mlx.launch), "
                "or run `mlx.launch ... -- python -m moestream.daemon.main --distributed ...` (docs/scale-out.md)"
            )
        _check_store(settings)
        from ...daemon.main import run_daemon

        try:
            code = run_daemon(settings, log_to_stderr=log_to_stderr)
        except RuntimeDirError as e:
            raise click.ClickException(str(e)) from None
        sys.exit(code)
    start_daemon(settings, given, timeout=timeout)


@click.command()
@runtime_dir_option
@click.option(
    "--timeout",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds to wait before SIGTERM, then again before giving up.",
)
def stop(runtime_dir, timeout) -> None:
    """Stop the daemon: running requests end with finish reason "shutdown"."""
    paths = runtime_paths(resolve_settings({"runtime_dir": runtime_dir}, lenient=True))
    pid = stop_daemon(paths, timeout=timeout)
    click.echo("no moestream daemon is running" if pid is None else f"moestream daemon stopped (pid {pid})", err=True)


@click.command()
@_start_options
def restart(given, timeout) -> None:
    """Stop the daemon and start it again; flags not given keep the running daemon's values."""
    paths = runtime_paths(resolve_settings({"runtime_dir": given["runtime_dir"]}))
    if _running(paths):
        try:
            with Client(paths, timeout=5.0) as c:
                running = c.status()
        except ClientError as e:
            raise click.ClickException(f"cannot ask the running daemon for its settings: {e}") from None
        for name, value in running.settings.items():
            if name in given and given[name] is None and value is not None:
                given[name] = value
        if given.get("log_file") is None and running.log:
            given["log_file"] = running.log
        if given.get("model") == running.settings.get("model"):
            given["model"] = _served_store_now(running)
        stop_daemon(paths, timeout=30.0)
    settings = _pulled(given)
    start_daemon(settings, given, timeout=timeout)


def _pulled(given: dict[str, Any]) -> Settings:
    """The settings of `given`, a model named as a hub repository (OWNER/NAME, no such
    folder here) replaced by its store, pulled first where it is not there yet
    (`moestreamctl pull`); with the note on a capacity over the store's (`capacity_note`)."""
    from ...daemon.store.hub import is_repo_id

    settings = resolve_settings(given)
    if is_repo_id(settings.model):
        from .pull import pull_store

        try:
            given["model"] = str(pull_store(str(settings.model)))
        except click.ClickException as e:
            raise click.ClickException(f"--model {settings.model}: no such folder here, and pulling it failed: {e}")
        settings = resolve_settings(given)
    capacity_note(settings)
    return settings


def _served_store_now(running: Status) -> str | None:
    """Where the store the daemon serves is now. A reinstall (`pip install -e .` after
    `pip install .`) moves the built-in demo out from under a running daemon: the demo's
    new copy is the same store (by id), so restart starts on it. Another store that is
    gone is refused here, before the running daemon is stopped."""
    model = running.settings.get("model")
    if model is None or Path(model).is_dir():
        return model
    demo = demo_store_path()
    if demo.is_dir() and running.store_id == load_manifest(demo).store_id:
        return str(demo)
    raise click.ClickException(
        f"the daemon's store {model} is gone, so it cannot be restarted on it; the daemon keeps running "
        "(`moestreamctl restart --model STORE` starts it on another store)"
    )


@click.command()
@runtime_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(runtime_dir, as_json) -> None:
    """Is the daemon running, and how is its pool doing."""
    settings = resolve_settings({"runtime_dir": runtime_dir}, lenient=True)
    paths = runtime_paths(settings)
    if not _running(paths):
        if as_json:
            click.echo(json.dumps({"running": False, "runtime_dir": str(paths.dir), "log": str(paths.log)}))
        else:
            click.echo(f"not running (runtime folder {paths.dir}); last log: {paths.log}")
        sys.exit(1)
    try:
        with Client(paths, timeout=5.0) as c:
            st = c.status()
    except ClientError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"running": True, **st.to_dict()}))
        return
    click.echo(_format_status(st))


def _size(n: Any) -> str:
    return format_size(n) if isinstance(n, (int, float)) else "-"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _rate(x: Any) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-"


def _format_status(st: Status) -> str:
    mem, req, pool, heat = st.memory, st.requests, st.pool, st.heat
    lines = [
        f"moestream daemon {st.version}: {_state_text(st)} (pid {st.pid}, up {st.uptime_s:.0f} s)",
        f"  model      {st.model}" + (f" (store id {st.store_id})" if st.store_id else ""),
    ]
    caps = st.capabilities
    if caps:
        takes = ["text", *(name for name in ("tools", "thinking") if caps.get(name))]
        lines.append(f"  takes      {', '.join(takes)}; " + ("images" if caps.get("vision") else "no images"))
    if st.error:
        lines.append(f"  error      {st.error}")
    if st.store_problem:
        lines.append(f"  warning    {st.store_problem}")
    if st.state == "unloaded":
        lines.append("  holds      the socket and the heat keeper; no model, pool, host tier or caches")
    elif st.capacity is None:
        lines.append("  pool       not loaded yet" if st.state == "loading" else "  pool       none")
    else:
        resident = sum(layer.resident for layer in pool.layers)
        slots = sum(layer.capacity for layer in pool.layers)
        pinned = sum(layer.pinned for layer in pool.layers)
        lines.append(
            f"  pool       {st.capacity} slots x {st.moe_layers} layers of {st.experts_per_layer} experts, "
            f"policy {st.policy}; {resident}/{slots} slots used, {pinned} pinned; hit rate {_rate(pool.hit_rate)}"
        )
    if st.elastic and st.capacity is not None:
        lines += _elastic_lines(st.elastic)
    ctx = st.context
    if ctx:
        room = f", {_size(ctx.kv_room_bytes)} of {ctx.memory} left for KV" if ctx.kv_room_bytes else ""
        lines.append(
            f"  context    {ctx.tokens} tokens per request ({ctx.bound}; the model's "
            f"{ctx.model_tokens or '?'}, KV {_size(ctx.kv_bytes_per_token)}/token{room})"
        )
    batch = st.batch
    if batch:
        mean = batch.get("mean_size")
        lines.append(
            f"  batch      up to {batch['max_batch']} decoding together; {batch['size']} in it now, "
            f"{batch['steps']} steps so far (mean size {mean:.2f}, largest {batch['max_size']})"
            if mean
            else f"  batch      up to {batch['max_batch']} decoding together; {batch['size']} in it now"
        )
    pc = st.prompt_cache
    if pc:
        lines.append(
            f"  cache      {pc['entries']} prompts' KV caches in {pc.get('branches', 0)} branches, "
            f"{_size(pc['bytes'])} of {_size(pc['max_bytes'])} reserved; "
            f"hit rate {_rate(pc.get('hit_rate'))}, {pc['tokens_reused']} tokens reused"
            + (
                f"; {pc['disk_entries']} on disk ({_size(pc['disk_bytes'])}), "
                f"{_size(pc.get('disk_written_today'))} of {_size(pc.get('disk_write_budget'))} written today"
                if pc.get("disk_dir")
                else ""
            )
            + (f"; no disk cache: {pc['disk_problem']}" if pc.get("disk_problem") else "")
        )
    if pool.prefill.order:
        lines.append(
            f"  prefill    {pool.prefill.order}; {pool.prefill.stacked_layers} layer stacks so far, "
            f"{_size(pool.prefill.staged_bytes)} staged, {_size(pool.bytes_read)} read in all"
        )
    if pool.mapped_auto:
        # What `mapped = auto` chose, and why (daemon/model/streaming_model.py choose_mapped).
        lines.append(f"  mapped     auto, {pool.mapped_auto}")
    placement = pool.mapped_pool
    if pool.mapped and placement:
        lines.append(
            f"  mapped     every expert in host memory, {placement['gpu_slots']} per layer in GPU memory; "
            f"GPU hit rate {_rate(placement.get('gpu_hit_rate'))}, {placement['moves']} moves"
        )
    group = st.expert_parallel
    if group:
        lines.append(f"  ranks      {group['size']} (expert-parallel, experts e % {group['size']} == rank)")
        if group.get("broken"):
            lines.append(f"    broken: {group['broken']}")
        layers = st.moe_layers or 1
        for r in group["ranks"]:
            lines.append(
                f"    rank {r['rank']}: {r['experts'] // layers} experts per layer, pool {r.get('capacity', '-')} "
                f"slots per layer ({_size(r['pool_bytes'])}), {r.get('resident', '-')} resident, "
                f"{r.get('pinned', '-')} pinned; hit rate {_rate(r['hit_rate'])}, {_size(r['bytes_read'])} read; "
                f"heat {r.get('heat_state', '-')} ({r.get('heat_file', '-')}: {r.get('heat_sent', 0)} counts sent, "
                f"{r.get('heat_dropped', 0)} dropped; {r.get('heat_loaded', 0)} loaded at start)"
            )
    ended = ", ".join(f"{getattr(req, k)} {k}" for k in ("completed", "cancelled", "disconnected", "failed"))
    lines += [
        f"  memory     RSS {_size(mem.rss_bytes)}, MLX active {_size(mem.mlx_active_bytes)}, peak "
        f"{_size(mem.mlx_peak_bytes)}",
        f"  requests   {req.active} active, {req.queued} queued, {st.clients.connected} clients connected; "
        f"{req.requests} received: {ended}; {req.tokens} tokens made",
    ]
    if req.why_queued:
        lines.append(f"    queued: {req.why_queued}")
    for info in [*req.running, *req.waiting]:
        lines.append(f"    {info.id} ({info.client}): {_job_state(info)}, {info.seconds:.0f} s")
    if st.keep_alive:
        lines.append(_keep_alive_line(st.keep_alive))
    lines += [
        f"  heat       {heat.get('state', '-')}" + (f" ({heat['note']})" if heat.get("note") else ""),
        f"  log        {st.log}",
        f"  socket     {st.socket}",
    ]
    return "\n".join(lines)


# Resizes of the elastic pool listed by `status` (the dashboard draws them all).
LISTED_RESIZES = 3


def _elastic_lines(el: ElasticStatus) -> list[str]:
    """The elastic pool (daemon/pool/elastic.py): its size against what it was made with,
    the pressure read, and its last resizes with why."""
    if el.source is None or el.configured_slots == 0:
        return [f"  elastic    {el.note}"]
    tier = ""
    if el.configured_tier_bytes:
        tier = f", host tier {_size(el.tier_bytes)} of {_size(el.configured_tier_bytes)}"
    lines = [
        f"  elastic    {el.slots} of {el.configured_slots} slots per layer (floor {el.floor_slots}){tier}; memory "
        f"pressure {el.level} ({el.detail or el.source})"
        + (f"; new requests refused ({el.refused} so far)" if el.refusing else "")
    ]
    for ev in el.events[-LISTED_RESIZES:]:
        lines.append(
            f"    {time.strftime('%H:%M:%S', time.localtime(ev.at))} {ev.slots_from} -> {ev.slots_to} slots "
            f"({_size(ev.pool_bytes_from)} -> {_size(ev.pool_bytes_to)}) in {ev.seconds:.3f} s: {ev.reason}"
        )
    return lines


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _state_text(st: Status) -> str:
    """The state; an unloaded daemon's with how long it has been idle: "unloaded (idle 31 min)"."""
    ka = st.keep_alive
    if st.state == "unloaded" and ka is not None and ka.idle_s is not None:
        return f"unloaded (idle {_minutes(ka.idle_s)})"
    return st.state


def _keep_alive_line(ka: KeepAliveStatus) -> str:
    what = "never unloads" if ka.keep_alive_s < 0 else f"unloads after {_minutes(ka.keep_alive_s)} idle"
    if ka.unload_in_s is not None:
        what += f" (in {_minutes(ka.unload_in_s)})"
    return f"  keep-alive {what}; {ka.unloads} unloads, {ka.reloads} loads again so far"


def _job_state(job: RequestInfo) -> str:
    prompt = "?" if job.prompt_tokens is None else job.prompt_tokens
    if job.phase == "queued":
        return f"queued, a prompt of {prompt} tokens"
    if job.phase == "prefill" and job.prefilled_tokens is not None:
        done, total = job.prefilled_tokens, job.prefill_total or job.prompt_tokens or 0
        return f"prefill {done}/{total} prompt tokens ({100 * done // max(total, 1)}%)"
    if job.phase == "prefill":
        return f"prefill of a prompt of {prompt} tokens"
    return f"{job.tokens}/{job.max_tokens} tokens after a prompt of {prompt}"


@click.command()
@runtime_dir_option
@click.option("--log-file", help="The log file (default: the running daemon's, else daemon.log in the runtime folder).")
@click.option("-n", "lines", default=50, show_default=True, type=click.IntRange(0, None), help="Lines to print.")
@click.option("-f", "follow", is_flag=True, help="Keep printing new lines (Ctrl-C to end).")
def logs(runtime_dir, log_file, lines, follow) -> None:
    """Print the daemon's log path and its last lines."""
    settings = resolve_settings({"runtime_dir": runtime_dir, "log_file": log_file}, lenient=True)
    paths = runtime_paths(settings)
    path = paths.log
    if log_file is None and _running(paths):
        try:
            with Client(paths, timeout=2.0) as c:
                path = Path(c.status().log)
        except ClientError as e:
            click.echo(f"(the daemon did not say where it logs: {e})", err=True)
    click.echo(f"log: {path}", err=True)
    if not path.exists():
        raise click.ClickException(f"{path} does not exist yet")
    if lines:
        click.echo(_tail(path, lines))
    if follow:
        _follow(path)


def _follow(path: Path) -> None:
    """Print lines as they are appended, following the file across a log rotation."""
    f = open(path, "rb")
    try:
        f.seek(0, os.SEEK_END)
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk.decode("utf-8", "replace"))
                sys.stdout.flush()
                continue
            time.sleep(0.2)
            if path.exists() and os.stat(path).st_ino != os.fstat(f.fileno()).st_ino:
                f.close()
                f = open(path, "rb")
    except KeyboardInterrupt:
        return
    finally:
        f.close()


@click.command()
@runtime_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def stats(runtime_dir, as_json) -> None:
    """The pool's statistics: hits, misses, evictions and bytes read, per layer."""
    settings = resolve_settings({"runtime_dir": runtime_dir}, lenient=True)
    try:
        with Client(runtime_paths(settings), timeout=5.0) as c:
            st = c.stats()
    except ClientError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(st.to_dict()))
        return
    pool, reader, req = st.pool, st.reader, st.requests
    click.echo(f"model {st.model}: {st.capacity} slots per layer, policy {st.policy}")
    click.echo(
        f"total: hit rate {_rate(pool.hit_rate)}, hits {pool.hits_prefill}+{pool.hits_decode} "
        f"(prefill+decode), misses {pool.misses_prefill}+{pool.misses_decode}, "
        f"evictions {pool.evictions}, read {_size(pool.bytes_read)}"
    )
    if pool.prefill_order:
        click.echo(
            f"prefill: {pool.prefill_order}; {pool.stacked_layers} layer stacks, {_size(pool.staged_bytes)} staged"
        )
    placement = pool.mapped_pool
    if placement:
        click.echo(
            f"mapped pool: {placement['gpu_slots']} experts per layer in GPU memory, GPU hit rate "
            f"{_rate(placement['gpu_hit_rate'])} "
            f"({placement['routed_on_gpu']} of {placement['routed']} routed), {placement['moves']} moves, "
            f"read-back {placement['readback_seconds']:.3f} s, decide {placement['decide_seconds']:.3f} s, place "
            f"{placement['place_seconds']:.3f} s"
        )
    click.echo(
        f"requests: {req.requests} received: "
        + ", ".join(f"{getattr(req, k)} {k}" for k in ("completed", "cancelled", "disconnected", "failed"))
        + f"; {req.tokens} tokens made, {req.queued} queued"
    )
    if reader:
        click.echo(
            "read engine: "
            + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in reader.items() if _number(v))
        )
    click.echo(f"{'layer':>5} {'resident':>9} {'capacity':>9} {'pinned':>7} {'hit rate':>9}")
    for layer in pool.layers:
        click.echo(
            f"{layer.layer:>5} {layer.resident:>9} {layer.capacity:>9} {layer.pinned:>7} {_rate(layer.hit_rate):>9}"
        )
    _echo_prefetch(st.prefetch, st.diagnostics)


def _echo_prefetch(pf: dict[str, Any] | None, diag: dict[str, Any] | None) -> None:
    if pf:
        auto = pf.get("auto") or {}
        decision = "; " + auto["decision"] if auto else ""
        state = f"prefetch: {pf['mode']} ({'on' if pf['enabled'] else 'off'} now{decision}), "
        ahead = f", {pf['depth']} layers ahead" if pf.get("depth", 1) > 1 else ""
        click.echo(
            state + f"{pf['submitted']} read{ahead}, {pf['promoted']} promoted ({pf['waited']} waited for), "
            f"{pf['dropped_unused']} dropped unused"
        )
    totals = (diag or {}).get("totals")
    if not totals:
        click.echo("diagnostics: none recorded (`moestreamctl start --diagnostics`, or `generate --diagnostics`)")
        return
    for line in diagnostics_lines(totals):
        click.echo(line)


def diagnostics_lines(d: dict[str, Any]) -> list[str]:
    """Hot-path diagnostics (a request's, or the daemon's totals) for people."""
    recall = d["recall"]["all"]
    lines = ["diagnostics: recall " + ", ".join(f"{k} {_rate(recall[k])}" for k in ("top_k", "top_2k", "top_4k"))]
    for phase, buckets in d["attribution"].items():
        lines.append(f"  {phase}: " + ", ".join(f"{k} {v}" for k, v in buckets.items()))
    seg = d["segments"]
    lines.append(
        "  ms per call: " + ", ".join(f"{k} {v['mean_ms']:.3f}" for k, v in seg.items() if v["mean_ms"] is not None)
    )
    if d["window"]["mean_ms"] is not None:
        lines.append(
            f"  compute window {d['window']['mean_ms']:.3f} ms, read wait {d['read_wait']['seconds'] * 1e3:.1f} ms in "
            "all"
        )
    for ordinal, layer in d["layers"].items():
        union = ", ".join(
            f"{seq}: p50 {u['p50']:.0f} p99 {u['p99']:.0f} max {u['max']}" for seq, u in layer["union"].items()
        )
        lines.append(f"  layer {ordinal} union by tokens per sequence: {union}")
    return lines


COMMANDS = (start, stop, restart, status, logs, stats)
