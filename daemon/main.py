"""The daemon process: `python -m moestream.daemon.main [flags]`.

`moestreamctl start` runs this detached (or in-process with `--foreground`). Order
matters: the single-instance lock is taken before the socket is bound, and released
only after every socket is closed.
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import sys
from typing import TYPE_CHECKING, Any, Mapping

from .. import __version__
from ..shared.kernel_cache import KernelCacheError, use_kernel_cache
from ..shared.log_rate import RateLimitFilter
from ..shared.runtime_dir import InstanceLock, RuntimeDirError, RuntimePaths
from ..shared.settings import SETTINGS, Settings, SettingsError

if TYPE_CHECKING:
    from .model.expert_parallel import ExpertShare

LOG_ROTATE_BYTES = 16 * 2**20
LOG_LINES_PER_WINDOW = 200
LOG_WINDOW_SECONDS = 10.0
LOG_FORMAT = "%(asctime)s %(levelname)s [%(threadName)s] %(message)s"

# Flags of `python -m moestream.daemon.main`: every setting, `--name VALUE` (a bool's as
# true/false/auto), so that `moestreamctl start` and `restart` can pass any of them on.
DAEMON_FLAGS = tuple(d.name for d in SETTINGS)


def open_log(paths: RuntimePaths, *, to_stderr: bool, rotate_bytes: int = LOG_ROTATE_BYTES) -> logging.Logger:
    """The daemon's logger: its log file, rotated to `<log>.1` whenever it would pass
    `rotate_bytes` (a daemon under launchd or systemd runs for weeks), and stderr too
    when asked (in the foreground under systemd, whose journal rotates its own copy)."""
    paths.log.parent.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(f"moestream.daemon.{os.getpid()}")
    log.setLevel(logging.INFO)
    log.propagate = False
    handlers: list[logging.Handler] = [
        logging.handlers.RotatingFileHandler(paths.log, maxBytes=rotate_bytes, backupCount=1, encoding="utf-8")
    ]
    if to_stderr:
        handlers.append(logging.StreamHandler(sys.stderr))
    # Generous for a daemon's own lines; it stops one client's junk from filling the disk.
    rate = RateLimitFilter(LOG_LINES_PER_WINDOW, LOG_WINDOW_SECONDS)
    for h in handlers:
        h.setFormatter(logging.Formatter(LOG_FORMAT))
        h.addFilter(rate)
        log.addHandler(h)
    return log


def close_log(log: logging.Logger) -> None:
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()


def run_daemon(
    settings: Settings, *, log_to_stderr: bool = False, handle_signals: bool = True, share: ExpertShare | None = None
) -> int:
    """Serve until shutdown; returns the exit code (0 after a clean stop). `share`: rank
    0's share of an expert-parallel group (`--distributed`), whose other ranks follow."""
    from .limits import FileLimit
    from .server import Server

    file_limit = FileLimit.at_start()
    file_limit.raise_soft()
    paths = RuntimePaths.from_settings(settings)
    # Everything the daemon creates (socket, pid file, log) is private to the user.
    os.umask(0o077)
    endpoint = paths.endpoint  # refuses a socket path the OS cannot bind, before anything starts
    # The lock comes before the log: a refused second daemon must not rotate the log
    # of the running one.
    lock = InstanceLock.acquire(paths)
    try:
        log = open_log(paths, to_stderr=log_to_stderr)
    except OSError as e:
        lock.release()
        raise RuntimeDirError(f"cannot open the log file {paths.log}: {e.strerror}") from e
    try:
        if lock.removed:
            log.warning(
                "a daemon (pid %s) did not shut down cleanly; removed its %s",
                lock.stale_pid,
                ", ".join(p.name for p in lock.removed),
            )
        log.info(
            "moestream daemon %s starting (pid %d, socket %s, log %s)", __version__, os.getpid(), endpoint, paths.log
        )
        return Server(settings, paths, log, handle_signals=handle_signals, file_limit=file_limit, share=share).run()
    except Exception:
        log.exception("the daemon failed")
        return 1
    finally:
        lock.release()
        log.info("pid file and socket removed; lock released")
        close_log(log)


def run_follower(settings: Settings, share: ExpertShare) -> int:
    """A rank other than 0 of an expert-parallel daemon: no socket, lock or log file of its
    own (on one machine they would be rank 0's); it logs to stderr, which `mlx.launch`
    forwards with the rank's other output."""
    from .expert_worker import serve_share

    log = logging.getLogger(f"moestream.worker.{os.getpid()}")
    log.setLevel(logging.INFO)
    log.propagate = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    log.addHandler(handler)
    from ..shared.store_format import StoreError

    try:
        return serve_share(settings, share, log)
    except StoreError as e:  # a store this rank cannot serve (another rank's shard, say): the reason is enough
        log.error("rank %d cannot load its share: %s", share.rank, e)
        return 1
    except Exception:
        log.exception("rank %d failed", share.rank)
        return 1
    finally:
        close_log(log)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moestream.daemon.main", description="The moestream daemon (see `moestreamctl start`)."
    )
    for d in SETTINGS:
        # argparse %-formats help texts.
        p.add_argument(d.flag, dest=d.name, default=None, metavar="VALUE", help=d.help.replace("%", "%%"))
    p.add_argument("--config", default=None, help="Config file (default $XDG_CONFIG_HOME/moestream/config.toml).")
    p.add_argument("--log-to-stderr", action="store_true", help="Also log to stderr.")
    return p


def main(argv: list[str] | None = None, knobs: Mapping[str, Any] | None = None) -> int:
    """`knobs`: bench knobs (shared/settings.py `Definition.bench`) for a benchmark's or a
    test's daemon; they have no flags, so only code that runs this function sets them."""
    args = build_parser().parse_args(argv)
    flags = {name: getattr(args, name) for name in DAEMON_FLAGS}
    try:
        settings = Settings.resolve(flags, config_file=args.config).replace(**(knobs or {}))
    except SettingsError as e:
        print(f"moestream daemon: {e}", file=sys.stderr)
        return 2
    try:
        # Before MLX compiles its first kernel (in a group's join already).
        use_kernel_cache(
            settings.kernel_cache_dir,
            os.environ,
            lambda why: print(f"moestream daemon: warning: {why}", file=sys.stderr),
        )
    except KernelCacheError as e:
        print(f"moestream daemon: {e}", file=sys.stderr)
        return 1
    share = None
    if settings.distributed != "off":
        from .model.expert_parallel import join_group

        share = join_group(settings.distributed, mode="leader")
        if share is not None and share.mode == "follower":
            return run_follower(settings, share)
    try:
        return run_daemon(settings, log_to_stderr=args.log_to_stderr, share=share)
    except RuntimeDirError as e:
        print(f"moestream daemon: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
