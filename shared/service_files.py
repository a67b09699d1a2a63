"""Service files that start the daemon at login: a launchd LaunchAgent on macOS, a
systemd user unit on Linux. The OpenAI-compatible gateway (`moestreamctl serve-openai`)
can be installed as a second service beside it (`OPENAI`); functions take the
`Service` they are about, the daemon's (`DAEMON`) by default.

The templates ship in the package (`moestream/launchd/*.in`) and are filled here: the
plist is parsed with plistlib, filled as a dict and written back with plistlib; the unit
is filled line by line with values quoted for systemd (`%` is a specifier there and `$`
expands variables in ExecStart, so both are doubled). This module only renders text and
names paths and commands; `moestream.client.cli.service` writes files and runs them.
It imports no MLX and reads no environment of its own: callers pass `env` and `home`.
"""

from __future__ import annotations

import os
import plistlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterable, Mapping, Sequence
from xml.parsers.expat import ExpatError

from .settings import SETTINGS

PLATFORMS = ("darwin", "linux")
LAUNCHD_LABEL = "dev.moestream.daemon"
SYSTEMD_UNIT = "moestream.service"
PLIST_TEMPLATE = "moestream.plist.in"
UNIT_TEMPLATE = "moestream.service.in"
OPENAI_LAUNCHD_LABEL = "dev.moestream.openai"
OPENAI_SYSTEMD_UNIT = "moestream-openai.service"
OPENAI_UNIT_TEMPLATE = "moestream-openai.service.in"
CLI_MODULE = "moestream.client.cli"

# Used when the installing shell has no PATH at all; launchd's own default is this short.
FALLBACK_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"

_EXEC_PLACEHOLDER = "ExecStart=@EXEC_START@"
_ENV_PLACEHOLDER = "@ENVIRONMENT@"
_PLIST_PLACEHOLDERS = {"Label": "@LABEL@", "StandardOutPath": "@STDOUT_PATH@", "StandardErrorPath": "@STDERR_PATH@"}
# Characters that make systemd split or unescape a word, so the word must be quoted.
_NEEDS_QUOTES = re.compile(r"[\s\"'\\;]")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class ServiceFileError(ValueError):
    """A service file cannot be made as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Service:
    """One service moestream installs: its launchd label, systemd unit and templates."""

    name: str  # in messages: "daemon" or "OpenAI gateway"
    label: str
    unit: str
    plist_template: str
    unit_template: str
    log_stem: str  # launchd log files: <log_stem>.out.log / .err.log
    # Seconds from SIGTERM to SIGKILL: the unit template's TimeoutStopSec, and the
    # plist's ExitTimeOut (a test checks that the two agree).
    stop_timeout_s: int
    flag: str = ""  # what `moestreamctl service ...` is given to name this service


DAEMON = Service("daemon", LAUNCHD_LABEL, SYSTEMD_UNIT, PLIST_TEMPLATE, UNIT_TEMPLATE, "daemon", 30)
# The plist template has nothing daemon-specific (its comments are not kept); the unit
# has its own description and starts after the daemon's unit.
OPENAI = Service(
    "OpenAI gateway",
    OPENAI_LAUNCHD_LABEL,
    OPENAI_SYSTEMD_UNIT,
    PLIST_TEMPLATE,
    OPENAI_UNIT_TEMPLATE,
    "openai",
    15,
    " --openai",
)


@dataclass(frozen=True)
class ServiceFile:
    """A rendered service file: where it goes and its bytes. `log_dir` is the folder
    launchd writes the daemon's stdout/stderr into (None for systemd: the journal)."""

    platform: str
    path: Path
    content: bytes
    log_dir: Path | None = None


def platform_of(sys_platform: str) -> str:
    """'darwin' or 'linux' for a `sys.platform` value; other systems are refused."""
    if sys_platform == "darwin":
        return "darwin"
    if sys_platform.startswith("linux"):
        return "linux"
    raise ServiceFileError(
        f"services are made for macOS (launchd) and Linux (systemd), not {sys_platform!r}; "
        "run `moestreamctl start` by hand instead"
    )


def daemon_argv(python: str, start_flags: Sequence[str] = (), platform: str = "linux") -> list[str]:
    """The daemon's command line: this interpreter, in the foreground (a service manager
    must own the process, so it never daemonizes itself), with the given `start` flags.
    Under launchd the daemon logs only to its own rotated file: launchd appends stderr
    to StandardErrorPath, which nothing rotates (systemd's journal rotates its copy)."""
    if not python.startswith("/"):
        raise ServiceFileError(f"the interpreter path must be absolute, got {python!r}")
    quiet = ["--no-log-to-stderr"] if platform == "darwin" else []
    return [python, "-m", CLI_MODULE, "start", "--foreground", *quiet, *start_flags]


def gateway_argv(python: str, flags: Sequence[str] = ()) -> list[str]:
    """The OpenAI gateway's command line: this interpreter, `serve-openai` with `flags`
    (it never daemonizes itself either)."""
    if not python.startswith("/"):
        raise ServiceFileError(f"the interpreter path must be absolute, got {python!r}")
    return [python, "-m", CLI_MODULE, "serve-openai", *flags]


def service_environment(env: Mapping[str, str], *, python: str, exclude: Iterable[str] = ()) -> dict[str, str]:
    """The variables the service runs with: the `MOESTREAM_*` settings and
    `XDG_CONFIG_HOME` (where the config file is) as they are in `env`, except the
    names in `exclude` (settings given as flags instead), and a PATH that starts with
    the interpreter's folder, since launchd's default PATH is minimal."""
    skip = set(exclude)
    names = (*(d.env for d in SETTINGS), "XDG_CONFIG_HOME")  # the MOESTREAM_* that `Settings.resolve` reads
    out = {k: env[k] for k in names if k in env and k not in skip}
    parts = [str(Path(python).parent)]
    for part in (env.get("PATH") or FALLBACK_PATH).split(":"):
        if part and part not in parts:
            parts.append(part)
    out["PATH"] = ":".join(parts)
    return out


def service_file_path(platform: str, home: Path, service: Service = DAEMON) -> Path:
    """Where the service file of `platform` lives for the user whose home is `home`."""
    if platform == "darwin":
        return home / "Library" / "LaunchAgents" / f"{service.label}.plist"
    if platform == "linux":
        return home / ".config" / "systemd" / "user" / service.unit
    raise ServiceFileError(f"unknown platform {platform!r} (expected one of {', '.join(PLATFORMS)})")


def load_template(name: str) -> str:
    """A template from the package's `launchd/` folder."""
    try:
        return (resources.files("moestream") / "launchd" / name).read_text(encoding="utf-8")
    except OSError as e:
        raise ServiceFileError(
            f"service template launchd/{name} is missing from the installed package ({e}); reinstall moestream"
        ) from e


def _check_value(what: str, value: str) -> None:
    # Neither a unit line nor an XML 1.0 text node can carry these, and a newline in a
    # unit would start a new directive.
    if _CONTROL.search(value):
        raise ServiceFileError(f"{what} contains a control character or newline: {value!r}")


def render_plist(
    *,
    label: str,
    argv: Sequence[str],
    environment: Mapping[str, str],
    stdout_path: Path,
    stderr_path: Path,
    exit_timeout_s: int = DAEMON.stop_timeout_s,
    template: str | None = None,
) -> bytes:
    """The LaunchAgent plist: the template with its placeholders filled."""
    text = load_template(PLIST_TEMPLATE) if template is None else template
    try:
        doc = plistlib.loads(text.encode("utf-8"))
    except (ValueError, ExpatError) as e:
        raise ServiceFileError(f"template {PLIST_TEMPLATE} is not a valid plist: {e}") from e
    for key, placeholder in _PLIST_PLACEHOLDERS.items():
        if doc.get(key) != placeholder:
            raise ServiceFileError(f"template {PLIST_TEMPLATE}: {key} should be the placeholder {placeholder!r}")
    for key in ("ProgramArguments", "EnvironmentVariables", "ExitTimeOut"):
        if key not in doc:
            raise ServiceFileError(f"template {PLIST_TEMPLATE} lacks {key}")
    for arg in argv:
        _check_value("a daemon argument", arg)
    for k, v in environment.items():
        _check_value(f"variable {k}", v)
    doc["Label"] = label
    doc["ProgramArguments"] = list(argv)
    doc["EnvironmentVariables"] = dict(sorted(environment.items()))
    doc["StandardOutPath"] = str(stdout_path)
    doc["StandardErrorPath"] = str(stderr_path)
    doc["ExitTimeOut"] = int(exit_timeout_s)
    return plistlib.dumps(doc, fmt=plistlib.FMT_XML, sort_keys=False)


def quote_exec_arg(arg: str) -> str:
    """One ExecStart word: `%` and `$` doubled (systemd expands specifiers and
    variables in ExecStart), double quotes with C escapes when it has blanks, quotes,
    backslashes or `;`, or is empty."""
    _check_value("a daemon argument", arg)
    word = arg.replace("%", "%%").replace("$", "$$")
    if word and not _NEEDS_QUOTES.search(word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def environment_line(name: str, value: str) -> str:
    """`Environment="NAME=value"`: quoted, `%` doubled; Environment= expands no `$`."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ServiceFileError(f"{name!r} is not a valid environment variable name")
    _check_value(f"variable {name}", value)
    text = f"{name}={value}".replace("%", "%%").replace("\\", "\\\\").replace('"', '\\"')
    return f'Environment="{text}"'


def render_unit(
    *,
    argv: Sequence[str],
    environment: Mapping[str, str],
    template: str | None = None,
    template_name: str = UNIT_TEMPLATE,
    flag: str = "",
) -> str:
    """The systemd user unit: the template with ExecStart and Environment= lines filled."""
    text = load_template(template_name) if template is None else template
    lines = text.splitlines()
    for placeholder in (_EXEC_PLACEHOLDER, _ENV_PLACEHOLDER):
        if sum(line.strip() == placeholder for line in lines) != 1:
            raise ServiceFileError(f"template {template_name} must hold the line {placeholder!r} exactly once")
    if not argv:
        raise ServiceFileError("the daemon command line is empty")
    out = [
        f"# Written by `moestreamctl service install{flag}`; run it again to change the settings,",
        f"# `moestreamctl service uninstall{flag}` to remove the service.",
    ]
    started = False  # the template's leading comments describe the template, not the unit
    for line in lines:
        stripped = line.strip()
        if not started and (stripped.startswith("#") or not stripped):
            continue
        started = True
        if stripped == _EXEC_PLACEHOLDER:
            out.append("ExecStart=" + " ".join(quote_exec_arg(a) for a in argv))
        elif stripped == _ENV_PLACEHOLDER:
            out.extend(environment_line(k, v) for k, v in sorted(environment.items()))
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def render_service_file(
    platform: str, home: Path, argv: Sequence[str], environment: Mapping[str, str], service: Service = DAEMON
) -> ServiceFile:
    """The service file for `platform` under `home`, ready to be written."""
    path = service_file_path(platform, home, service)
    if platform == "darwin":
        logs = home / "Library" / "Logs" / "moestream"
        content = render_plist(
            label=service.label,
            argv=argv,
            environment=environment,
            stdout_path=logs / f"{service.log_stem}.out.log",
            stderr_path=logs / f"{service.log_stem}.err.log",
            exit_timeout_s=service.stop_timeout_s,
        )
        return ServiceFile(platform, path, content, logs)
    unit = render_unit(argv=argv, environment=environment, template_name=service.unit_template, flag=service.flag)
    return ServiceFile(platform, path, unit.encode("utf-8"))


# The service manager's command lines. `uid` is the user's id: LaunchAgents live in
# the per-user GUI domain `gui/<uid>`.


def launchd_target(uid: int, service: Service = DAEMON) -> str:
    return f"gui/{uid}/{service.label}"


def load_commands(platform: str, path: Path, uid: int, service: Service = DAEMON) -> list[list[str]]:
    """What loads and starts an installed service file. On macOS a loaded agent must be
    booted out first (see `loaded_command`); `enable` clears an earlier `disable`."""
    if platform == "darwin":
        return [
            ["launchctl", "enable", launchd_target(uid, service)],
            ["launchctl", "bootstrap", f"gui/{uid}", str(path)],
        ]
    # restart rather than start: a reinstall must apply the new settings to a running daemon.
    return [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", service.unit],
        ["systemctl", "--user", "restart", service.unit],
    ]


def loaded_command(platform: str, uid: int, service: Service = DAEMON) -> list[str]:
    """Exits 0 when the service is known to the manager (launchd only)."""
    if platform != "darwin":
        raise ServiceFileError("only launchd needs a loaded check")
    return ["launchctl", "print", launchd_target(uid, service)]


def unload_commands(platform: str, uid: int, service: Service = DAEMON) -> list[list[str]]:
    """What stops the service and unloads it (macOS: only run when it is loaded)."""
    if platform == "darwin":
        return [["launchctl", "bootout", launchd_target(uid, service)]]
    return [["systemctl", "--user", "disable", "--now", service.unit]]


def after_remove_commands(platform: str) -> list[list[str]]:
    """What tells the manager the file is gone."""
    return [] if platform == "darwin" else [["systemctl", "--user", "daemon-reload"]]


def status_command(platform: str, uid: int, service: Service = DAEMON) -> list[str]:
    if platform == "darwin":
        return ["launchctl", "print", launchd_target(uid, service)]
    return ["systemctl", "--user", "status", "--no-pager", service.unit]


# Where macOS's privacy protection (TCC) guards a LaunchAgent's reads, under the home folder.
PROTECTED_HOME_FOLDERS = ("Desktop", "Documents", "Downloads", "Library/Mobile Documents")


def protected_place(path: str | os.PathLike, home: str | os.PathLike) -> str | None:
    """Which place that macOS protects the absolute `path` is in ("~/Documents", or
    "/Volumes/X": removable and network volumes), or None. A LaunchAgent reading there
    gets EPERM unless its program has Full Disk Access, though Terminal could read it."""
    p = Path(path)
    for candidate in dict.fromkeys((p, Path(os.path.realpath(p)))):
        for name in PROTECTED_HOME_FOLDERS:
            if _is_under(candidate, Path(home, name)):
                return f"~/{name}"
        if len(candidate.parts) > 2 and candidate.parts[1] == "Volumes":
            return f"/Volumes/{candidate.parts[2]}"
    return None


def _is_under(path: Path, base: Path) -> bool:
    """`path` is `base` or inside it, comparing names as APFS does by default: without case."""
    n = len(base.parts)
    return len(path.parts) >= n and [x.casefold() for x in path.parts[:n]] == [x.casefold() for x in base.parts]
