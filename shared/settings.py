"""moestream's one settings object.

`Settings` is built once, in the command that starts the work, from (highest first)
command-line flags, `MOESTREAM_*` environment variables, the config file
(`$XDG_CONFIG_HOME/moestream/config.toml`, or `--config`), and the defaults below; it is
then passed down. Nothing else reads the environment, and nothing reads it at import.

Each field carries its own definition (`setting(...)`): its kind, range or choices,
help, and the commands that take it as an option (`scope`). The coercion, the options
of `start`, `restart`, `service install` and `generate`, the daemon's own flags, the
settings `status` reports and the README's table are all made from it.

    python -m moestream.shared.settings --markdown    # the README's settings table
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import re
import sys
import types
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from .runtime_dir import SOCKET_NAME, max_socket_path_bytes
from .store_format import StoreError, canonical_folder, load_manifest, same_folder

ENV_PREFIX = "MOESTREAM_"

_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

# Which commands take a setting as an option. Every setting is also a flag of the
# daemon process itself (`python -m moestream.daemon.main`), and every one can be set
# by its MOESTREAM_* variable or in the config file.
DAEMON = "daemon"  # `start`, `restart` and `service install`, passed on to the daemon
GENERATE = "generate"  # `generate`, passed on to a daemon it starts
LOCAL = "local"  # `generate`, only with --local: a running daemon keeps its own
SCOPES = (DAEMON, GENERATE, LOCAL)

# The kinds of value a setting takes; each has one coercion (`Definition.coerce`).
KINDS = (
    "size",  # bytes: 512M, 24G, or a number
    "capacity",  # slots per layer (16) or a fraction of its experts (0.25, 25%)
    "bool",  # true/false, 1/0, yes/no, on/off
    "auto_bool",  # the same, or auto (None)
    "int",  # a whole number in [low, high]
    "float",  # a number in [low, high]
    "choice",  # one of `choices`
    "duration",  # seconds: 30m, 10s, 1h, 90, or -1 for never
    "path",  # a file or folder; made absolute where a daemon runs elsewhere
    "text",
)


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


_DURATION_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
NEVER = -1.0  # a duration that never runs out


def parse_duration(text: str | float | int) -> float:
    """'30m', '10s', '1h', '1h30m', 90 -> seconds; any negative (Ollama's -1) -> NEVER."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        s = str(text).strip().lower()
        parts = re.findall(r"([0-9]*\.?[0-9]+)(ms|s|m|h)?", s)
        if re.fullmatch(r"-?\s*[0-9]*\.?[0-9]+", s):
            seconds = float(s.replace(" ", ""))
        elif parts and re.fullmatch(r"(-?)((?:[0-9]*\.?[0-9]+(?:ms|s|m|h))+)", s):
            seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts) * (-1 if s.startswith("-") else 1)
        else:
            raise SettingsError(f"cannot read {text!r} as a duration (examples: 30m, 10s, 1h, 0, -1 for never)")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise SettingsError(f"cannot read {text!r} as a duration (examples: 30m, 10s, 1h, 0, -1 for never)")
    return NEVER if seconds < 0 else seconds


def format_duration(seconds: float) -> str:
    """Seconds for people, in units parse_duration reads back: 30m, 10s, 1h, never."""
    if seconds < 0:
        return "never"
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _capacity(text: str | float | int) -> float | int:
    """A capacity, or SettingsError saying what is wrong with it (not naming the setting)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value: float | int = text
    else:
        s = str(text).strip()
        try:
            if s.endswith("%"):
                value = float(s[:-1]) / 100.0
            elif re.fullmatch(r"[0-9]+", s):
                value = int(s)
            else:
                value = float(s)
        except ValueError:
            raise SettingsError(
                f"cannot read {text!r} (a slot count like 16, or a fraction like 0.25 or 25%)"
            ) from None
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise SettingsError(f"fraction {value} must be in (0, 1]")
    if isinstance(value, int) and value < 1:
        raise SettingsError("at least one slot per layer")
    return value


# The online eviction policies' names (daemon/policies POLICIES, which a test holds to
# this list): checked here, so a bad name fails in the command, before any daemon runs.
POLICY_NAMES = ("lru", "lfu", "lfuda", "predictive", "induction", "recall")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _either(words: tuple[str, ...] | list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


@dataclass(frozen=True)
class Definition:
    """What a setting is: everything but its name comes from `setting(...)`."""

    kind: str
    help: str
    default: Any
    scope: frozenset[str] = frozenset()
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    # A choice's message names what is chosen ("unknown eviction policy 'x'") where set.
    noun: str | None = None
    # The default as people read it, where the value does not say it (a None that
    # stands for a folder found at run time, say).
    shown_default: str | None = None
    # (platform, default) pairs where the default differs by platform: `--help` names
    # the one of the running system, the README `shown_default` (both).
    shown_default_on: tuple[tuple[str, str], ...] = ()
    # A knob of an experiment, not a user's choice: a field of `Settings` that the
    # benchmarks and tests set (`moestreamctl bench ... --copy-kernel`), with no flag of
    # `start`, no variable and no config key, and not in the README's table.
    bench: bool = False
    name: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def switch(self) -> str:
        """The flag as commands spell it: --x/--no-x for a bool's."""
        if self.kind in ("bool", "auto_bool"):
            return f"{self.flag}/--no-{self.flag[2:]}"
        return self.flag

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def coerce(self, raw: Any) -> Any:
        """The value of `raw` (a flag's, a variable's or a config file's); SettingsError
        says what is wrong without naming the setting (the caller says where it came from)."""
        if raw is None:
            return None
        kind = self.kind
        if kind == "size":
            return parse_size(raw)
        if kind == "capacity":
            return _capacity(raw)
        if kind == "duration":
            return parse_duration(raw)
        if kind in ("bool", "auto_bool"):
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if kind == "auto_bool" and s == "auto":
                return None
            if s in _TRUE:
                return True
            if s in _FALSE:
                return False
            raise SettingsError(f"expected true or false{' or auto' if kind == 'auto_bool' else ''}, got {raw!r}")
        if kind in ("int", "float"):
            what = "a whole number" if kind == "int" else "a number"
            try:
                # A config file's 2.5 is no whole number, and its booleans are no numbers.
                if isinstance(raw, bool) or (kind == "int" and isinstance(raw, float) and not raw.is_integer()):
                    raise ValueError(raw)
                n = int(raw) if kind == "int" else float(raw)
            except (TypeError, ValueError):
                raise SettingsError(f"expected {what}, got {raw!r}") from None
            if n != n:  # NaN passes no range check
                raise SettingsError(f"expected {what}, got {raw!r}")
            if self.low is not None and self.high is not None and not self.low <= n <= self.high:
                raise SettingsError(f"must be between {_number(self.low)} and {_number(self.high)}")
            if self.low is not None and self.high is None and n < self.low:
                raise SettingsError(f"must be at least {_number(self.low)}")
            return n
        if kind == "choice":
            s = str(raw).strip().lower()
            if s not in self.choices:
                if self.noun:
                    raise SettingsError(f"unknown {self.noun} {raw!r}; valid names: {', '.join(self.choices)}")
                raise SettingsError(f"expected {_either(self.choices)}, got {raw!r}")
            return s
        return str(raw)

    def flag_value(self, value: Any) -> Any:
        """`value` as its flag reads it back: auto for an auto_bool's None."""
        return "auto" if self.kind == "auto_bool" and value is None else value

    def default_text(self, platform: str | None = None) -> str:
        """The default, as the README says it, or `--help` on `platform` (a `sys.platform`)."""
        if platform is not None:
            for name, text in self.shown_default_on:
                if platform.startswith(name):
                    return text
        if self.shown_default is not None:
            return self.shown_default
        d = self.default
        if self.kind in ("bool", "auto_bool"):
            return "auto" if d is None else "on" if d else "off"
        if self.kind == "size" and d:
            return format_size(d)
        if self.kind == "duration":
            return format_duration(d)
        return "none" if d is None else str(d)

    def range_text(self) -> str:
        """The range of a number ("1 to 256", "at least 0"), or ""."""
        if self.low is None:
            return ""
        if self.high is None:
            return f"at least {_number(self.low)}"
        return f"{_number(self.low)} to {_number(self.high)}"

    def commands(self) -> list[str]:
        """The commands that take this setting as an option."""
        out = []
        if DAEMON in self.scope:
            out.append("start")
        if GENERATE in self.scope:
            out.append("generate")
        elif LOCAL in self.scope:
            out.append("generate --local")
        return out


def setting(default: Any, *, scope: tuple[str, ...] = (), **definition: Any) -> Any:
    """A Settings field with its definition (`Definition`'s other fields: kind, help,
    low, ...) in its metadata."""
    d = Definition(default=default, scope=frozenset(scope), **definition)
    if d.kind not in KINDS:
        raise ValueError(f"setting kind {d.kind!r}: use one of {', '.join(KINDS)}")
    if set(scope) - set(SCOPES):
        raise ValueError(f"setting scope {scope!r}: use {', '.join(SCOPES)}")
    if d.kind == "choice" and default not in d.choices:
        raise ValueError(f"the default {default!r} is not one of {d.choices!r}")
    if d.bench and scope:
        raise ValueError("a bench knob is no option of the commands")
    return dataclasses.field(default=default, metadata={"setting": d})


def default_runtime_dir(env: Mapping[str, str], platform: str | None = None) -> Path:
    """Where the daemon keeps its socket, lock, pid file and log: private to the user, a
    short path, and never where a cleanup job deletes files left untouched.

    Linux: `$XDG_RUNTIME_DIR/moestream` (logind keeps it for the user's sessions), else
    `/tmp/moestream-UID`. macOS: `~/Library/Caches/moestream`, not `/tmp`, whose daily
    `periodic` cleanup deletes files untouched for 3 days (the lock and pid files of a
    daemon up that long); `/tmp/moestream-UID` only where a long home folder would put the
    socket past macOS's 103-byte limit. `platform` is `sys.platform` unless given."""
    platform = sys.platform if platform is None else platform
    fallback = Path("/tmp") / f"moestream-{os.getuid()}"
    if platform == "darwin":
        home = env.get("HOME", "")
        if not home.startswith("/"):
            return fallback
        folder = Path(home) / "Library" / "Caches" / "moestream"
        fits = len(os.fsencode(str(folder / SOCKET_NAME))) <= max_socket_path_bytes(platform)
        return folder if fits else fallback
    xdg = env.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "moestream" if xdg else fallback


def earlier_runtime_dir(env: Mapping[str, str], platform: str | None = None) -> Path | None:
    """macOS: `/tmp/moestream-UID`, the default runtime folder of earlier versions, where
    a daemon they started may still run (a second one would load the model again); None
    where the default is that folder still, and on Linux."""
    platform = sys.platform if platform is None else platform
    old = Path("/tmp") / f"moestream-{os.getuid()}"
    if platform != "darwin" or default_runtime_dir(env, platform) == old:
        return None
    return old


# How `--help` names the runtime folder's default on each platform (the README's table
# names both).
RUNTIME_DIR_DEFAULTS = (
    ("linux", "$XDG_RUNTIME_DIR/moestream, else /tmp/moestream-UID"),
    ("darwin", "~/Library/Caches/moestream"),
)


def demo_store_path() -> Path:
    """The expert store of the built-in demo model, shipped inside the package."""
    return Path(__file__).resolve().parent.parent / "daemon" / "demo" / "store"


def names_the_demo(model: Any) -> bool:
    """Whether a --model value names the built-in demo model: `demo`, unless a folder of
    that name is here (every command's --model reads it so)."""
    return model == "demo" and not Path("demo").exists() and demo_store_path().is_dir()


def default_state_dir(env: Mapping[str, str]) -> Path:
    """The user's state folder for moestream ($XDG_STATE_HOME/moestream)."""
    base = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".local" / "state")
    return Path(base) / "moestream"


def default_config_file(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "moestream" / "config.toml"


_BOTH = (DAEMON, GENERATE)


@dataclass(frozen=True, kw_only=True)
class Settings:
    # ---- the model and its pool
    # `resolve` puts the built-in demo model here when none is given.
    model: str | None = setting(
        None,
        kind="path",
        scope=_BOTH,
        shown_default="the built-in demo model",
        help="Expert store (made by `moestreamctl pull` or `convert`), or a Hugging Face repository OWNER/NAME "
        "(`start` pulls it where it is missing); `demo`: the built-in demo model.",
    )
    capacity: float | int | None = setting(
        None,
        kind="capacity",
        scope=_BOTH,
        shown_default="every expert of each layer",
        help="Pool slots per MoE layer (16) or a fraction of each layer's experts (0.25, 25%).",
    )
    memory_budget: int | None = setting(
        None,
        kind="size",
        scope=_BOTH,
        help="Size the pool so that resident weights, pool and KV cache fit in this much memory, e.g. 24G.",
    )
    policy: str = setting(
        "lru",
        kind="choice",
        choices=POLICY_NAMES,
        noun="eviction policy",
        help="Eviction policy of the pool (`moestreamctl bench policy` compares them).",
        bench=True,
    )
    prefill: str = setting(
        "layer",
        kind="choice",
        choices=("layer", "chunk"),
        help="Prefill order: layer takes all of a prompt's chunks through one layer before the next, so a partial "
        "pool brings each routed expert in once per prompt; chunk is stock mlx-lm's order, chunk by chunk. "
        "Output is the same either way. A model whose forward layer cannot drive goes chunk by chunk (found at "
        "load; status says which).",
        bench=True,
    )
    distributed: str = setting(
        "off",
        kind="choice",
        choices=("off", "any", "ring", "jaccl", "nccl", "mpi"),
        noun="mx.distributed backend",
        scope=(DAEMON,),
        help="Expert-parallel over the processes `mlx.launch` starts (docs/scale-out.md), with this mx.distributed "
        "backend: rank 0 is the daemon and its socket, every rank streams its share of each layer's experts "
        "(e % ranks == rank) from its own store copy into its own pool; off: one process.",
    )
    distributed_launch: str | None = setting(
        None,
        kind="text",
        scope=(DAEMON,),
        shown_default="none",
        help="With `distributed`, `moestreamctl start` runs the group in the background through `mlx.launch` with "
        "these of its options (`--hosts IP0,IP1`, `--hostfile FILE`, `-n 2`, `--starting-port P`; the backend is "
        "`distributed`'s) and returns once rank 0 serves; `stop` ends every rank.",
    )
    host_cache: int = setting(
        0,
        kind="size",
        scope=_BOTH,
        shown_default="0 (off)",
        help="Host RAM that caches experts between the store and the pool, e.g. 32G; on an NVIDIA GPU one that "
        "holds every expert is made as a mapped pool where --mapped is auto.",
    )
    # Auto is mapped only where it measured fastest and is safe (daemon/model/streaming_model.py
    # `choose_mapped`): a mapped pool reads host memory in place instead of waiting on a
    # host sync per layer for copies into slots.
    mapped: bool | None = setting(
        None,
        kind="auto_bool",
        scope=_BOTH,
        help="A mapped pool: every expert in host RAM, read in place by the kernels, --capacity (or "
        "--memory-budget) of them per layer in GPU memory. Auto: mapped on an NVIDIA GPU with a partial "
        "pool, host RAM for every expert and no --host-cache smaller than every expert, else the slot pool.",
    )
    autopin_frac: float = setting(
        0.5,
        kind="float",
        low=0.0,
        high=1.0,
        scope=(DAEMON,),
        help="Share of each layer's slots pinned at start with its hottest experts of the saved heat (with a "
        "mapped pool, any share but 0 places the hottest in GPU memory).",
    )
    # The elastic pool (daemon/pool/elastic.py): where the daemon reads the machine's memory
    # pressure. Tests and benchmarks drive it through a file; a user has no reason to.
    memory_pressure: str = setting(
        "auto",
        kind="text",
        help="Where the daemon reads the machine's memory pressure, under which the pool and host tier give "
        "memory back: auto (macOS's memory-pressure level; Linux's PSI, else MemAvailable), off, or file:PATH "
        "(a level written in a file: normal, warn or critical).",
        bench=True,
    )
    # Auto because prefetch pays on some machines and pools and costs on others.
    prefetch: str = setting(
        "auto",
        kind="choice",
        choices=("on", "off", "auto"),
        help="Prefetch of predicted experts; auto measures decode both ways at the start of the run and keeps "
        "it only where it is faster.",
        bench=True,
    )
    # Each layer further ahead gives a read that takes longer than one layer's compute
    # more time, but costs a router matmul per layer, the reads of its mispredictions,
    # and prefetch buffer.
    prefetch_depth: int = setting(
        1,
        kind="int",
        low=1,
        high=4,
        help="MoE layers ahead whose predicted experts the slot pool's prefetch reads from the store (1: layer "
        "L+1's while layer L computes).",
        bench=True,
    )
    # A larger buffer also keeps experts read but not yet routed, for a later token that
    # routes them; memory the pool or a host tier would use better where they can have it.
    prefetch_buffer: int = setting(
        0,
        kind="size",
        shown_default="0 (16 x top-k experts per layer of depth)",
        help="Host memory for the slot pool's prefetch buffer (0: 16 x top-k experts per layer of depth, at "
        "most 4 x a layer's experts).",
        bench=True,
    )

    # ---- the daemon
    runtime_dir: str | None = setting(
        None,
        kind="path",
        scope=_BOTH,
        shown_default="$XDG_RUNTIME_DIR/moestream, else /tmp/moestream-UID (macOS: ~/Library/Caches/moestream)",
        shown_default_on=RUNTIME_DIR_DEFAULTS,
        help="Folder of the daemon's socket, lock, pid file and log.",
    )
    # MLX's default (/tmp/mlx) goes at each reboot and is shared by every user (shared/kernel_cache.py).
    kernel_cache_dir: str | None = setting(
        None,
        kind="path",
        scope=(DAEMON, LOCAL),
        shown_default="$XDG_CACHE_HOME/moestream/kernels",
        help="Where MLX's CUDA build keeps the kernels it compiles (MLX_PTX_CACHE_DIR, unless that is set), "
        "private to you and kept across reboots, so that a restart does not compile them again; unused on "
        "Metal and the CPU.",
    )
    log_file: str | None = setting(
        None,
        kind="path",
        scope=(DAEMON,),
        shown_default="daemon.log in the runtime folder",
        help="The daemon's log file.",
    )
    diagnostics: bool = setting(
        False,
        kind="bool",
        help="Record hot-path diagnostics (segment times, predictor recall, miss attribution) for every "
        "request (`moestreamctl stats`).",
        bench=True,
    )
    # Beside the store by default; see `heat_folder` for the stores that cannot have it there.
    heat_dir: str | None = setting(
        None,
        kind="path",
        shown_default="beside the store, or under $XDG_STATE_HOME/moestream/heat",
        help="Folder of the heat file (pool_usage.json): the routing counts that autopin reads at start.",
    )
    heat_flush_seconds: float = setting(
        5.0, kind="float", low=0.0, help="Seconds between saves of the routing counts to the heat file."
    )
    # Requests: a memory budget keeps room for a max_context cache when it sizes the pool.
    max_context: int | None = setting(
        None,
        kind="int",
        low=16,
        high=2**24,
        shown_default="the model's context, at most what the memory left for KV caches holds",
        help="Tokens per request, prompt and generated. A prompt that fills it is refused; a max_tokens past it is "
        "cut to the room left (the answer ends with finish reason length). Default: the model's own "
        "(max_position_embeddings), at most what the memory budget (else the device's memory) leaves for KV caches "
        "once the model and pool are in; status and plan say how much.",
    )
    max_active: int = setting(
        8,
        kind="int",
        low=1,
        high=1024,
        help="Requests decoded at once (a client with none running may start one past it, by at most a quarter "
        "of it, while another holds several).",
    )
    # Off (1) by default: on the H200 a batch pays on a full pool from about 4 clients, but not at 2
    # nor on a mapped pool (tests/bench/RESULTS.md, "Serving several clients").
    # Batching on by default, where it pays: the daemon lets a batch grow only while its own
    # steps measure faster a token than lone ones (daemon/model/batching.py `StepCosts`).
    max_batch: int = setting(
        0,
        kind="int",
        low=0,
        high=256,
        scope=(DAEMON,),
        shown_default="0 (auto)",
        help="Requests decoded together in one forward per step (continuous batching), each request's tokens the same "
        "as alone; 0: up to 8, while the daemon's steps measure faster a token than lone ones (else requests take "
        "turns); 1: requests always take turns.",
    )
    # Ollama's convention (keep_alive, default 5 minutes there): a daemon started at login
    # should not hold the model's memory all day for a request an hour.
    keep_alive: float = setting(
        1800.0,
        kind="duration",
        scope=_BOTH,
        help="How long the model stays loaded after the last request (30m, 10s, 1h); after that the daemon "
        "releases the model, pool, host tier and caches and loads them again for the next request. 0: after "
        "each request; -1: never.",
    )
    max_queued: int = setting(
        256,
        kind="int",
        low=0,
        high=1_000_000,
        help="Requests waiting for a turn, a quarter of them (at least one) from one client; more are refused as busy.",
    )
    max_draft_models: int = setting(
        1,
        kind="int",
        low=1,
        high=64,
        help="Draft models (speculative 'draft') kept loaded between requests; the least recently used goes first.",
        bench=True,
    )
    # Each connection holds an open file: the daemon takes at most the room its open-file
    # limit leaves, and near that limit takes no new connection at all (daemon/limits.py).
    max_connections: int = setting(
        4096,
        kind="int",
        low=1,
        high=1_000_000,
        scope=(DAEMON,),
        help="Client connections at once (at most what the open-file limit leaves: about 3,300 "
        "under a limit of 4096); a new client past them is refused as busy.",
    )

    # ---- the HTTP gateway (`serve-openai`; client/gateway/guard.py)
    gateway_origins: str | None = setting(
        None,
        kind="text",
        shown_default="none: only pages on this machine",
        help="Browser origins besides this machine's pages that may use the gateway, comma-separated "
        "(http://app.example:3000), or * for any (as OLLAMA_ORIGINS).",
    )
    gateway_read_timeout: float = setting(
        10.0,
        kind="float",
        low=0.1,
        high=3600.0,
        help="Seconds a gateway connection has to send a request's headers, and again its body.",
    )
    gateway_max_connections: int = setting(
        512,
        kind="int",
        low=2,
        high=1_000_000,
        help="Gateway connections at once, half of them from one client address (fewer where the open-file "
        "limit is lower); past it the oldest idle or half-open one is closed.",
    )
    # A chat resends its whole history each turn; the cache spares prefilling it again.
    prompt_cache_bytes: int = setting(
        2**30,
        kind="size",
        scope=(DAEMON,),
        help="Memory for the KV caches of recent requests, reused by a later prompt that starts the same way "
        "(0: off); reserved out of --memory-budget.",
    )
    prompt_cache_entries: int = setting(
        16,
        kind="int",
        low=0,
        high=100_000,
        help="Most requests' caches kept in memory.",
        bench=True,
    )
    prompt_cache_dir: str | None = setting(
        None,
        kind="path",
        scope=(DAEMON,),
        shown_default="none (memory only)",
        help="Folder where finished requests' caches are also written, found again after a restart.",
    )
    prompt_cache_disk_bytes: int = setting(
        8 * 2**30,
        kind="size",
        help="Most bytes of cache files in --prompt-cache-dir; the oldest are removed first.",
        bench=True,
    )
    # An agent's session resends a long history every turn: written whole each time, a
    # drive would see hundreds of GB a day. 16 GiB a day is 5% of what a 1 TB drive rated
    # for 600 TB written over five years can take a day (330 GB).
    prompt_cache_write_budget: int = setting(
        16 * 2**30,
        kind="size",
        help="Most bytes of cache files written to --prompt-cache-dir a day; past it, caches stay in memory.",
        bench=True,
    )

    # ---- reading the store
    io_threads: int = setting(4, kind="int", low=1, high=256, scope=_BOTH, help="Threads of the native read engine.")
    direct_io: bool = setting(
        True,
        kind="bool",
        help="Read the store around the page cache (O_DIRECT on Linux, F_NOCACHE on macOS).",
        bench=True,
    )
    verify_checksums: bool = setting(
        False,
        kind="bool",
        help="Check each expert's checksum as it is read.",
        bench=True,
    )

    # ---- the CUDA copier
    # A cudaMemcpyAsync per tensor of each expert costs microseconds of host time apiece
    # on the path the GPU waits on; the kernel queues a layer's copies in a fraction of that.
    copy_kernel: bool = setting(
        True,
        kind="bool",
        help="Copy from the pinned host tier into pool rows with one copy-kernel launch per 160 spans instead "
        "of one cudaMemcpyAsync per tensor; a driver that refuses the kernel falls back to cudaMemcpyAsync.",
        bench=True,
    )
    # 64, as for copies the GPU waits on, fills the link alone but may crowd out the
    # kernels a copy ahead of use runs beside (tests/bench/gpu_background_copy_probe.py).
    prefetch_copy_blocks: int = setting(
        64,
        kind="int",
        low=1,
        high=1024,
        help="Most blocks per span of the copy kernel when the slot pool's prefetch copies ahead of use; "
        "fewer leave the kernels they run beside more room.",
        bench=True,
    )

    # ---- the mapped pool (daemon/mapped/mapped_pool.py)
    # Instead of a placement that a first start without heat would keep for good.
    mapped_rebalance_tokens: int = setting(
        256,
        kind="int",
        low=0,
        high=2**31,
        help="Every this many tokens routed, a mapped pool sets each layer's GPU share to its most routed "
        "experts so far (the first intervals shorter: 32, 64, 128); 0: never.",
        bench=True,
    )
    # Off on unified memory, where there is no link to wait on.
    mapped_gather: bool | None = setting(
        None,
        kind="auto_bool",
        help="A mapped pool's decode steps first copy the routed experts into a small stack in GPU memory "
        "(daemon/mapped/row_gather.py) instead of reading host memory over the link. Auto: on where that "
        "copy kernel runs (MLX's CUDA build).",
        bench=True,
    )
    # A mapped pool's layer-major prefill copies each layer's experts into a stack; the
    # copy needs no routing, so it can run beside the layer below. A few blocks per row
    # keep the link busy and leave that layer's kernels most of the GPU
    # (tests/bench/gpu_background_copy_probe.py).
    mapped_stage_ahead_blocks: int = setting(
        4,
        kind="int",
        low=0,
        high=1024,
        help="In a mapped pool's layer-major prefill, copy each layer's experts into GPU memory while the "
        "layer below computes, with at most this many blocks per expert of the copy kernel; 0: each layer "
        "copies its own before it computes.",
        bench=True,
    )

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
        for d in SETTINGS:
            if d.env in env:
                values[d.name], where[d.name] = env[d.env], f"environment variable {d.env}"
        for d in BENCH_KNOBS:
            # Set by an earlier version's user: said, not dropped in silence.
            if d.env in env:
                gone = f"environment variable {d.env}: unknown setting {d.name!r} (a benchmark's option now)"
                if problems is None:
                    raise SettingsError(gone)
                problems.append(f"{gone}; ignored")
        for name, value in (flags or {}).items():
            if value is not None:
                values[name] = value
                where.pop(name, None)
        if (values.get("model") is None and demo_store_path().is_dir()) or names_the_demo(values.get("model")):
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
        out: dict[str, Any] = {}
        for name, raw in values.items():
            source = f"{where[name]}: " if where and name in where else ""
            try:
                out[name] = _coerce(name, raw)
            except SettingsError as e:
                raise SettingsError(f"{source}{e}") from None
        return cls(**out)

    def replace(self, **changes: Any) -> "Settings":
        """These settings or bench knobs changed, checked as the user's would be."""
        return dataclasses.replace(self, **{k: _coerce(k, v, knobs=True) for k, v in changes.items()})

    def flag_values(self) -> dict[str, Any]:
        """Every setting, as its flag reads it back (None: not set; auto for an auto_bool's
        None): what the daemon's `status` reports, and `restart` passes back."""
        return {d.name: d.flag_value(getattr(self, d.name)) for d in SETTINGS}

    def heat_folder(self, store: str | os.PathLike, env: Mapping[str, str] | None = None) -> Path:
        """Where the heat of `store` is kept: `heat_dir` when set; else beside the store,
        except for the built-in demo store or a store folder this user cannot write or does
        not own, whose heat goes to a folder of their own under the state folder (never into
        the installed package, nor into another user's folder, even as root), named by the
        store's id: a reinstalled demo, or another copy of one store, keeps one heat."""
        if self.heat_dir:
            return Path(self.heat_dir)
        # Spelled as on disk: on a case-insensitive filesystem ~/Models/X and ~/models/x
        # are one store, whose heat must be one folder.
        folder = canonical_folder(store)
        key = _store_key(folder)
        # The demo by its id too: an installed copy of it lies inside a package.
        demo = same_folder(folder, demo_store_path()) or key == _store_key(demo_store_path())
        if not demo and os.access(folder, os.W_OK) and _owned_by_me(folder):
            return folder
        return default_state_dir(os.environ if env is None else env) / "heat" / f"store-{key}"

    def runtime_path(self, env: Mapping[str, str] | None = None) -> Path:
        if self.runtime_dir:
            return Path(self.runtime_dir)
        return default_runtime_dir(os.environ if env is None else env)


def _store_key(folder: Path) -> str:
    """The store's id (a store is known by it); a hash of its path when its manifest
    cannot be read (the load then says why)."""
    try:
        return load_manifest(folder).store_id
    except (StoreError, OSError, ValueError):
        return hashlib.sha256(str(folder).encode()).hexdigest()[:12]


def _owned_by_me(folder: Path) -> bool:
    try:
        return folder.stat().st_uid == os.geteuid()
    except OSError:
        return False


# Every definition, in the order of the fields (the order of --help and of the README's
# table); SETTINGS are the user's, BENCH_KNOBS the experiments'. Tuples and read-only
# mappings: nothing here changes after import.
_ALL = tuple(dataclasses.replace(f.metadata["setting"], name=f.name) for f in fields(Settings))
SETTINGS: tuple[Definition, ...] = tuple(d for d in _ALL if not d.bench)
BENCH_KNOBS: tuple[Definition, ...] = tuple(d for d in _ALL if d.bench)
_BY_NAME = types.MappingProxyType({d.name: d for d in SETTINGS})
_KNOB_BY_NAME = types.MappingProxyType({d.name: d for d in BENCH_KNOBS})


def definition(name: str) -> Definition:
    """The definition of setting `name`; SettingsError, with a close name, for one that is none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        close = difflib.get_close_matches(name, _BY_NAME, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (settings: {', '.join(_BY_NAME)})"
        raise SettingsError(f"unknown setting {name!r}{hint}") from None


def knob(name: str) -> Definition:
    """The definition of bench knob `name` (KeyError for one that is none: a bug of the bench)."""
    return _KNOB_BY_NAME[name]


def in_scope(*scopes: str) -> tuple[Definition, ...]:
    """The settings that the commands of any of `scopes` take as options, in field order."""
    return tuple(d for d in SETTINGS if d.scope & set(scopes))


def _coerce(name: str, raw: Any, *, knobs: bool = False) -> Any:
    d = _KNOB_BY_NAME.get(name) if knobs else None
    d = d or definition(name)
    try:
        return d.coerce(raw)
    except SettingsError as e:
        raise SettingsError(f"{name}: {e}") from None


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


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_table_markdown() -> str:
    """The README's table of every setting, made from the definitions."""
    rows = ["| setting | flag | environment variable | default | what it does |", "| --- | --- | --- | --- | --- |"]
    for d in SETTINGS:
        commands = d.commands()
        flag = f"`{d.switch}` ({', '.join(commands)})" if commands else "-"
        rows.append(f"| `{d.name}` | {_cell(flag)} | `{d.env}` | {_cell(d.default_text())} | {_cell(d.help)} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m moestream.shared.settings", description="moestream's settings.")
    parser.add_argument("--markdown", action="store_true", help="Print the README's settings table.")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(settings_table_markdown())
    else:
        for d in SETTINGS:
            print(f"{d.name} = {d.default_text()}  ({d.env})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
