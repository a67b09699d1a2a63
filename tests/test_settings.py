"""Settings defined once: every field carries its definition, and the options of each
command, the daemon's flags, the environment, the config file and `status` are all made
from it, so none of them can drift from the others."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import zmq
from click.testing import CliRunner

from moestream.client.cli import main as cli
from moestream.client.cli.daemon import START_FLAGS, restart, start
from moestream.client.cli.generate import generate
from moestream.client.cli.service import service
from moestream.client.cli.values import setting_flags
from moestream.daemon.main import DAEMON_FLAGS, build_parser
from moestream.shared.settings import (
    DAEMON,
    ENV_PREFIX,
    GENERATE,
    KINDS,
    LOCAL,
    SCOPES,
    SETTINGS,
    Settings,
    SettingsError,
    definition,
    in_scope,
)

# Options of `generate` named like a setting that are not one: --diagnostics asks for the
# diagnostics of its own request, not the daemon's setting.
GENERATE_REQUEST_OPTIONS = {"diagnostics"}
INSTALL = service.commands["install"]


def test_every_field_carries_its_definition():
    names = [f.name for f in dataclasses.fields(Settings)]
    assert [d.name for d in SETTINGS] == names
    for d in SETTINGS:
        assert d.flag == "--" + d.name.replace("_", "-")
        assert d.env == ENV_PREFIX + d.name.upper()
        assert d.kind in KINDS and d.scope <= set(SCOPES), d.name
        assert d.help and "\n" not in d.help and d.help.endswith("."), d.name
        assert d.coerce(d.default) == d.default, d.name  # the default is a value of its kind
        assert d.default_text(), d.name
        if d.kind in ("int", "float"):
            assert d.low is not None, d.name
        if d.kind == "choice":
            assert d.default in d.choices, d.name
        if LOCAL in d.scope:
            assert GENERATE not in d.scope, d.name  # generate takes it or only with --local
    assert Settings() == Settings(**{d.name: d.default for d in SETTINGS})


def _setting_params(command, skip: set[str] = frozenset()) -> list[str]:
    names = {d.name for d in SETTINGS}
    return [p.name for p in command.params if p.name in names and p.name not in skip]


def _flags_in_help(args: list[str]) -> set[str]:
    out = CliRunner().invoke(cli, [*args, "--help"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    return {d.flag for d in SETTINGS if re.search(rf"{re.escape(d.flag)}(?![\w-])", out.output)}


@pytest.mark.parametrize("args, command, scopes, skip", [
    (["start"], start, (DAEMON,), set()),
    (["restart"], restart, (DAEMON,), set()),
    (["service", "install"], INSTALL, (DAEMON,), set()),
    (["generate"], generate, (GENERATE, LOCAL), GENERATE_REQUEST_OPTIONS),
])
def test_commands_take_exactly_the_settings_of_their_scopes(args, command, scopes, skip):
    wanted = [d.name for d in in_scope(*scopes)]
    assert _setting_params(command, skip) == wanted  # in field order
    flags = {d.flag for d in in_scope(*scopes)} | {f"--{n.replace('_', '-')}" for n in skip}
    assert _flags_in_help(args) == flags


def test_start_passes_its_settings_on_and_the_daemon_takes_every_setting():
    assert START_FLAGS == tuple(d.name for d in in_scope(DAEMON))
    assert DAEMON_FLAGS == tuple(d.name for d in SETTINGS)
    daemon_options = {a.dest for a in build_parser()._actions}
    assert {d.name for d in SETTINGS} <= daemon_options
    # What a detached `generate` passes to the daemon it starts is a part of this.
    assert {d.name for d in in_scope(GENERATE)} <= set(START_FLAGS)


def _example(d) -> tuple[str, Any, Any]:
    """(a value as a flag or a variable spells it, as a TOML literal, the value it means)
    for setting `d`, other than its default where it can be."""
    if d.kind == "size":
        return "3M", '"3M"', 3 << 20
    if d.kind == "capacity":
        return "25%", '"25%"', 0.25
    if d.kind == "bool":
        return ("off", "false", False) if d.default else ("on", "true", True)
    if d.kind == "auto_bool":
        return "off", "false", False
    if d.kind == "int":
        n = d.low + 1 if d.high is None or d.low + 1 <= d.high else d.low
        return str(n), str(n), n
    if d.kind == "float":
        x = (d.low + d.high) / 4 if d.high is not None else d.low + 2.5
        return str(x), str(x), x
    if d.kind == "choice":
        value = next(c for c in reversed(d.choices) if c != d.default)
        return value.upper(), f'"{value}"', value
    return "/tmp/some where", '"/tmp/some where"', "/tmp/some where"


def _click_args(d, raw: str) -> list[str]:
    if d.kind in ("bool", "auto_bool"):
        return [d.flag if raw in ("on", "true") else f"--no-{d.flag[2:]}"]
    return [d.flag, raw]


@pytest.mark.parametrize("d", SETTINGS, ids=[d.name for d in SETTINGS])
def test_a_flag_a_variable_and_a_config_key_mean_the_same(d, tmp_path):
    raw, toml, value = _example(d)
    config = tmp_path / "config.toml"
    config.write_text(f"{d.name} = {toml}\n")
    none = tmp_path / "none.toml"
    from_env = getattr(Settings.resolve({}, {d.env: raw}, none), d.name)
    from_config = getattr(Settings.resolve({}, {}, config), d.name)
    args = build_parser().parse_args([d.flag, raw])
    from_daemon_flag = getattr(Settings.resolve({d.name: getattr(args, d.name)}, {}, none), d.name)
    assert from_env == from_config == from_daemon_flag == value
    for command in (start, generate):
        if d.name in _setting_params(command, GENERATE_REQUEST_OPTIONS if command is generate else set()):
            ctx = command.make_context(command.name, _click_args(d, raw) + (["x"] if command is generate else []))
            assert getattr(Settings.resolve({d.name: ctx.params[d.name]}, {}, none), d.name) == value


@pytest.mark.parametrize("d", SETTINGS, ids=[d.name for d in SETTINGS])
def test_a_bad_value_is_named_by_its_source(d, tmp_path):
    bad = {"size": "lots", "capacity": "0", "bool": "maybe", "auto_bool": "maybe", "int": "many",
           "float": "much", "choice": "bogus"}.get(d.kind)
    if bad is None:
        return  # any text is a path
    with pytest.raises(SettingsError, match=rf"^environment variable {d.env}: {d.name}: "):
        Settings.resolve({}, {d.env: bad}, tmp_path / "none.toml")
    config = tmp_path / "config.toml"
    config.write_text(f'\n{d.name} = "{bad}"\n')
    with pytest.raises(SettingsError, match=rf"^config file {re.escape(str(config))}, line 2: {d.name}: "):
        Settings.resolve({}, {}, config)
    if d.kind in ("bool", "auto_bool"):
        return  # on the command line a switch, which takes no value
    for command in (start, generate):
        if d.name in _setting_params(command, GENERATE_REQUEST_OPTIONS if command is generate else set()):
            out = CliRunner().invoke(command, [d.flag, bad])
            assert out.exit_code == 2 and f"Invalid value for '{d.flag}'" in out.output, out.output


def test_out_of_range_numbers_and_unknown_names_are_refused():
    with pytest.raises(SettingsError, match="max_context: must be between 16 and 16777216"):
        Settings.from_values({"max_context": 8})
    with pytest.raises(SettingsError, match="heat_flush_seconds: must be at least 0"):
        Settings.from_values({"heat_flush_seconds": "-1"})
    with pytest.raises(SettingsError, match=r"unknown setting 'host_cach' \(did you mean 'host_cache'\?\)"):
        Settings.from_values({"host_cach": "1G"})
    assert Settings.from_values({"mapped": "auto", "mapped_gather": "AUTO"}).mapped is None


def _odd_settings(tmp_path: Path) -> Settings:
    """Settings other than the defaults wherever they can be."""
    return Settings.from_values({d.name: _example(d)[0] for d in SETTINGS})


def test_status_reports_every_setting_as_restart_passes_it_back(tmp_path):
    from moestream.daemon.engine_loop import EngineLoop
    from moestream.daemon.server import Server
    from moestream.shared.runtime_dir import RuntimePaths

    paths = RuntimePaths(dir=tmp_path, log=tmp_path / "daemon.log")
    log = logging.getLogger("test")
    for settings in (Settings(model="/some/store"), _odd_settings(tmp_path)):
        ctx = zmq.Context()
        try:
            engine = EngineLoop(settings, ctx, "inproc://unused", log)  # not started
            reported = Server(settings, paths, log, handle_signals=False).status(engine)["settings"]
        finally:
            ctx.term()
        assert list(reported) == [d.name for d in SETTINGS]
        if settings.mapped is None:
            assert reported["mapped"] == "auto" and reported["mapped_gather"] == "auto"
        # As `restart` and a detached `start` pass them on: --name VALUE to the daemon.
        argv = [w for name, value in reported.items() if value is not None for w in (f"--{name.replace('_', '-')}",
                                                                                     str(value))]
        args = build_parser().parse_args(argv)
        again = Settings.resolve({name: getattr(args, name) for name in DAEMON_FLAGS}, {}, tmp_path / "none.toml")
        assert again == settings


def test_the_options_a_service_is_given_read_back_as_given(tmp_path):
    odd = _odd_settings(tmp_path)
    given = {name: odd.flag_values()[name] for name in START_FLAGS}
    given["mapped"], given["diagnostics"] = True, False
    ctx = start.make_context("start", setting_flags(given))
    # Sizes and capacities keep the spelling they were given in (here the daemon's).
    kept = {name: str(v) if definition(name).kind in ("size", "capacity") else v for name, v in given.items()}
    assert {k: v for k, v in ctx.params.items() if k in START_FLAGS} == kept
    assert setting_flags({"mapped": "auto", "diagnostics": None}) == []  # left to the environment and config
