"""A heat map as a labelled PNG, drawn and encoded by a few lines of zlib (no imaging
library): a title naming the store, the layers down the left, the experts along the
bottom, and a colour scale with its numbers. Text is a 3x5 pixel font of capitals,
digits and a little punctuation, drawn twice its size."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# The dashboard's colour ramp (static/dashboard.html heatColour): white to blue.
LOW = (255, 255, 255)
HIGH = (55, 105, 215)
INK = (70, 78, 90)
RULE = (210, 214, 220)

# 3x5 glyphs, rows top to bottom ('#' ink). Other characters are drawn as '?'.
_FONT = {
    "A": ".#. #.# ### #.# #.#",
    "B": "##. #.# ##. #.# ##.",
    "C": ".## #.. #.. #.. .##",
    "D": "##. #.# #.# #.# ##.",
    "E": "### #.. ##. #.. ###",
    "F": "### #.. ##. #.. #..",
    "G": ".## #.. #.# #.# .##",
    "H": "#.# #.# ### #.# #.#",
    "I": "### .#. .#. .#. ###",
    "J": "..# ..# ..# #.# .#.",
    "K": "#.# #.# ##. #.# #.#",
    "L": "#.. #.. #.. #.. ###",
    "M": "#.# ### #.# #.# #.#",
    "N": "##. #.# #.# #.# #.#",
    "O": ".#. #.# #.# #.# .#.",
    "P": "##. #.# ##. #.. #..",
    "Q": ".#. #.# #.# ##. .##",
    "R": "##. #.# ##. #.# #.#",
    "S": ".## #.. .#. ..# ##.",
    "T": "### .#. .#. .#. .#.",
    "U": "#.# #.# #.# #.# ###",
    "V": "#.# #.# #.# #.# .#.",
    "W": "#.# #.# #.# ### #.#",
    "X": "#.# #.# .#. #.# #.#",
    "Y": "#.# #.# .#. .#. .#.",
    "Z": "### ..# .#. #.. ###",
    "0": "### #.# #.# #.# ###",
    "1": ".#. ##. .#. .#. ###",
    "2": "##. ..# .#. #.. ###",
    "3": "##. ..# .#. ..# ##.",
    "4": "#.# #.# ### ..# ..#",
    "5": "### #.. ##. ..# ##.",
    "6": ".## #.. ### #.# ###",
    "7": "### ..# .#. .#. .#.",
    "8": "### #.# ### #.# ###",
    "9": "### #.# ### ..# ##.",
    " ": "... ... ... ... ...",
    ".": "... ... ... ... .#.",
    ",": "... ... ... .#. #..",
    "-": "... ... ### ... ...",
    "_": "... ... ... ... ###",
    ":": "... .#. ... .#. ...",
    "/": "..# ..# .#. #.. #..",
    "(": ".#. #.. #.. #.. .#.",
    ")": ".#. ..# ..# ..# .#.",
    "%": "#.# ..# .#. #.. #.#",
    "+": "... .#. ### .#. ...",
    "=": "... ### ... ### ...",
    "?": "##. ..# .#. ... .#.",
}
_GLYPHS = {ch: rows.replace(" ", "") for ch, rows in _FONT.items()}
TEXT_SCALE = 2
ADVANCE = 4 * TEXT_SCALE  # a glyph and one column of space
TEXT_HEIGHT = 5 * TEXT_SCALE


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _encode(width: int, height: int, rgb: bytes) -> bytes:
    stride = 3 * width
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")
    )


class Canvas:
    """RGB pixels on white, with rectangles and text."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rgb = bytearray(b"\xff" * (3 * width * height))

    def rect(self, x: int, y: int, w: int, h: int, colour: tuple[int, int, int]) -> None:
        x0, x1 = max(x, 0), min(x + w, self.width)
        if x1 <= x0:
            return
        line = bytes(colour) * (x1 - x0)
        for row in range(max(y, 0), min(y + h, self.height)):
            start = 3 * (row * self.width + x0)
            self.rgb[start : start + len(line)] = line

    def text(self, x: int, y: int, text: str, colour: tuple[int, int, int] = INK, align: str = "left") -> None:
        """`text` in capitals with its top at `y`; `x` is its left, centre or right edge."""
        if align != "left":
            x -= text_width(text) // (2 if align == "center" else 1)
        for i, ch in enumerate(text.upper()):
            glyph = _GLYPHS.get(ch, _GLYPHS["?"])
            for j, bit in enumerate(glyph):
                if bit == "#":
                    gx, gy = x + i * ADVANCE + (j % 3) * TEXT_SCALE, y + (j // 3) * TEXT_SCALE
                    self.rect(gx, gy, TEXT_SCALE, TEXT_SCALE, colour)

    def png(self) -> bytes:
        return _encode(self.width, self.height, bytes(self.rgb))


def text_width(text: str) -> int:
    return max(len(text) * ADVANCE - TEXT_SCALE, 0)


def ramp(t: float) -> tuple[int, int, int]:
    """The colour of a count that is `t` (0..1) of the scale's top."""
    return tuple(round(lo + (hi - lo) * t) for lo, hi in zip(LOW, HIGH))  # type: ignore[return-value]


def short_count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 10**6 else f"{n / 1e3:.1f}K" if n >= 10**4 else str(n)


@dataclass(frozen=True)
class HeatLayout:
    """Where `heat_canvas` put things: the grid's top left, a cell's size (rows are
    `cell_h` apart with a white line under each), and the colour scale's bar."""

    grid_x: int
    grid_y: int
    cell_w: int
    cell_h: int
    scale_x: int
    scale_y: int
    scale_w: int
    top: int  # the count the scale's end stands for: the hottest expert's


MARGIN = 10
SCALE_W = 256


def heat_canvas(rows: Sequence[Sequence[int]], title: str, cell: int = 12) -> tuple[Canvas, HeatLayout]:
    """Rows of layers x experts as cells, one colour scale for every layer (0 to the
    hottest expert's count), labelled."""
    n_layers, n_experts = len(rows), len(rows[0]) if rows else 0
    if not n_layers or not n_experts or any(len(r) != n_experts for r in rows):
        raise ValueError("a heat map needs rows of counts, all of one non-zero length")
    top = max(max(max(r) for r in rows), 1)
    cell_w = max(2, min(cell, 1024 // n_experts))
    cell_h = max(cell, TEXT_HEIGHT + 2)
    label_w = text_width(str(n_layers - 1)) + 6
    grid_x = MARGIN + max(label_w, text_width("LAYER") + 6)
    grid_y = MARGIN + 2 * (TEXT_HEIGHT + 6)
    grid_w, grid_h = n_experts * cell_w, n_layers * cell_h
    ticks_y = grid_y + grid_h + 4
    scale_y = ticks_y + 2 * (TEXT_HEIGHT + 6) + 4
    width = max(grid_x + grid_w, MARGIN + text_width(title), MARGIN + SCALE_W + text_width(" " + short_count(top)) + 40)
    canvas = Canvas(width + MARGIN, scale_y + 10 + TEXT_HEIGHT + 6 + MARGIN)
    canvas.text(MARGIN, MARGIN, title)
    canvas.text(grid_x - 6, grid_y - TEXT_HEIGHT - 6, "LAYER", align="right")
    every_row = max(1, -(-(TEXT_HEIGHT + 2) // cell_h))
    for layer, counts in enumerate(rows):
        y = grid_y + layer * cell_h
        for e, c in enumerate(counts):
            canvas.rect(grid_x + e * cell_w, y, cell_w, cell_h - 1, ramp(c / top))
        if layer % every_row == 0:
            canvas.text(grid_x - 6, y + (cell_h - 1 - TEXT_HEIGHT) // 2, str(layer), align="right")
    # Expert ticks, a round step apart that leaves room for their numbers.
    step = next(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, n_experts) if s * cell_w >= 36)
    canvas.rect(grid_x, grid_y + grid_h, grid_w, 1, RULE)
    for e in range(0, n_experts, step):
        x = grid_x + e * cell_w + cell_w // 2
        canvas.rect(x, grid_y + grid_h, 1, 3, INK)
        canvas.text(x, ticks_y, str(e), align="center")
    canvas.text(grid_x + grid_w // 2, ticks_y + TEXT_HEIGHT + 6, "EXPERT", align="center")
    scale_x = MARGIN
    for i in range(SCALE_W):
        canvas.rect(scale_x + i, scale_y, 1, 10, ramp(i / (SCALE_W - 1)))
    canvas.text(scale_x, scale_y + 14, "0")
    canvas.text(scale_x + SCALE_W // 2, scale_y + 14, short_count(top // 2), align="center")
    canvas.text(scale_x + SCALE_W, scale_y + 14, short_count(top), align="right")
    canvas.text(scale_x + SCALE_W + 12, scale_y, "ROUTINGS PER EXPERT")
    layout = HeatLayout(grid_x, grid_y, cell_w, cell_h, scale_x, scale_y, SCALE_W, top)
    return canvas, layout


def write_heat_png(path: Path, rows: Sequence[Sequence[int]], title: str, cell: int = 12) -> int:
    """Write the heat map; returns the bytes written."""
    canvas, _ = heat_canvas(rows, title, cell)
    data = canvas.png()
    Path(path).write_bytes(data)
    return len(data)
