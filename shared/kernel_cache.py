"""Where MLX's CUDA build keeps the kernels it compiles.

MLX's CUDA backend compiles many of its kernels (NVRTC) the first time it meets them and
keeps them in `MLX_PTX_CACHE_DIR`, by default `/tmp/mlx/<version>/ptx`. That default
goes at each reboot, and the first requests then compile again: on the H200 a fresh
machine's first request took 146 s, and one fused kernel 3.7 s where a second process
found it in the cache in 0.09 s (tests/bench/RESULTS.md, "Where a level's wall goes,
and what a joiner costs"). It is also one folder for every user of the machine: whoever
makes it first owns it, so another user's daemon cannot keep its kernels there, or runs
kernels that user left there.

So moestream's processes point MLX at a folder of the user's own (mode 0700, checked
as the runtime folder is), one per MLX version (the cache finds a kernel by its name,
which need not change when another MLX version changes its code), unless the
environment names one already. Metal and the CPU do not use it. Imports no MLX: it
only sets the variable, and its callers (the daemon's `main`, `generate --local`) call
it before anything in their process imports MLX.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Callable, Mapping, MutableMapping

from .runtime_dir import ensure_private_dir

ENV = "MLX_PTX_CACHE_DIR"


class KernelCacheError(RuntimeError):
    """The kernel cache folder cannot be used; the message says why and what to do."""


def default_kernel_cache_dir(env: Mapping[str, str]) -> Path:
    """`$XDG_CACHE_HOME/moestream/kernels` (else ~/.cache/moestream/kernels)."""
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".cache")
    return Path(base) / "moestream" / "kernels"


def _mlx_version() -> str:
    try:
        return metadata.version("mlx")
    except metadata.PackageNotFoundError:
        return "unknown"


class _CannotCreate(KernelCacheError):
    """The folder cannot be made (a read-only or missing home, no permission)."""


def _private_folder(folder: Path) -> None:
    ensure_private_dir(
        folder,
        what="kernel cache folder",
        option="--kernel-cache-dir / MOESTREAM_KERNEL_CACHE_DIR",
        error=KernelCacheError,
        cannot_create=_CannotCreate,
    )


def use_kernel_cache(
    folder: str | Path | None, env: MutableMapping[str, str], warn: Callable[[str], None]
) -> Path | None:
    """Point MLX's kernel cache at `<folder or the default>/mlx-<version>` in `env` (the
    process's own environment, before MLX compiles a kernel); the folder used, or None
    where `env` names one already (the user's choice stands) or where the default folder
    cannot be made (`warn` says so, and MLX keeps its own default: a cache is not worth
    refusing to start for). A folder given that cannot be made, or any folder that is not
    private to the user, raises `KernelCacheError`."""
    if env.get(ENV):
        return None
    base = Path(folder) if folder else default_kernel_cache_dir(env)
    versioned = base / f"mlx-{_mlx_version()}"
    try:
        _private_folder(base)
        _private_folder(versioned)
    except _CannotCreate as e:
        if folder:
            raise
        warn(f"{e}; MLX keeps its compiled kernels in its own default folder (--kernel-cache-dir chooses one)")
        return None
    env[ENV] = str(versioned)
    return versioned
