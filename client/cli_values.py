"""Option values the commands read the same way."""

from __future__ import annotations

import click

from moestream.shared.settings import Settings, SettingsError, parse_size
from moestream.shared.store_format import StoreError, load_manifest


def size_option(text: str | None, flag: str) -> int | None:
    """The bytes of a size option such as `--host-cache 20G` (None when not given); a
    value that is not a size is a usage error naming the option."""
    if not text:
        return None
    try:
        return parse_size(text)
    except SettingsError as e:
        raise click.UsageError(f"{flag}: {e}") from None


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
