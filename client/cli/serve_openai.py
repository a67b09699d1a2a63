"""`moestreamctl serve-openai`: the OpenAI-compatible HTTP gateway to the daemon."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import stat
from pathlib import Path

import click

from ...shared.runtime_dir import RuntimeDirError, RuntimePaths
from ...shared.settings import Settings, SettingsError
from ...shared.small_file import NotARegularFile, read_small_file
from .values import runtime_dir_option

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
# A key file holds one line; anything larger is not one.
MAX_KEY_FILE_BYTES = 4096
MIN_KEY_CHARS = 16


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def read_api_key(api_key: str | None, api_key_file: str | None, host: str = DEFAULT_HOST) -> str | None:
    """The key from --api-key or the first line of --api-key-file (None: no key). A key
    that guards more than loopback must be one nobody guesses: MIN_KEY_CHARS at least."""
    if api_key is not None and api_key_file is not None:
        raise click.UsageError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        path = Path(api_key_file).expanduser()
        try:
            # Not blocking on a FIFO, nor reading /dev/zero until memory runs out.
            text = read_small_file(path, MAX_KEY_FILE_BYTES, follow_links=True).decode("utf-8")
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError, NotARegularFile) as e:
            raise click.UsageError(f"--api-key-file: cannot read {path}: {e}") from None
        if stat.S_IMODE(mode) & 0o077:
            click.echo(f"warning: {path} can be read by other users; `chmod 600 {path}`", err=True)
        lines = text.strip().splitlines()
        api_key = lines[0].strip() if lines else ""
        if not api_key:
            raise click.UsageError(f"--api-key-file: {path} is empty")
    elif api_key is not None and not api_key.strip():
        raise click.UsageError("--api-key is empty")
    key = api_key.strip() if api_key is not None else None
    if key is not None and len(key) < MIN_KEY_CHARS and not is_loopback(host):
        raise click.UsageError(
            f"--host {host} accepts connections from other machines: its API key must have at least {MIN_KEY_CHARS} "
            f"characters (this one has {len(key)}; e.g. `openssl rand -hex 24 > key.txt`)"
        )
    return key


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        hint = "; another server uses this port: pick another with --port" if e.errno == errno.EADDRINUSE else ""
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


@click.command("serve-openai")
@click.option(
    "--host",
    default=DEFAULT_HOST,
    show_default=True,
    help="Address to listen on; anything but loopback needs an API key.",
)
@click.option(
    "--port",
    default=DEFAULT_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="TCP port (0: any free port).",
)
@click.option(
    "--api-key", help="Clients must send `Authorization: Bearer KEY` (visible in `ps`: prefer --api-key-file)."
)
@click.option("--api-key-file", type=click.Path(dir_okay=False), help="File whose first line is the API key.")
# What is cached tells what was sent: a client that finds a prefix cached (its
# cached_tokens, or a quicker first token) learns that someone sent it.
@click.option(
    "--share-prompt-cache",
    is_flag=True,
    help="Let every client reuse every other's cached prompts; by default only those of requests that name the same "
    "user or session (Claude Code's metadata.user_id, Codex's prompt_cache_key, OpenAI's user), or that name none "
    "and come from the same address.",
)
@runtime_dir_option
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
)
def serve_openai(host, port, api_key, api_key_file, share_prompt_cache, runtime_dir, log_level) -> None:
    """Serve the daemon over HTTP: the OpenAI API (/v1: chat, completions, models), the
    Anthropic Messages API (/v1/messages), Ollama's API (/api) and a live dashboard (/).

    A thin client of the running daemon: it translates HTTP into the daemon's protocol,
    so every app shares the daemon's warm pool. It does not start the daemon: /health
    answers 503 until one runs (`moestreamctl start`, or `service install`).
    """
    key = read_api_key(api_key, api_key_file, host)
    if key is None and not is_loopback(host):
        raise click.UsageError(
            f"--host {host} accepts connections from other machines: give --api-key-file FILE (or --api-key KEY), "
            f"or listen on loopback (--host {DEFAULT_HOST})"
        )
    try:
        settings = Settings.resolve({"runtime_dir": runtime_dir})
        paths = RuntimePaths.from_settings(settings)
        paths.check_socket_path()
    except (SettingsError, RuntimeDirError) as e:
        raise click.UsageError(str(e)) from None

    import logging

    import uvicorn

    # uvicorn configures its own loggers only; this shows the gateway's (moestream.openai).
    logging.basicConfig(level=log_level.upper(), format="%(levelname)-9s %(name)s: %(message)s")

    from ..gateway.app import GatewayConfig, create_app
    from ..gateway.guard import ConnectionGuard, GuardConfig, limit_log_rate, raise_file_limit

    raise_file_limit()  # each connection is an open file
    guard = GuardConfig.from_settings(settings, host)
    sock = bind(host, port)
    actual = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{actual}"
    click.echo(
        f"moestream gateway: OpenAI API on {base}/v1 (Anthropic {base}/v1/messages, Ollama {base}/api, "
        f"dashboard {base}/; daemon runtime folder {paths.dir}; API key {'required' if key else 'not required'}; "
        f"pid {os.getpid()})",
        err=True,
    )
    app = create_app(GatewayConfig(paths=paths, api_key=key, cache_shared=share_prompt_cache), guard)
    config = uvicorn.Config(
        app,
        http=ConnectionGuard(guard).protocol_class(),
        host=host,
        port=actual,
        log_level=log_level,
        # The dashboard's history is sampled for as long as the app's lifespan runs.
        lifespan="on",
        server_header=False,
        # Streams still open after this many seconds of a shutdown are cancelled, and with
        # them their daemon requests.
        timeout_graceful_shutdown=5,
    )
    limit_log_rate()  # after uvicorn.Config has set up its loggers
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
