"""Option values the commands read the same way, and the settings' options."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Mapping

import click

from ...shared.settings import (
    GENERATE,
    LOCAL,
    Definition,
    Settings,
    SettingsError,
    definition,
    demo_store_path,
    in_scope,
    names_the_demo,
)
from ...shared.store_format import Manifest, StoreError, load_manifest

# What --help shows as a setting's value, by kind (a choice lists its choices).
_METAVARS = {
    "size": "SIZE",
    "capacity": "N|F",
    "duration": "DURATION",
    "int": "N",
    "float": "X",
    "path": "PATH",
    "text": "TEXT",
}


class StorePath(click.Path):
    """An expert store's folder, as every command's --model takes it: `demo` is the
    built-in demo model's (unless a folder of that name is here)."""

    HELP = "Expert store (`demo`: the built-in demo model)."

    def __init__(self, *, exists: bool = False) -> None:
        super().__init__(exists=exists, file_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return super().convert(str(demo_store_path()) if names_the_demo(value) else value, param, ctx)


class SettingType(click.ParamType):
    """A setting's value on the command line, checked as the environment's and the config
    file's are (Definition.coerce), with the message naming the option."""

    def __init__(self, d: Definition) -> None:
        self.d = d
        self.name = d.kind

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            coerced = self.d.coerce(value)
        except SettingsError as e:
            self.fail(str(e), param, ctx)
        # Sizes, capacities and durations are passed on as spelled (24G, 25%, 30m), so that
        # a service file or a daemon's command line reads as the user wrote it.
        return value if self.d.kind in ("size", "capacity", "duration") else coerced


def setting_option(d: Definition, *, local_only: bool = False, default: Any = None) -> Callable:
    """The click option of setting `d`; not given is `default`, None for a setting (the
    environment, the config file or the default then decide)."""
    text = d.help + (" With --local only: a running daemon keeps its own." if local_only else "")
    text += f" [default: {d.default_text(sys.platform)}{d.range_text() and '; ' + d.range_text()}]"
    if d.kind in ("bool", "auto_bool"):
        return click.option(d.switch, d.name, default=default, help=text)
    metavar = f"[{'|'.join(d.choices)}]" if d.kind == "choice" else _METAVARS[d.kind]
    return click.option(d.flag, d.name, type=SettingType(d), default=default, metavar=metavar, help=text)


def runtime_dir_option(f: Callable) -> Callable:
    """`--runtime-dir` of the commands that only find a running daemon (`stop`, `status`,
    ...), its help naming this platform's default."""
    d = definition("runtime_dir")
    return click.option(d.flag, help=f"The daemon's runtime folder [default: {d.default_text(sys.platform)}].")(f)


def setting_options(*scopes: str) -> Callable:
    """Give a command the options of the settings of `scopes`, in field order in --help,
    and hand it `given`: {setting: value, None for not given} of those options."""
    defs = in_scope(*scopes)

    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def command(*args: Any, **kwargs: Any) -> Any:
            given = {d.name: kwargs.pop(d.name) for d in defs}
            return f(*args, given=given, **kwargs)

        for d in reversed(defs):
            local_only = GENERATE in scopes and LOCAL in d.scope and GENERATE not in d.scope
            command = setting_option(d, local_only=local_only)(command)
        return command

    return decorate


def setting_flags(given: Mapping[str, Any]) -> list[str]:
    """The command-line options that set `given` (None = not given), as `setting_options`
    spells them: --x or --no-x for a bool, else --x VALUE."""
    flags: list[str] = []
    for name, value in given.items():
        if value is None:
            continue
        d = definition(name)
        if d.kind in ("bool", "auto_bool"):
            value = d.coerce(value)
            if value is not None:  # auto: not given
                flags.append(d.flag if value else f"--no-{d.flag[2:]}")
        else:
            flags += [d.flag, str(value)]
    return flags


def store_option(path: str | os.PathLike, flag: str = "--model") -> Manifest:
    """The manifest of the store at `path`, read before a command starts, copies or loads
    it: a folder that is no store, or a manifest that cannot be read, is a usage error
    naming the option and the path as given."""
    try:
        return load_manifest(path)
    except StoreError as e:
        hint = "" if "moestreamctl convert" in str(e) else " (make one with `moestreamctl convert`)"
        raise click.UsageError(f"{flag}: {e}{hint}") from None


def capacity_note(settings: Settings) -> None:
    """What a slot count above every layer's expert count becomes (the pool holds each
    layer's experts, no more), said (a note on stderr) rather than done silently."""
    if not isinstance(settings.capacity, int) or settings.model is None:
        return
    try:
        manifest = load_manifest(settings.model)
    except StoreError:
        return  # the command that loads the store says what is wrong with it
    most = max((layer.num_experts for layer in manifest.layers), default=0)
    if most and settings.capacity > most:
        click.echo(
            f"note: --capacity {settings.capacity} is more than the {most} experts of a layer: "
            f"the pool holds all {most} (100%)",
            err=True,
        )
