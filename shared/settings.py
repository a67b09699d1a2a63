"""moestream's one settings object.

`Settings` is built once, in the command that starts the work, from (highest first)
command-line flags, `MOESTREAM_*` environment variables, the config file
(`$XDG_CONFIG_HOME/moestream/config.toml`, or `--config`), and the defaults below; it is
then passed down. Nothing else reads the environment, and nothing reads it at import.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

ENV_PREFIX = "MOESTREAM_"

_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class SettingsError(ValueError):
    """A setting has a value that cannot be used; the message names it."""


def parse_size(text: str | int) -> int:
    """'64G', '512MiB', '1.5g', 1024 -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGTkmgt]?)(i?[Bb])?\s*", str(text))
    if not m:
        raise SettingsError(f"cannot read {text!r} as a size (examples: 512M, 24G)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def format_size(n: int | float) -> str:
    """Bytes for people: 512 B, 4.0 KiB, 16.3 GiB (the units parse_size reads back)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_capacity(text: str | float | int | None) -> float | int | None:
    """'16' -> 16 slots per layer; '0.25' or '25%' -> a fraction of each layer's experts."""
    if text is None or isinstance(text, (int, float)):
        return text
    s = str(text).strip()
    try:
        if s.endswith("%"):
            value: float | int = float(s[:-1]) / 100.0
        elif re.fullmatch(r"[0-9]+", s):
            value = int(s)
        else:
            value = float(s)
    except ValueError:
        raise SettingsError(f"--capacity: cannot read {text!r} (a slot count like 16, or a fraction like 0.25 or 25%)") from None
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise SettingsError(f"--capacity: fraction {value} must be in (0, 1]")
    if isinstance(value, int) and value < 1:
        raise SettingsError("--capacity: at least one slot per layer")
    return value


# The online eviction policies' names (daemon/policies POLICIES, which a test holds to
# this list): checked here, so a bad name fails in the command, before any daemon runs.
POLICY_NAMES = ("lru", "lfu", "lfuda", "predictive", "induction", "recall")

# Where a mapped pool's prefetch copies (Settings.mapped_prefetch_stream).
MAPPED_PREFETCH_STREAMS = ("second", "same")


def default_runtime_dir(env: Mapping[str, str]) -> Path:
    """Where the daemon keeps its sockets and lock: private to the user, short path."""
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and sys.platform != "darwin":
        return Path(xdg) / "moestream"
    # macOS caps socket paths at 104 bytes, so stay under /tmp rather than the long
    # per-user $TMPDIR; the folder is created 0700 and ownership is checked.
    return Path("/tmp") / f"moestream-{os.getuid()}"


def demo_store_path() -> Path:
    """The expert store of the built-in demo model, shipped inside the package."""
    return Path(__file__).resolve().parent.parent / "daemon" / "demo" / "store"


def default_state_dir(env: Mapping[str, str]) -> Path:
    """The user's state folder for moestream ($XDG_STATE_HOME/moestream)."""
    base = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".local" / "state")
    return Path(base) / "moestream"


def default_config_file(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "moestream" / "config.toml"


@dataclass(frozen=True)
class Settings:
    # The model: an expert store made by `moestreamctl convert`; `resolve` puts the
    # built-in demo model here when none is given.
    model: str | None = None
    # Pool sizing: slots per MoE layer (int), a fraction of its experts (float), or a
    # memory budget in bytes for resident weights + pool + KV cache.
    capacity: float | int | None = None
    memory_budget: int | None = None
    policy: str = "lru"
    # Bytes of host memory that cache experts between the store and the pool (0: off).
    # One that holds every expert is made as a mapped pool where `mapped` is auto.
    host_cache: int = 0
    # A mapped pool (daemon/mapped/mapped_pool.py): every expert in host memory, addressable by
    # the kernels, with `capacity` (or `memory_budget`) experts per layer in GPU memory.
    # None is auto: mapped where it measured fastest and is safe (an NVIDIA GPU, a
    # partial pool, host RAM for every expert, no --host-cache or one that holds every
    # expert; see daemon/model/streaming_model.py `choose_mapped`), else the slot pool.
    mapped: bool | None = None
    # A mapped pool's placement moves at most this many experts per layer into GPU
    # memory each time it runs (once per token, or less often when it falls behind);
    # 0 keeps the initial placement (autopin's hottest experts of the saved heat). 0 by
    # default: on the H200 moves cost more than they saved (varied routing, 25%: 24.3
    # tok/s without against 21.6 with 2 in session 4, 31.5 against 26.7 in session 6;
    # tests/bench/results/bench_decode_q30_*h200.json), and on the real Qwen1.5-MoE trace
    # the heat's hottest held fixed hit more than LRU does (0.338 against 0.301 at 25%).
    mapped_moves: int = 0
    # Every this many tokens routed, a mapped pool sets each layer's GPU share to its
    # most routed experts so far (the saved heat included): a few moves now and then,
    # instead of a placement that a first start without heat would keep for good. The
    # first intervals are shorter (32, 64 and 128 tokens at 256). 0: never.
    mapped_rebalance_tokens: int = 256
    # A mapped pool's decode steps first copy the routed experts into a small stack in
    # GPU memory (one copy kernel per layer, wide loads) and run the expert kernels on
    # that, instead of letting the kernels read host memory over the link as they go
    # (daemon/mapped/row_gather.py). None is auto: on where that copy kernel runs (MLX's CUDA
    # build on its GPU), off elsewhere (on unified memory there is no link to wait on).
    # On the H200 at 25%, side by side over 7 rounds: 56.7 against 39.4 tok/s, 1.16x to
    # 1.59x in every round (tests/bench/results/bench_decode_q30_mapped_prefetch_h200.json;
    # session 7's run, with one more kernel per layer, was even at 1.02x).
    mapped_gather: bool | None = None
    # Where a mapped pool's prefetch copies the next layer's experts: "second", a second
    # MLX stream (measured 0.54x of gathering alone on the H200, session 8), or "same",
    # the layer's own stream, beside its expert kernels inside one CUDA graph
    # (daemon/mapped/mapped_prefetch.py; 1.03x with 4 blocks per row, 0.76x with 16, session
    # 10). `prefetch = auto` keeps either only where it is faster.
    mapped_prefetch_stream: str = "second"
    # The most blocks per expert row (mapped prefetch's staging) or per span (the slot
    # pool's prefetch copies with copy_kernel) of the copy kernels that copy ahead of use:
    # 64, as for copies the GPU waits on, fills the link alone but may crowd out the
    # kernels the copy runs beside; fewer leave them room
    # (tests/bench/gpu_background_copy_probe.py measures both).
    prefetch_copy_blocks: int = 64
    # MoE layers ahead whose predicted experts the slot pool's prefetch reads from the
    # store: 1 reads layer L+1's while layer L computes; 2 also layer L+2's (ranked by
    # its router on layer L's input), so that a read that takes longer than one layer's
    # compute has two layers' time. Each layer further costs one router matmul on the
    # device per layer, reads of its mispredictions, and the prefetch buffer (host
    # memory, 16 x top-k experts per layer of depth) grows with it.
    prefetch_depth: int = 1
    # Bytes of host memory for the slot pool's prefetch buffer (0: 16 x top-k experts
    # per layer of depth, at most 4 x a layer's experts per layer of depth). Entries
    # stay until newer reads need their room, so a larger buffer also keeps experts that
    # were read but not routed for a later token that routes them: on the H200 at depth
    # 2 and 3, 10 to 12% of the reads went unused with the default, none with 4 GB (which
    # took prefetch at 25% from 1.16x to 1.21-1.25x; memory the pool or a host tier would
    # use better where they can have it: README, "Prefetch").
    prefetch_buffer: int = 0
    # Native read engine.
    io_threads: int = 4
    direct_io: bool = True
    # The CUDA copier copies each call's spans (from the pinned host tier into pool rows)
    # with one launch of a copy kernel per 160 spans, loaded as PTX through the CUDA
    # driver (native/gen_copy_kernel.py), instead of one cudaMemcpyAsync per tensor of
    # each expert: about 2,700 calls per token at 7 us of host time each on the H200
    # (tests/bench/results/bench_predict_q30_h200.json). Measured there in session 9:
    # bit-identical (90 of 90 cases), a layer's copies queued in a tenth of the time, and
    # admission from the tier at 0.92 of the pinned link against 0.73 (decode itself
    # barely moved: the host sync per layer bounds the slot pool). On by default; a
    # driver that refuses the kernel makes the copier fall back to cudaMemcpyAsync, and
    # its counters say why. Nothing changes without a CUDA copier.
    copy_kernel: bool = True
    verify_checksums: bool = False
    # Daemon.
    runtime_dir: str | None = None
    autopin_frac: float = 0.5
    # Folder of the heat file (pool_usage.json) that autopin reads: beside the store by
    # default; see `heat_folder`.
    heat_dir: str | None = None
    heat_flush_seconds: float = 5.0
    diagnostics: bool = False
    # Prefetch of predicted experts: on, off, or auto (measure decode both ways at the
    # start of the run and keep it only where it is faster).
    prefetch: str = "auto"
    log_file: str | None = None
    # Requests: tokens per request (prompt + generated; also sizes the KV cache when the
    # pool comes from a memory budget), requests decoded at once, requests waiting.
    max_context: int = 16384
    max_active: int = 8
    max_queued: int = 256

    @classmethod
    def resolve(
        cls,
        flags: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: str | os.PathLike | None = None,
        *,
        problems: list[str] | None = None,
    ) -> "Settings":
        """Merge flags > MOESTREAM_* variables > config file > defaults.

        `flags` holds only the options the user gave (None means "not given"). A bad
        value raises `SettingsError` naming where it came from (the variable, or the
        config file and line); with a `problems` list, bad values from the environment
        or the config file are left out and described there instead, so that commands
        such as `status` and `stop` still work.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        where: dict[str, str] = {}
        path = Path(config_file) if config_file else default_config_file(env)
        if path.is_file():
            for name, (value, line) in _read_config_file(path).items():
                values[name], where[name] = value, f"config file {path}, line {line}"
        for f in fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key in env:
                values[f.name], where[f.name] = env[key], f"environment variable {key}"
        for name, value in (flags or {}).items():
            if value is not None:
                values[name] = value
                where.pop(name, None)
        if values.get("model") is None and demo_store_path().is_dir():
            values["model"] = str(demo_store_path())
        if problems is not None:
            for name in [n for n in values if n in where]:
                try:
                    cls.from_values({name: values[name]}, where)
                except SettingsError as e:
                    problems.append(f"{e}; ignored")
                    del values[name]
        return cls.from_values(values, where)

    @classmethod
    def from_values(cls, values: Mapping[str, Any], where: Mapping[str, str] | None = None) -> "Settings":
        """Settings from raw values; `where` names the source of each (for messages)."""
        known = {f.name: f for f in fields(cls)}
        out: dict[str, Any] = {}
        for name, raw in values.items():
            source = f"{where[name]}: " if where and name in where else ""
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (settings: {', '.join(known)})"
                raise SettingsError(f"{source}unknown setting {name!r}{hint}")
            try:
                out[name] = _coerce(name, raw)
            except SettingsError as e:
                raise SettingsError(f"{source}{e}") from None
        return cls(**out)

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **{k: _coerce(k, v) for k, v in changes.items()})

    def heat_folder(self, store: str | os.PathLike, env: Mapping[str, str] | None = None) -> Path:
        """Where the heat of `store` is kept: `heat_dir` when set; else beside the store,
        except for the built-in demo store or a store this user cannot write, whose heat
        goes to a folder of their own under the state folder (never into the installed
        package)."""
        if self.heat_dir:
            return Path(self.heat_dir)
        folder = Path(store).resolve()
        if folder != demo_store_path() and os.access(folder, os.W_OK):
            return folder
        digest = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
        return default_state_dir(os.environ if env is None else env) / "heat" / f"{folder.name}-{digest}"

    def runtime_path(self, env: Mapping[str, str] | None = None) -> Path:
        if self.runtime_dir:
            return Path(self.runtime_dir)
        return default_runtime_dir(os.environ if env is None else env)


_INT_RANGES = {"max_context": (16, 2**24), "max_active": (1, 1024), "max_queued": (0, 1_000_000), "mapped_moves": (0, 4096), "mapped_rebalance_tokens": (0, 2**31),
               "prefetch_copy_blocks": (1, 1024), "prefetch_depth": (1, 4)}


def _coerce(name: str, raw: Any) -> Any:
    if raw is None:
        return None
    if name == "capacity":
        return parse_capacity(raw)
    if name in ("memory_budget", "host_cache", "prefetch_buffer"):
        return parse_size(raw)
    if name in ("direct_io", "verify_checksums", "diagnostics", "mapped", "copy_kernel", "mapped_gather"):
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if name in ("mapped", "mapped_gather") and s == "auto":
            return None
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{name}: expected true or false{' or auto' if name in ('mapped', 'mapped_gather') else ''}, got {raw!r}")
    if name == "mapped_prefetch_stream":
        s = str(raw).strip().lower()
        if s not in MAPPED_PREFETCH_STREAMS:
            raise SettingsError(f"mapped_prefetch_stream: expected {' or '.join(MAPPED_PREFETCH_STREAMS)}, got {raw!r}")
        return s
    if name == "policy":
        if str(raw) not in POLICY_NAMES:
            raise SettingsError(f"policy: unknown eviction policy {raw!r}; valid names: {', '.join(POLICY_NAMES)}")
        return str(raw)
    if name == "prefetch":
        s = str(raw).strip().lower()
        if s not in ("on", "off", "auto"):
            raise SettingsError(f"prefetch: expected on, off or auto, got {raw!r}")
        return s
    if name == "io_threads":
        try:
            n = int(raw)
        except ValueError:
            raise SettingsError(f"io_threads: expected a whole number, got {raw!r}") from None
        if not 1 <= n <= 256:
            raise SettingsError("io_threads: must be between 1 and 256")
        return n
    if name in _INT_RANGES:
        low, high = _INT_RANGES[name]
        try:
            n = int(raw)
        except ValueError:
            raise SettingsError(f"{name}: expected a whole number, got {raw!r}") from None
        if not low <= n <= high:
            raise SettingsError(f"{name}: must be between {low} and {high}")
        return n
    if name in ("autopin_frac", "heat_flush_seconds"):
        try:
            v = float(raw)
        except ValueError:
            raise SettingsError(f"{name}: expected a number, got {raw!r}") from None
        if name == "autopin_frac" and not 0.0 <= v <= 1.0:
            raise SettingsError("autopin_frac: must be between 0 and 1")
        return v
    return str(raw)


def _read_config_file(path: Path) -> dict[str, tuple[Any, int]]:
    """{setting: (value, line number)} of a TOML config file."""
    import tomllib  # Python 3.11+; config files are optional, so import only when used

    try:
        text = path.read_text()
        data = tomllib.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise SettingsError(f"config file {path}: {e}") from e
    lines = text.splitlines()

    def line_of(key: str) -> int:
        # tomllib keeps no positions: the first line that assigns the key.
        pattern = re.compile(rf"\s*[\"']?{re.escape(key)}[\"']?\s*=")
        return next((i for i, line in enumerate(lines, 1) if pattern.match(line)), 0)

    return {k.replace("-", "_"): (v, line_of(k)) for k, v in data.items()}
