"""`moestreamctl service install|uninstall|status`: start the daemon at login, and with
`--openai` the OpenAI-compatible gateway (`moestreamctl serve-openai`) as a second service.

macOS: a LaunchAgent loaded into `gui/<uid>` with launchctl. Linux: a systemd user unit
enabled with `systemctl --user`. HOME, PATH and the settings are read when the command
runs; the hidden `--platform` option makes either file on any system (for tests and
for preparing a file on one machine for another).
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping

import click

from ...shared import service_files as sf
from ...shared.durable import fsync_dir, sync_file
from ...shared.settings import Settings, SettingsError, definition, format_size
from ...shared.store_format import StoreError, load_manifest
from .daemon import PATH_SETTINGS, absolute_paths, daemon_setting_options
from .values import setting_flags

# launchctl and systemctl answer at once; a hung one is reported rather than waited on.
COMMAND_TIMEOUT_S = 60.0
# launchd keeps a label for a few seconds after `bootout` returns, and a `bootstrap` in
# that time fails with "5: Input/output error": wait until `print` no longer finds the
# label, then retry a bootstrap that exits 5, each for this long.
LAUNCHD_SETTLE_S = 15.0
LAUNCHD_POLL_S = 0.25
BOOTSTRAP_BUSY = 5


class ManagerError(click.ClickException):
    """The service manager is missing or refused a command; exits 1."""


_platform_option = click.option(
    "--platform",
    "platform_name",
    type=click.Choice(sf.PLATFORMS),
    hidden=True,
    help="Make the files of this system instead of the running one.",
)
_dry_run_option = click.option("--dry-run", is_flag=True, help="Print the file and the commands; change nothing.")


def _openai_option(what: str) -> Callable:
    """--openai: the HTTP gateway's service (`moestreamctl serve-openai`), a second one
    beside the daemon's; `what` the command does with it."""
    return click.option(
        "--openai", "openai", is_flag=True, help=f"The HTTP gateway's service (`moestreamctl serve-openai`): {what}."
    )


def _service_of(openai: bool) -> sf.Service:
    return sf.OPENAI if openai else sf.DAEMON


def _platform(name: str | None) -> str:
    try:
        return name or sf.platform_of(sys.platform)
    except sf.ServiceFileError as e:
        raise click.ClickException(str(e)) from None


def _home(env: Mapping[str, str]) -> Path:
    home = env.get("HOME") or pwd.getpwuid(os.getuid()).pw_dir
    if not home.startswith("/"):
        raise click.ClickException(f"HOME is {home!r}, not an absolute path; set HOME to your home folder")
    return Path(home)


def _show(cmd: list[str]) -> str:
    return shlex.join(cmd)


def _run(cmd: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a service-manager command; ManagerError when it is missing or hangs."""
    exe = shutil.which(cmd[0], path=env.get("PATH"))
    if exe is None:
        raise ManagerError(f"`{cmd[0]}` was not found on PATH, so `{_show(cmd)}` could not run")
    try:
        return subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=dict(env))
    except subprocess.TimeoutExpired:
        raise ManagerError(f"`{_show(cmd)}` did not answer within {COMMAND_TIMEOUT_S:.0f} s") from None


def _check(cmd: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """Run `cmd`; ManagerError with its output when it exits non-zero."""
    return check_retrying(cmd, env, busy=None)


def _session_hint(platform: str) -> str:
    if platform == "linux":
        return (
            "systemctl --user needs your user's systemd instance: log in to a desktop or ssh session "
            "(not `su`/`sudo`), or run `loginctl enable-linger $USER` once so it runs without a login"
        )
    return "launchctl needs a macOS login session of this user (gui/<uid>), e.g. run it from Terminal"


def _write_atomically(path: Path, content: bytes) -> None:
    """Temporary file beside `path`, fsync, rename, fsync the folder: a crash leaves the
    old file or the new one, never half of one. Mode 0644: launchd ignores plists that
    others can write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            sync_file(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _loaded(platform: str, uid: int, env: Mapping[str, str], svc: sf.Service = sf.DAEMON) -> bool:
    """macOS: whether launchd knows the agent now (bootstrap refuses a loaded one)."""
    return _run(sf.loaded_command(platform, uid, svc), env).returncode == 0


def _wait_unloaded(
    platform: str, uid: int, env: Mapping[str, str], svc: sf.Service, within_s: float = LAUNCHD_SETTLE_S
) -> bool:
    """macOS, after `bootout`: wait until launchd no longer knows the label; False when it
    still does after `within_s` (the bootstrap's retries then get their chance)."""
    deadline = time.monotonic() + within_s
    while _loaded(platform, uid, env, svc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(LAUNCHD_POLL_S)
    return True


def check_retrying(
    cmd: list[str],
    env: Mapping[str, str],
    *,
    busy: int | None = BOOTSTRAP_BUSY,
    within_s: float = LAUNCHD_SETTLE_S,
    every_s: float = 0.5,
) -> subprocess.CompletedProcess[str]:
    """Run `cmd`; ManagerError with its output when it exits non-zero, but an exit with
    status `busy` (None: none) is tried again every `every_s` seconds for `within_s`
    seconds; ManagerError then says how many tries failed."""
    deadline = time.monotonic() + within_s
    tries = 0
    while True:
        done = _run(cmd, env)
        tries += 1
        if done.returncode == 0:
            return done
        if done.returncode != busy or time.monotonic() >= deadline:
            said = (done.stderr or done.stdout).strip() or "no output"
            again = f" ({tries} tries over {within_s:g} s)" if tries > 1 else ""
            raise ManagerError(f"`{_show(cmd)}` exited with status {done.returncode}{again}: {said}")
        time.sleep(every_s)


@click.group()
def service() -> None:
    """Start the daemon at login: a launchd agent (macOS) or a systemd user unit (Linux).

    With --openai, the same for the OpenAI-compatible gateway, a second service."""


@service.command()
@daemon_setting_options
@click.option("--no-load", is_flag=True, help="Write the service file but do not load or start it.")
@_openai_option("add it beside the daemon's, which stays as it is")
@click.option("--host", help="With --openai: the address it listens on (default 127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65535), help="With --openai: its TCP port (default 8080).")
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="With --openai: the file holding its API key (needed beyond loopback; the key itself is never written into "
    "the service file).",
)
@_dry_run_option
@_platform_option
def install(given, no_load, openai, host, port, api_key_file, dry_run, platform_name) -> None:
    """Install the daemon as a service and start it.

    The service runs `moestreamctl start --foreground` with this Python, the daemon
    settings given here (the same options as `moestreamctl start`), and the MOESTREAM_*
    settings of this shell. Run it again to change them; the running daemon is restarted.

    With --openai, adds the HTTP gateway as a second service beside the daemon's (which
    this leaves as it is): it runs `moestreamctl serve-openai` (with --host, --port,
    --api-key-file) and talks to the daemon of the same MOESTREAM_* settings.
    """
    env = dict(os.environ)
    platform = _platform(platform_name)
    home = _home(env)
    if openai:
        daemon_flags = [definition(name).flag for name, value in given.items() if value is not None]
        if daemon_flags:
            raise click.UsageError(
                f"{', '.join(daemon_flags)}: the daemon's settings, not the gateway's; install the daemon without "
                "--openai"
            )
        argv, environment = _gateway_service(env, host, port, api_key_file)
        _install(platform, home, env, sf.OPENAI, argv, environment, no_load=no_load, dry_run=dry_run)
        return
    gateway_flags = [
        f for f, v in (("--host", host), ("--port", port), ("--api-key-file", api_key_file)) if v is not None
    ]
    if gateway_flags:
        raise click.UsageError(f"{', '.join(gateway_flags)}: only with --openai (the gateway's service)")
    # The service starts in another folder than this shell, so relative paths break.
    given = absolute_paths(given)
    try:
        settings = Settings.resolve(given, env)  # a bad value fails here, not in a restart loop
    except SettingsError as e:
        raise click.UsageError(str(e)) from None
    if settings.distributed != "off":
        # The service runs one process in the foreground; a group is mlx.launch's processes.
        raise click.UsageError(
            "--distributed: an expert-parallel group is not installed as a service; start it with "
            "`moestreamctl start --distributed ... --distributed-launch ...` (docs/scale-out.md)"
        )
    if settings.model is not None:
        try:
            manifest = load_manifest(settings.model)
        except StoreError as e:
            raise click.UsageError(f"--model: {e} (make one with `moestreamctl convert`)") from None
        need = manifest.expert_bytes_total
        if settings.mapped and 0 < settings.host_cache < need:
            # The daemon refuses this pair when it loads the model (daemon/model/streaming_model.py);
            # refusing it here keeps the service from failing and restarting every RestartSec.
            raise click.UsageError(
                f"--mapped keeps every expert ({format_size(need)}) in host memory, more than "
                f"--host-cache {format_size(settings.host_cache)}: give a larger one or drop one of them"
            )
    else:
        click.echo(
            "note: no --model or MOESTREAM_MODEL given: the daemon will start with its built-in default", err=True
        )

    python = os.path.abspath(sys.executable)  # not resolved: a venv's python is a symlink
    if platform == "darwin":
        _warn_protected(settings, python, home)
    try:
        argv = sf.daemon_argv(python, setting_flags(given), platform)
        environment = sf.service_environment(
            env, python=python, exclude=[definition(name).env for name, value in given.items() if value is not None]
        )
    except sf.ServiceFileError as e:
        raise click.ClickException(str(e)) from None
    _install(platform, home, env, sf.DAEMON, argv, environment, no_load=no_load, dry_run=dry_run)


def _warn_protected(settings: Settings, python: str, home: Path) -> None:
    """macOS: say which of the service's files lie where privacy protection keeps a
    LaunchAgent out (this Terminal may have been granted access; the agent has not),
    and what to grant, before the daemon fails there and restarts every 10 s."""
    places = [(definition(n).flag, getattr(settings, n)) for n in PATH_SETTINGS]
    places.append(("the Python that runs it", python))
    for what, value in places:
        where = sf.protected_place(value, home) if value else None
        if where is None:
            continue
        click.echo(
            f"warning: {what} {value} is in {where}, which macOS protects: the service would get "
            f'"Operation not permitted" there and restart every 10 s. Give {os.path.realpath(python)} Full Disk '
            "Access (System Settings > Privacy & Security > Full Disk Access, or Files and Folders), or move it "
            "elsewhere (for example ~/models)",
            err=True,
        )


def _gateway_service(
    env: Mapping[str, str], host: str | None, port: int | None, api_key_file: str | None
) -> tuple[list[str], dict[str, str]]:
    """The gateway service's command line and environment, checked as `serve-openai` checks them."""
    from .serve_openai import DEFAULT_HOST, DEFAULT_PORT, is_loopback, read_api_key

    host = host or DEFAULT_HOST
    if api_key_file is not None:
        api_key_file = os.path.abspath(os.path.expanduser(api_key_file))
        read_api_key(None, api_key_file, host)  # an unreadable, empty or short key fails here, not in a restart loop
    elif not is_loopback(host):
        raise click.UsageError(
            f"--host {host} accepts connections from other machines: give --api-key-file FILE, or use --host "
            f"{DEFAULT_HOST}"
        )
    try:
        Settings.resolve({}, env)  # the MOESTREAM_* settings the service will run with
    except SettingsError as e:
        raise click.UsageError(str(e)) from None
    flags = ["--host", host, "--port", str(port or DEFAULT_PORT)]
    if api_key_file is not None:
        flags += ["--api-key-file", api_key_file]
    python = os.path.abspath(sys.executable)
    try:
        return sf.gateway_argv(python, flags), sf.service_environment(env, python=python)
    except sf.ServiceFileError as e:
        raise click.ClickException(str(e)) from None


def _install(
    platform: str,
    home: Path,
    env: Mapping[str, str],
    svc: sf.Service,
    argv: list[str],
    environment: dict[str, str],
    *,
    no_load: bool,
    dry_run: bool,
) -> None:
    """Write the service file of `svc` and load it (or say what would be done)."""
    try:
        rendered = sf.render_service_file(platform, home, argv, environment, svc)
    except sf.ServiceFileError as e:
        raise click.ClickException(str(e)) from None

    uid = os.getuid()
    load = sf.load_commands(platform, rendered.path, uid, svc)
    if dry_run:
        click.echo(f"the {svc.name} would run as: {_show(argv)}")
        click.echo(f"would write {rendered.path}:")
        click.echo(rendered.content.decode("utf-8"), nl=False)
        if rendered.log_dir is not None:
            click.echo(f"would create the log folder {rendered.log_dir}")
        click.echo("would run:")
        if platform == "darwin":
            click.echo(f"  {_show(sf.unload_commands(platform, uid, svc)[0])}    # only if it is loaded now")
        for cmd in load:
            click.echo(f"  {_show(cmd)}")
        return

    if rendered.log_dir is not None:
        rendered.log_dir.mkdir(parents=True, exist_ok=True)  # launchd does not create it
    _write_atomically(rendered.path, rendered.content)
    click.echo(f"wrote {rendered.path}")
    how = "\n".join(f"  {_show(cmd)}" for cmd in load)
    if no_load:
        click.echo(f"not loaded (--no-load); to load and start it:\n{how}")
        return
    try:
        if platform == "darwin" and _loaded(platform, uid, env, svc):
            for cmd in sf.unload_commands(platform, uid, svc):
                _check(cmd, env)
            _wait_unloaded(platform, uid, env, svc)
        for cmd in load:
            bootstrap = platform == "darwin" and cmd[:2] == ["launchctl", "bootstrap"]
            check_retrying(cmd, env, busy=BOOTSTRAP_BUSY if bootstrap else None)
    except ManagerError as e:
        raise ManagerError(
            f"{rendered.path} is written, but loading it failed: {e.message}.\n"
            f"{_session_hint(platform)}; then load it with:\n{how}"
        ) from None
    if platform == "darwin":
        click.echo(f"loaded {svc.label} into gui/{uid}; {svc.name} output goes to {rendered.log_dir}")
    else:
        click.echo(f"enabled and started {svc.unit}; its output: journalctl --user -u {svc.unit}")


@service.command()
@click.option("--no-unload", is_flag=True, help="Only remove the file; do not stop or unload the service.")
@_openai_option("remove it alone, the daemon's stays")
@_dry_run_option
@_platform_option
def uninstall(no_unload, openai, dry_run, platform_name) -> None:
    """Stop the service and remove its file; the daemon's takes the gateway's with it
    (a gateway without its daemon only answers 503). --openai: the gateway's alone."""
    env = dict(os.environ)
    platform = _platform(platform_name)
    if not openai and sf.service_file_path(platform, _home(env), sf.OPENAI).exists():
        _uninstall(env, platform, sf.OPENAI, no_unload, dry_run)
    _uninstall(env, platform, _service_of(openai), no_unload, dry_run)


def _uninstall(env: dict[str, str], platform: str, svc: sf.Service, no_unload: bool, dry_run: bool) -> None:
    path = sf.service_file_path(platform, _home(env), svc)
    uid = os.getuid()
    unload = [] if no_unload else sf.unload_commands(platform, uid, svc)
    after = [] if no_unload else sf.after_remove_commands(platform)
    # `enable` links the unit into default.target.wants; remove a link left behind when
    # systemctl could not disable it, so a later login does not meet a dangling link.
    wants = path.parent / "default.target.wants" / svc.unit if platform == "linux" else None
    if dry_run:
        click.echo("would run:")
        for cmd in unload:
            note = "    # only if it is loaded now" if platform == "darwin" else ""
            click.echo(f"  {_show(cmd)}{note}")
        click.echo(f"would remove {path}" + (" (it does not exist)" if not path.exists() else ""))
        if wants is not None and wants.is_symlink():
            click.echo(f"would remove {wants}")
        for cmd in after:
            click.echo(f"  {_show(cmd)}")
        return

    if not path.exists() and not (wants is not None and wants.is_symlink()):
        click.echo(f"not installed: {path} does not exist")
        return
    failure: ManagerError | None = None
    try:
        if platform == "darwin":
            if unload and _loaded(platform, uid, env, svc):
                for cmd in unload:
                    _check(cmd, env)
        else:
            for cmd in unload:
                _check(cmd, env)
    except ManagerError as e:
        failure = e
    path.unlink(missing_ok=True)
    if wants is not None and wants.is_symlink():
        wants.unlink()
    click.echo(f"removed {path}")
    if failure is None:
        try:
            for cmd in after:
                _check(cmd, env)
        except ManagerError as e:
            failure = e
    if failure is not None:
        raise ManagerError(
            f"the service file is removed, but the service manager could not be told: {failure.message}.\n"
            f"{_session_hint(platform)}. If the daemon is still running, stop it with `moestreamctl stop`."
        )
    if not no_unload:
        click.echo("the service is stopped and unloaded")


@service.command()
@_openai_option("its status instead of the daemon's")
@_dry_run_option
@_platform_option
@click.pass_context
def status(ctx: click.Context, openai, dry_run, platform_name) -> None:
    """Show whether the service is installed and what the service manager says of it.

    Exits with the service manager's status: 0 when it knows the service (launchctl
    print) or it is running (systemctl status).
    """
    env = dict(os.environ)
    platform = _platform(platform_name)
    svc = _service_of(openai)
    path = sf.service_file_path(platform, _home(env), svc)
    cmd = sf.status_command(platform, os.getuid(), svc)
    click.echo(f"service file: {path} ({'installed' if path.exists() else 'not installed'})")
    if dry_run:
        click.echo(f"would run:\n  {_show(cmd)}")
        return
    try:
        done = _run(cmd, env)
    except ManagerError as e:
        raise ManagerError(f"{e.message}. {_session_hint(platform)}") from None
    click.echo(done.stdout, nl=False)
    if done.stderr:
        click.echo(done.stderr, nl=False, err=True)
        if "Failed to connect to bus" in done.stderr:
            click.echo(_session_hint(platform), err=True)
    ctx.exit(done.returncode)
