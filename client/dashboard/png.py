"""A heat map as a PNG, written by a few lines of zlib (no imaging library needed)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Sequence

# The dashboard's colour ramp (static/dashboard.html drawHeat): white to blue.
LOW = (255, 255, 255)
HIGH = (55, 105, 215)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(pixels: Sequence[Sequence[tuple[int, int, int]]]) -> bytes:
    """8-bit RGB PNG of rows of (r, g, b) pixels."""
    height, width = len(pixels), len(pixels[0]) if pixels else 0
    if not height or not width or any(len(row) != width for row in pixels):
        raise ValueError("a PNG needs rows of pixels, all of one non-zero width")
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")
    )


def heat_pixels(rows: Sequence[Sequence[int]], cell: int = 8, gap: int = 1) -> list[list[tuple[int, int, int]]]:
    """Rows of layers x experts as cells of `cell` pixels, each layer scaled to its own
    hottest expert (as the dashboard draws it), `gap` pixels of white between layers."""
    out: list[list[tuple[int, int, int]]] = []
    for i, row in enumerate(rows):
        top = max(max(row), 1)
        line = []
        for count in row:
            t = count / top
            colour = tuple(round(lo + (hi - lo) * t) for lo, hi in zip(LOW, HIGH))
            line += [colour] * cell
        if i:
            out += [[LOW] * len(line) for _ in range(gap)]
        out += [list(line) for _ in range(cell)]
    return out


def write_heat_png(path: Path, rows: Sequence[Sequence[int]], cell: int = 8) -> int:
    """Write the heat map; returns the bytes written."""
    data = encode_png(heat_pixels(rows, cell))
    Path(path).write_bytes(data)
    return len(data)
