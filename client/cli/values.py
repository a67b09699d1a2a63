"""Option values the commands read the same way."""

from __future__ import annotations

import os

import click

from moestream.shared.settings import Settings, SettingsError, parse_size
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


def capacity_note(settings: Settings) -> str | None:
    """What a slot count above every layer's expert count becomes (the pool holds each
    layer's experts, no more), said rather than done silently; None otherwise."""
    if not isinstance(settings.capacity, int) or settings.model is None:
        return None
    try:
        manifest = load_manifest(settings.model)
    except StoreError:
        return None  # the command that loads the store says what is wrong with it
    most = max((layer.num_experts for layer in manifest.layers), default=0)
    if most and settings.capacity > most:
        return f"--capacity {settings.capacity} is more than the {most} experts of a layer: the pool holds all {most} (100%)"
    return None
