"""Option values the commands read the same way."""

from __future__ import annotations

import os

import click

from moestream.shared.settings import SettingsError, parse_size
from moestream.shared.store_format import Manifest, StoreError, load_manifest


def size_option(text: str | None, flag: str) -> int | None:
    """The bytes of a size option such as `--host-cache 20G` (None when not given); a
    value that is not a size is a usage error naming the option."""
    if not text:
        return None
    try:
        return parse_size(text)
    except SettingsError as e:
        raise click.UsageError(f"{flag}: {e}") from None


def store_option(path: str | os.PathLike, flag: str = "--model") -> Manifest:
    """The manifest of the store at `path`, read before a command starts, copies or loads
    it: a folder that is no store, or a manifest that cannot be read, is a usage error
    naming the option and the path as given."""
    try:
        return load_manifest(path)
    except StoreError as e:
        hint = "" if "moestreamctl convert" in str(e) else " (make one with `moestreamctl convert`)"
        raise click.UsageError(f"{flag}: {e}{hint}") from None
