"""Options only the benchmarks take: a bench knob's, and a size's."""

from __future__ import annotations

from typing import Callable

import click

from ....shared.settings import SettingsError, knob, parse_size
from ..values import setting_option


def knob_option(name: str) -> Callable:
    """The option of a benchmark for bench knob `name` (`Definition.bench`): its default,
    its help and its checks come from the definition, as a setting's do."""
    d = knob(name)
    return setting_option(d, default=d.default)


def size_option(text: str | None, flag: str) -> int | None:
    """The bytes of a size option such as `--host-cache 20G` (None when not given); a
    value that is not a size is a usage error naming the option."""
    if not text:
        return None
    try:
        return parse_size(text)
    except SettingsError as e:
        raise click.UsageError(f"{flag}: {e}") from None
