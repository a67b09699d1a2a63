"""Option values the commands read the same way."""

from __future__ import annotations

import click

from moestream.shared.settings import SettingsError, parse_size


def size_option(text: str | None, flag: str) -> int | None:
    """The bytes of a size option such as `--host-cache 20G` (None when not given); a
    value that is not a size is a usage error naming the option."""
    if not text:
        return None
    try:
        return parse_size(text)
    except SettingsError as e:
        raise click.UsageError(f"{flag}: {e}") from None
