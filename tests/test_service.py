"""`moestreamctl service`: the launchd plist and the systemd unit it writes, parsed back
with plistlib / configparser / a POSIX shell splitter, checked by systemd's own
verifier where it exists, and run as a real daemon whose `status --json` shows the
settings given to `service install`.

Every command runs with a temporary HOME and a forced platform, so nothing here touches
the real user's services: loading is either skipped (--no-load) or pointed at a
service manager that cannot be reached.
"""

from __future__ import annotations

import configparser
import json
import os
import plistlib
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from moestream.client.cli.daemon import START_FLAGS, start
from moestream.client.cli.service import service
from moestream.shared import service_files as sf

# A store folder name with everything systemd and XML treat specially.
AWKWARD = "st ore 100% $HOME ${X} \"dq\" 'sq' back\\slash &<>;"
PYTHON = os.path.abspath(sys.executable)


@click.group()
def cli() -> None:
    """Stands in for `moestreamctl`, which the lead wires up in client/cli/__init__.py."""


cli.add_command(service)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_model

    from moestream.daemon.store.convert import convert_model

    root = tmp_path_factory.mktemp("service")
    src = make_tiny_model(root / "model", "qwen3_moe", quant="4bit", seed=5)
    convert_model(src, root / AWKWARD)
    return root / AWKWARD


def clean_env(home: Path, **extra: str | None) -> dict[str, str | None]:
    """CliRunner overrides: a temporary HOME and none of the caller's moestream settings."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("MOESTREAM_")}
    env |= {"XDG_CONFIG_HOME": None, "HOME": str(home)}
    env |= extra
    return env


def invoke(args: list[str], env: dict[str, str | None]):
    return CliRunner().invoke(cli, ["service", *args], env=env, catch_exceptions=False)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*")) if root.exists() else []


def _undouble(text: str, mark: str, what: str) -> str:
    """`mark mark` -> `mark`; a lone `mark` is something systemd would expand."""
    out, i = [], 0
    while i < len(text):
        if text[i] == mark:
            assert text[i + 1 : i + 2] == mark, f"unescaped {what} at {i} in {text!r}"
            i += 1
        out.append(text[i])
        i += 1
    return "".join(out)


def systemd_words(value: str, *, expands_variables: bool) -> list[str]:
    """The words systemd makes of an ExecStart= / Environment= value, modelled on its
    order: `%` specifiers over the whole value, then splitting with quotes and C escapes
    (a POSIX shell splitter agrees on the double-quote escapes the writer uses), then,
    for ExecStart only, `$VAR` expansion in each word. Fails on anything systemd would
    expand instead of keeping."""
    words = shlex.split(_undouble(value, "%", "specifier"))
    return [_undouble(w, "$", "variable") for w in words] if expands_variables else words


def parse_unit(text: str) -> tuple[configparser.ConfigParser, list[str], dict[str, str]]:
    """(sections, ExecStart argv, Environment= variables) of a unit file."""
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # unit keys are case-sensitive
    unit.read_string(text)
    argv = systemd_words(unit["Service"]["ExecStart"], expands_variables=True)
    environment: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("Environment="):
            (word,) = systemd_words(line.removeprefix("Environment="), expands_variables=False)
            name, _, value = word.partition("=")
            environment[name] = value
    return unit, argv, environment


def expected_argv(store: Path, platform: str = "linux") -> list[str]:
    # Under launchd the daemon logs only to its own rotated file (see sf.daemon_argv).
    quiet = ["--no-log-to-stderr"] if platform == "darwin" else []
    return [
        PYTHON,
        "-m",
        "moestream.client.cli",
        "start",
        "--foreground",
        *quiet,
        "--model",
        str(store),
        "--memory-budget",
        "24G",
        "--max-batch",
        "2",
    ]


def start_params(argv: list[str]) -> dict[str, object]:
    """The daemon settings `moestreamctl start` itself parses from a service command line."""
    assert argv[:5] == [PYTHON, "-m", "moestream.client.cli", "start", "--foreground"]
    ctx = start.make_context("start", list(argv[4:]))
    assert ctx.params["foreground"] is True
    return {k: v for k, v in ctx.params.items() if k in START_FLAGS and v is not None}


def service_file_of(platform: str, content: bytes) -> tuple[list[str], dict[str, str]]:
    """(command line, environment) of a rendered plist or unit."""
    if platform == "darwin":
        doc = plistlib.loads(content)
        return doc["ProgramArguments"], doc["EnvironmentVariables"]
    _, argv, environment = parse_unit(content.decode())
    return argv, environment


def dry_run_of(platform: str, output: str, path: Path) -> tuple[str, list[str], dict[str, str]]:
    """(the "would run as" line, command line, environment) of `install --dry-run` output."""
    shown = output.split("would run as: ", 1)[1].split("\n", 1)[0]
    content = output.split(f"would write {path}:\n", 1)[1]
    if platform == "darwin":
        content = content[: content.index("</plist>") + len("</plist>\n")]
    else:
        content = content.split("would run:", 1)[0]
    return shown, *service_file_of(platform, content.encode())


def test_plist_has_every_key(store: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = invoke(
        [
            "install",
            "--platform",
            "darwin",
            "--no-load",
            "--model",
            str(store),
            "--memory-budget",
            "24G",
            "--max-batch",
            "2",
        ],
        clean_env(home, MOESTREAM_IO_THREADS="3", MOESTREAM_MAX_BATCH="1"),
    )
    assert result.exit_code == 0, result.output
    path = home / "Library" / "LaunchAgents" / "dev.moestream.daemon.plist"
    assert f"wrote {path}" in result.output
    assert "launchctl bootstrap gui/" in result.output  # says how to load it
    doc = plistlib.loads(path.read_bytes())
    assert doc["Label"] == "dev.moestream.daemon"
    assert doc["ProgramArguments"] == expected_argv(store, "darwin")
    assert doc["RunAtLoad"] is True
    assert doc["KeepAlive"] == {"SuccessfulExit": False}
    assert type(doc["ThrottleInterval"]) is int and doc["ThrottleInterval"] >= 1
    assert doc["ProcessType"] == "Interactive"
    logs = home / "Library" / "Logs" / "moestream"
    assert Path(doc["StandardOutPath"]).parent == logs and Path(doc["StandardErrorPath"]).parent == logs
    assert doc["StandardOutPath"] != doc["StandardErrorPath"]
    assert logs.is_dir()  # launchd does not create it
    env = doc["EnvironmentVariables"]
    assert env["MOESTREAM_IO_THREADS"] == "3"
    assert "MOESTREAM_MAX_BATCH" not in env  # given as a flag, which wins anyway
    assert env["PATH"].split(":")[0] == os.path.dirname(PYTHON)
    assert all(type(v) is str for v in env.values())
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # launchd skips group/other-writable plists
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_unit_has_every_key_and_passes_systemd_verify(store: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = invoke(
        [
            "install",
            "--platform",
            "linux",
            "--no-load",
            "--model",
            str(store),
            "--memory-budget",
            "24G",
            "--max-batch",
            "2",
        ],
        clean_env(home, MOESTREAM_IO_THREADS="3", MOESTREAM_LOG_FILE='/tmp/100% $HOME/"x".log'),
    )
    assert result.exit_code == 0, result.output
    path = home / ".config" / "systemd" / "user" / "moestream.service"
    assert "systemctl --user enable moestream.service" in result.output
    text = path.read_text()
    unit, argv, environment = parse_unit(text)
    assert unit["Unit"]["Description"]
    assert unit["Service"]["Type"] == "simple"
    assert unit["Service"]["Restart"] == "on-failure"
    assert int(unit["Service"]["RestartSec"]) >= 1
    assert unit["Install"]["WantedBy"] == "default.target"
    assert argv == expected_argv(store)
    assert environment["MOESTREAM_IO_THREADS"] == "3"
    assert environment["MOESTREAM_LOG_FILE"] == '/tmp/100% $HOME/"x".log'
    assert environment["PATH"].split(":")[0] == os.path.dirname(PYTHON)
    assert "@EXEC_START@" not in text and "@ENVIRONMENT@" not in text

    verify = shutil.which("systemd-analyze")
    if verify is None:
        pytest.skip("systemd-analyze is not installed: the unit was parsed but not verified by systemd")
    done = subprocess.run([verify, "verify", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "moestream.service" not in done.stderr, done.stderr  # warnings name the unit


def test_systemd_verify_catches_what_the_quoting_prevents(tmp_path: Path) -> None:
    """The verifier used above does reject an unescaped specifier and broken quoting,
    so its passing says something about the writer."""
    verify = shutil.which("systemd-analyze")
    if verify is None:
        pytest.skip("systemd-analyze is not installed")
    bad = tmp_path / "moestream.service"
    for exec_start in (f"{PYTHON} 100%z", f'{PYTHON} "unbalanced'):
        bad.write_text(f"[Service]\nType=simple\nExecStart={exec_start}\n")
        done = subprocess.run([verify, "verify", str(bad)], capture_output=True, text=True, timeout=30)
        assert done.returncode != 0, exec_start
    good = sf.render_unit(argv=[PYTHON, "100%z", '"unbalanced'], environment={})
    bad.write_text(good)
    assert subprocess.run([verify, "verify", str(bad)], capture_output=True, timeout=30).returncode == 0


@pytest.mark.parametrize(
    "word", ["", " ", "a b", "%", "%%i", "$", "$$", "${HOME}", '"', "'", "\\", '\\"', ";", "\t", "é ü"]
)
def test_exec_words_round_trip(word: str) -> None:
    line = " ".join(sf.quote_exec_arg(w) for w in ["/bin/x", word, "tail"])
    assert systemd_words(line, expands_variables=True) == ["/bin/x", word, "tail"]


@pytest.mark.parametrize("value", ["", "a b", "100%", "$HOME", "${X}", '"', "\\", "x=y"])
def test_environment_values_round_trip(value: str) -> None:
    line = sf.environment_line("NAME", value).removeprefix("Environment=")
    assert systemd_words(line, expands_variables=False) == [f"NAME={value}"]


def test_newlines_are_refused() -> None:
    with pytest.raises(sf.ServiceFileError, match="newline"):
        sf.quote_exec_arg("a\nExecStartPre=/bin/rm")
    with pytest.raises(sf.ServiceFileError, match="newline"):
        sf.render_plist(label="x", argv=["/bin/x\n"], environment={}, stdout_path=Path("/o"), stderr_path=Path("/e"))


def test_dry_run_writes_nothing(store: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = clean_env(home, PATH=str(tmp_path / "no-tools"))
    for platform in sf.PLATFORMS:
        result = invoke(["install", "--platform", platform, "--dry-run", "--model", str(store)], env)
        assert result.exit_code == 0, result.output
        path = sf.service_file_path(platform, home)
        assert f"would write {path}:" in result.output
        content = result.output.split(f"would write {path}:\n", 1)[1]
        if platform == "darwin":
            end = content.index("</plist>") + len("</plist>\n")
            assert plistlib.loads(content[:end].encode())["ProgramArguments"][:5] == expected_argv(store)[:5]
            assert "launchctl bootstrap gui/" in result.output
        else:
            _, argv, _ = parse_unit(content.split("would run:", 1)[0])
            assert argv[-2:] == ["--model", str(store)]
            assert "systemctl --user daemon-reload" in result.output
        for args in (["uninstall"], ["status"]):
            result = invoke([*args, "--platform", platform, "--dry-run"], env)
            assert result.exit_code == 0, result.output
            assert "would run:" in result.output
    assert files_under(home) == []


def test_install_takes_the_same_daemon_options_as_start() -> None:
    def options(command: click.Command) -> dict[str, dict]:
        return {p.name: p.to_info_dict() for p in command.params if p.name in START_FLAGS}

    theirs = options(start)
    assert set(theirs) == set(START_FLAGS)  # every setting start passes on is an option
    assert options(service.commands["install"]) == theirs  # names, help, types, defaults


# A log file and a runtime folder named with what systemd and XML treat specially.
ODD = "x 100% $HOME ${X} \"dq\" 'sq' back\\slash &<>;"


@pytest.mark.parametrize("platform", sf.PLATFORMS)
@pytest.mark.parametrize("pool", ["host-cache", "mapped"])
def test_every_daemon_setting_reaches_the_service(platform: str, pool: str, store: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    log_file, runtime_dir = tmp_path / ODD / "daemon.log", tmp_path / f"run {ODD}"
    args = [
        "--model",
        str(store),
        "--capacity",
        "25%",
        "--memory-budget",
        "24G",
        "--max-batch",
        "2",
        "--prompt-cache-bytes",
        "512M",
        "--autopin-frac",
        "0.3",
        "--max-connections",
        "100",
        "--io-threads",
        "3",
        "--log-file",
        str(log_file),
        "--runtime-dir",
        str(runtime_dir),
    ]
    # --no-mapped switches off a mapped pool that the environment or config would ask for.
    args += ["--host-cache", "20G", "--no-mapped"] if pool == "host-cache" else ["--mapped"]
    expected = {
        "model": str(store),
        "capacity": "25%",
        "memory_budget": "24G",
        "max_batch": 2,
        "prompt_cache_bytes": "512M",
        "autopin_frac": 0.3,
        "max_connections": 100,
        "io_threads": 3,
        "log_file": str(log_file),
        "runtime_dir": str(runtime_dir),
    }
    expected |= {"host_cache": "20G", "mapped": False} if pool == "host-cache" else {"mapped": True}
    # Variables of settings given as flags are left out (the flags win); the others travel.
    env = clean_env(
        home,
        PATH=str(tmp_path / "no-tools"),
        MOESTREAM_PROMPT_CACHE_BYTES="1G",
        MOESTREAM_IO_THREADS="7",
        MOESTREAM_MAX_ACTIVE="3",
    )
    path = sf.service_file_path(platform, home)

    result = invoke(["install", "--platform", platform, "--dry-run", *args], env)
    assert result.exit_code == 0, result.output
    shown, argv, environment = dry_run_of(platform, result.output, path)
    assert start_params(argv) == expected
    assert shlex.split(shown) == argv
    assert environment["MOESTREAM_MAX_ACTIVE"] == "3"
    assert "MOESTREAM_PROMPT_CACHE_BYTES" not in environment and "MOESTREAM_IO_THREADS" not in environment
    assert files_under(home) == []

    result = invoke(["install", "--platform", platform, "--no-load", *args], env)
    assert result.exit_code == 0, result.output
    assert service_file_of(platform, path.read_bytes()) == (argv, environment)
    verify = shutil.which("systemd-analyze")
    if platform == "linux" and verify is not None:
        done = subprocess.run([verify, "verify", str(path)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and "moestream.service" not in done.stderr, done.stderr


def test_install_when_the_service_manager_fails_keeps_the_file_and_says_how(store: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    # No reachable systemd user instance: the real systemctl fails (or is missing) here
    # and on any machine, so a developer's own session is never touched.
    unreachable = {
        "XDG_RUNTIME_DIR": str(tmp_path / "no-runtime"),
        "DBUS_SESSION_BUS_ADDRESS": f"unix:path={tmp_path}/no-bus",
    }
    result = invoke(["install", "--platform", "linux", "--model", str(store)], clean_env(home, **unreachable))
    assert result.exit_code == 1, result.output
    assert (home / ".config" / "systemd" / "user" / "moestream.service").is_file()
    assert "loading it failed" in result.output
    assert "systemctl --user enable moestream.service" in result.output
    assert "loginctl enable-linger" in result.output

    # macOS files on a PATH without launchctl.
    result = invoke(
        ["install", "--platform", "darwin", "--model", str(store)], clean_env(home, PATH=str(tmp_path / "no-tools"))
    )
    assert result.exit_code == 1, result.output
    assert (home / "Library" / "LaunchAgents" / "dev.moestream.daemon.plist").is_file()
    assert "`launchctl` was not found" in result.output
    assert "launchctl bootstrap gui/" in result.output


def test_uninstall_removes_the_file(store: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    for platform in sf.PLATFORMS:
        env = clean_env(home, PATH=str(tmp_path / "no-tools"))
        path = sf.service_file_path(platform, home)
        assert invoke(["install", "--platform", platform, "--no-load", "--model", str(store)], env).exit_code == 0
        assert path.is_file()
        result = invoke(["uninstall", "--platform", platform, "--no-unload"], env)
        assert result.exit_code == 0, result.output
        assert not path.exists() and f"removed {path}" in result.output
        result = invoke(["uninstall", "--platform", platform], env)
        assert result.exit_code == 0 and "not installed" in result.output

    # The manager cannot be reached: the file (and the enable link) still go, and it says so.
    path = sf.service_file_path("linux", home)
    env = clean_env(home, XDG_RUNTIME_DIR=str(tmp_path / "none"), DBUS_SESSION_BUS_ADDRESS=f"unix:path={tmp_path}/none")
    assert invoke(["install", "--platform", "linux", "--no-load", "--model", str(store)], env).exit_code == 0
    wants = path.parent / "default.target.wants" / "moestream.service"
    wants.parent.mkdir()
    wants.symlink_to(path)  # what `systemctl --user enable` makes
    result = invoke(["uninstall", "--platform", "linux"], env)
    assert result.exit_code == 1, result.output
    assert not path.exists() and not wants.is_symlink()
    assert "could not be told" in result.output and "moestreamctl stop" in result.output


def test_status_reports_the_file_and_the_manager(store: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = clean_env(home, PATH=str(tmp_path / "no-tools"))
    result = invoke(["status", "--platform", "linux"], env)
    assert result.exit_code == 1
    assert "(not installed)" in result.output and "`systemctl` was not found" in result.output
    env = clean_env(home, XDG_RUNTIME_DIR=str(tmp_path / "none"), DBUS_SESSION_BUS_ADDRESS=f"unix:path={tmp_path}/none")
    assert invoke(["install", "--platform", "linux", "--no-load", "--model", str(store)], env).exit_code == 0
    result = invoke(["status", "--platform", "linux"], env)
    assert "(installed)" in result.output
    assert result.exit_code != 0  # no user instance to ask: systemctl's own failure status
    if "Failed to connect to bus" in result.output:  # systemctl is there, its user instance is not
        assert "loginctl enable-linger" in result.output


def test_uninstall_of_the_daemon_takes_the_gateway_with_it(store: Path, tmp_path: Path) -> None:
    """The gateway only answers 503 without its daemon: the daemon's uninstall removes
    both services; --openai removes the gateway's alone."""
    home = tmp_path / "home"
    for platform in sf.PLATFORMS:
        env = clean_env(home, PATH=str(tmp_path / "no-tools"))
        daemon, gateway = sf.service_file_path(platform, home), sf.service_file_path(platform, home, sf.OPENAI)
        for extra in ([], ["--openai"]):
            args = ["install", "--platform", platform, "--no-load", *extra]
            assert invoke([*args, *([] if extra else ["--model", str(store)])], env).exit_code == 0
        assert daemon.is_file() and gateway.is_file()
        assert invoke(["uninstall", "--platform", platform, "--no-unload", "--openai"], env).exit_code == 0
        assert daemon.is_file() and not gateway.exists()
        assert invoke(["install", "--platform", platform, "--no-load", "--openai"], env).exit_code == 0
        result = invoke(["uninstall", "--platform", platform, "--no-unload"], env)
        assert result.exit_code == 0, result.output
        assert not daemon.exists() and not gateway.exists()
        assert f"removed {gateway}" in result.output and f"removed {daemon}" in result.output


def test_bad_settings_are_refused_before_writing(store: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = clean_env(home)
    cases = [
        (["--model", str(store), "--memory-budget", "lots"], "cannot read 'lots' as a size"),
        (["--model", str(tmp_path)], "not an expert store"),
        (["--model", str(tmp_path / "missing")], "does not exist"),
        (["--model", str(store), "--capacity", "0"], "at least one slot"),
        (["--model", str(store), "--host-cache", "lots"], "cannot read 'lots' as a size"),
        (["--model", str(store), "--io-threads", "0"], "Invalid value for '--io-threads': must be between 1 and 256"),
        (
            ["--model", str(store), "--max-batch", "-1"],
            "Invalid value for '--max-batch': must be between 0 and 256",
        ),
        (
            ["--model", str(store), "--autopin-frac", "1.5"],
            "Invalid value for '--autopin-frac': must be between 0 and 1",
        ),
        (["--model", str(store), "--mapped", "--host-cache", "4K"], "--mapped keeps every expert"),
        (["--openai", "--host-cache", "1G", "--max-batch", "2"], "--host-cache, --max-batch: the daemon's settings"),
    ]
    for args, message in cases:
        result = invoke(["install", "--platform", "linux", "--dry-run", *args], env)
        assert result.exit_code == 2 and message in result.output, result.output
    result = invoke(["install", "--platform", "linux", "--no-load"], clean_env(home, MOESTREAM_IO_THREADS="many"))
    assert result.exit_code == 2 and "io_threads" in result.output
    # The pair is refused wherever its halves come from, as the daemon would refuse it.
    result = invoke(
        ["install", "--platform", "linux", "--no-load", "--host-cache", "4K"], clean_env(home, MOESTREAM_MAPPED="1")
    )
    assert result.exit_code == 2 and "--mapped keeps every expert" in result.output
    assert files_under(home) == []
    # A tier that holds every expert is what a mapped pool keeps anyway: accepted.
    result = invoke(
        ["install", "--platform", "linux", "--dry-run", "--model", str(store), "--mapped", "--host-cache", "1G"], env
    )
    assert result.exit_code == 0, result.output


def test_relative_model_path_is_made_absolute(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.chdir(store.parent)
    result = invoke(["install", "--platform", "darwin", "--no-load", "--model", store.name], clean_env(home))
    assert result.exit_code == 0, result.output
    doc = plistlib.loads(sf.service_file_path("darwin", home).read_bytes())
    assert doc["ProgramArguments"][-2:] == ["--model", str(store)]


def test_templates_ship_as_package_data() -> None:
    from importlib import resources

    folder = resources.files("moestream") / "launchd"
    assert {p.name for p in folder.iterdir()} >= {sf.PLIST_TEMPLATE, sf.UNIT_TEMPLATE}
    plistlib.loads(sf.load_template(sf.PLIST_TEMPLATE).encode())


def test_client_side_imports_no_mlx() -> None:
    code = "import sys, moestream.client.cli.service, moestream.shared.service_files; print('mlx' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# What the service of each platform is given (flags, variables of the installing shell)
# and what the daemon it starts must report in `status --json` settings: linux a host
# cache, darwin a mapped pool (the two do not combine), each with its pool settings.
RUN_CASES = {
    "linux": (
        [
            "--capacity",
            "0.5",
            "--host-cache",
            "20G",
            "--prompt-cache-bytes",
            "512M",
            "--max-connections",
            "100",
            "--io-threads",
            "2",
            "--autopin-frac",
            "0.25",
        ],
        {"MOESTREAM_HOST_CACHE": "1G", "MOESTREAM_MAX_BATCH": "1"},
        # mapped not given: auto, which with a host tier (and on this CPU) is the slot pool.
        {
            "capacity": 0.5,
            "host_cache": 20 * 2**30,
            "mapped": "auto",
            "prompt_cache_bytes": 512 * 2**20,
            "max_connections": 100,
            "io_threads": 2,
            "max_batch": 2,
        },
    ),
    "darwin": (
        ["--capacity", "0.25", "--mapped", "--prompt-cache-bytes", "512M", "--max-batch", "1"],
        {"MOESTREAM_MAPPED": "0", "MOESTREAM_IO_THREADS": "3"},
        {
            "capacity": 0.25,
            "host_cache": 0,
            "mapped": True,
            "prompt_cache_bytes": 512 * 2**20,
            "max_connections": 4096,
            "io_threads": 3,
            "max_batch": 1,
        },
    ),
}


@pytest.mark.parametrize("platform", sf.PLATFORMS)
def test_service_command_starts_a_daemon_with_its_settings(platform: str, store: Path, tmp_path: Path) -> None:
    from daemon_cli import clean_env as child_env
    from daemon_cli import ctl

    from moestream.client.client import Client, DaemonDied, DaemonNotRunning
    from moestream.shared.heat_file import usage_path, write_usage
    from moestream.shared.store_format import load_manifest

    flags, shell_env, expected = RUN_CASES[platform]
    home = tmp_path / "home"
    # Short path: the socket lives here and macOS caps socket paths at 104 bytes.
    runtime = Path(tempfile.mkdtemp(prefix="mssvc-", dir="/tmp"))
    log_file = tmp_path / "logs 100% $HOME" / "daemon.log"
    flags = [*flags, "--log-file", str(log_file)]
    if platform == "darwin":
        flags += ["--runtime-dir", str(runtime)]  # linux: MOESTREAM_RUNTIME_DIR, below
    args = ["install", "--platform", platform, "--no-load", "--model", str(store), "--max-batch", "2", *flags]
    if platform == "darwin":
        args.remove("2")
        args.remove("--max-batch")
    result = invoke(args, clean_env(home, MOESTREAM_MAX_CONTEXT="4096", **shell_env))
    assert result.exit_code == 0, result.output
    path = sf.service_file_path(platform, home)
    if platform == "darwin":
        doc = plistlib.loads(path.read_bytes())
        argv, environment = doc["ProgramArguments"], doc["EnvironmentVariables"]
    else:
        _, argv, environment = parse_unit(path.read_text())
    assert environment["MOESTREAM_MAX_CONTEXT"] == "4096"  # a setting `start` has no flag for

    # Heat that names each layer's hottest experts, so --autopin-frac shows in the pins.
    heat = tmp_path / "heat"
    heat.mkdir()
    write_usage(
        usage_path(heat),
        {layer.ordinal: {e: 100 - e for e in range(layer.num_experts)} for layer in load_manifest(store).layers},
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOESTREAM_") and k != "XDG_CONFIG_HOME"}
    env |= environment | {"HOME": str(home), "MOESTREAM_HEAT_DIR": str(heat)}
    if platform == "linux":
        env["MOESTREAM_RUNTIME_DIR"] = str(runtime)
    out_path = tmp_path / "daemon.out"
    with open(out_path, "wb") as out:
        # cwd "/": launchd starts agents there, so nothing may depend on this checkout.
        proc = subprocess.Popen(argv, env=env, cwd="/", stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60.0
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the daemon exited with {proc.returncode} before it was ready:\n{out_path.read_text()}")
            try:
                with Client(str(runtime), timeout=2.0) as client:
                    if client.ping().state == "ready":
                        break
            except (DaemonNotRunning, DaemonDied):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"not ready within 60 s:\n{out_path.read_text()}")
            time.sleep(0.2)

        done = ctl("status", "--json", "--runtime-dir", str(runtime), env=child_env(HOME=str(home)), timeout=60)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert status["state"] == "ready" and status["model"] == str(store)
        assert {k: status["settings"][k] for k in expected} == expected
        assert status["settings"]["max_context"] == 4096
        assert status["log"] == str(log_file) and log_file.stat().st_size > 0
        assert status["runtime_dir"] == str(runtime)
        assert status["pool"]["mapped"] is (expected["mapped"] is True)
        if expected["mapped"] is True:
            assert status["pool"]["mapped_pool"] is not None
        else:
            # autopin pins floor(slots x frac) of each layer's hottest experts: 8 slots x 0.25.
            layers = status["pool"]["layers"]
            assert layers and all(layer["capacity"] == 8 and layer["pinned"] == 2 for layer in layers), layers

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, out_path.read_text()  # a clean exit: the service stays down
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(runtime, ignore_errors=True)
