"""The machine's memory pressure, as the elastic pool reads it (daemon/pool/elastic.py).

A source answers `read()` with a level, `normal`, `warn` or `critical`, and what it saw:

- macOS: the kernel's own level (`kern.memorystatus_vm_pressure_level`, the one its
  memory-pressure notifications carry: 1 normal, 2 warn, 4 critical), read by sysctl.
- Linux: pressure stall information (`/proc/pressure/memory`): `full avg10` (every task
  stalled on memory, the last 10 s) at CRITICAL_STALL_PCT or more is critical, `some avg10`
  at WARN_STALL_PCT or more is warn; where the kernel has no PSI, MemAvailable of MemTotal
  (`/proc/meminfo`) below WARN_AVAILABLE / CRITICAL_AVAILABLE.
- `file:PATH` (the `memory_pressure` bench knob): a level written in a file, which tests
  and benchmarks write to drive a daemon; tests/pool_store.py's `ManualPressure` does the
  same in-process.

The Linux levels are left at half their thresholds (a level held until the stall halves,
or until the available memory doubles), so that a reading near a threshold does not
shrink and grow the pool at every poll; macOS's level has the kernel's own hysteresis.
Sources import nothing of MLX and never block: a read is a sysctl or a small file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

Level = Literal["normal", "warn", "critical"]
LEVELS: tuple[Level, ...] = ("normal", "warn", "critical")

# PSI: the share of the last 10 s in which some (warn) or every (critical) task waited for memory.
WARN_STALL_PCT = 10.0
CRITICAL_STALL_PCT = 10.0
# Without PSI: MemAvailable as a share of MemTotal.
WARN_AVAILABLE = 0.10
CRITICAL_AVAILABLE = 0.05
# A level is left once its measure is this far back from its threshold.
HYSTERESIS = 0.5

PSI_PATH = Path("/proc/pressure/memory")
MEMINFO_PATH = Path("/proc/meminfo")
_MAC_LEVELS: dict[int, Level] = {1: "normal", 2: "warn", 4: "critical"}


@dataclass(frozen=True)
class Pressure:
    level: Level
    # What the source saw, for the log and `status` ("PSI some avg10 12.3%, full avg10 0.0%").
    detail: str


class PressureSource(Protocol):
    # What it reads ("macOS memory pressure", "PSI", "MemAvailable", "file /x", "manual").
    name: str

    def read(self) -> Pressure: ...


class FilePressure:
    """The level written in a file (a missing or empty file: normal), with any words
    after it as the detail: `critical from the test`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = f"file {self.path}"

    def read(self) -> Pressure:
        try:
            words = self.path.read_text(encoding="utf-8", errors="replace")[:200].split()
        except OSError:
            words = []
        if not words:
            return Pressure("normal", f"{self.path}: no level written")
        level = words[0].lower()
        if level not in LEVELS:
            return Pressure("normal", f"{self.path}: {level!r} is no level ({', '.join(LEVELS)}); read as normal")
        return Pressure(level, " ".join(words[1:]) or f"written in {self.path}")  # type: ignore[arg-type]


class MacPressure:
    """macOS's memory-pressure level, as its notifications give it."""

    name = "macOS memory pressure"

    def __init__(self, libc: Any = None) -> None:
        """`libc`: the C library whose `sysctlbyname` is called (the system's by default)."""
        self._libc = libc if libc is not None else ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

    def read(self) -> Pressure:
        value = ctypes.c_int(0)
        size = ctypes.c_size_t(ctypes.sizeof(value))
        rc = self._libc.sysctlbyname(
            b"kern.memorystatus_vm_pressure_level", ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)
        )
        if rc != 0:
            return Pressure("normal", f"kern.memorystatus_vm_pressure_level unreadable (errno {ctypes.get_errno()})")
        return Pressure(_MAC_LEVELS.get(value.value, "normal"), f"kern.memorystatus_vm_pressure_level {value.value}")


def _held(was_on: bool, measure: float, threshold: float) -> bool:
    """Whether a level set at `measure >= threshold` is on: reached now, or on before and
    not yet back below HYSTERESIS of the threshold."""
    return measure >= threshold or (was_on and measure >= threshold * HYSTERESIS)


class _ProcFile:
    """A Linux source: a file of /proc read at each reading, and its two levels, each held
    with its hysteresis."""

    default_path: Path

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or self.default_path
        self._warn = self._critical = False

    def _judge(self, warn: tuple[float, float], critical: tuple[float, float], detail: str) -> Pressure:
        """The level from (measure, threshold) pairs, higher measures worse."""
        self._warn = _held(self._warn, *warn)
        self._critical = _held(self._critical, *critical)
        level: Level = "critical" if self._critical else "warn" if self._warn else "normal"
        return Pressure(level, detail)


class PsiPressure(_ProcFile):
    """Linux pressure stall information for memory."""

    name = "PSI"
    default_path = PSI_PATH

    def available(self) -> bool:
        try:
            return bool(self._averages())
        except (OSError, ValueError, KeyError):
            return False

    def _averages(self) -> dict[str, float]:
        out = {}
        for line in self.path.read_text().splitlines():
            kind, *fields = line.split()
            values = dict(f.split("=", 1) for f in fields)
            out[kind] = float(values["avg10"])
        return out

    def read(self) -> Pressure:
        try:
            avg = self._averages()
        except (OSError, ValueError, KeyError) as e:
            return Pressure("normal", f"{self.path} unreadable: {e}")
        some, full = avg.get("some", 0.0), avg.get("full", 0.0)
        detail = f"PSI some avg10 {some:.1f}%, full avg10 {full:.1f}%"
        return self._judge((some, WARN_STALL_PCT), (full, CRITICAL_STALL_PCT), detail)


class AvailablePressure(_ProcFile):
    """Linux without PSI: MemAvailable as a share of MemTotal."""

    name = "MemAvailable"
    default_path = MEMINFO_PATH

    def read(self) -> Pressure:
        try:
            info = {}
            for line in self.path.read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    info[key] = int(rest.split()[0]) * 1024
            share = info["MemAvailable"] / info["MemTotal"]
        except (OSError, ValueError, KeyError, IndexError, ZeroDivisionError) as e:
            return Pressure("normal", f"{self.path} unreadable: {e}")
        # Lower is worse: judged on its inverse, so a level is held until the share doubles.
        scarcity = 1 / max(share, 1e-9)
        detail = f"MemAvailable {info['MemAvailable'] / 2**30:.1f} GiB of {info['MemTotal'] / 2**30:.1f} GiB"
        return self._judge((scarcity, 1 / WARN_AVAILABLE), (scarcity, 1 / CRITICAL_AVAILABLE), detail)


def platform_source() -> PressureSource | None:
    """The running system's source: macOS's level, Linux's PSI, else its MemAvailable;
    None elsewhere."""
    if sys.platform == "darwin":
        return MacPressure()
    if sys.platform.startswith("linux"):
        psi = PsiPressure()
        return psi if psi.available() else AvailablePressure()
    return None


def pressure_source(spec: str) -> PressureSource | None:
    """The source the `memory_pressure` knob names: auto (the system's), off (None) or
    file:PATH."""
    if spec == "off":
        return None
    if spec == "auto":
        return platform_source()
    if spec.startswith("file:") and len(spec) > len("file:"):
        return FilePressure(spec[len("file:") :])
    raise ValueError(f"memory_pressure {spec!r}: use auto, off or file:PATH")
