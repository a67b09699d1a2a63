"""Store faults under a running daemon: an expert file that returns EIO, a truncated
expert file, a checksum mismatch, and the whole store deleted. Each failing request gets
an `engine` error naming the layer and the expert; the daemon then serves the next
request exactly.

EIO comes from a shim (eio_shim.c, compiled here with the system C compiler) that makes
pread on one named file fail while a gate file exists: loaded with LD_PRELOAD on Linux,
and on macOS with DYLD_INSERT_LIBRARIES through dyld's interposing (`shim_plan` says how
per platform). It was chosen over a device-mapper `error` target, which needs
/dev/mapper and the dm kernel module (absent in this container), and over FUSE, which
needs a FUSE daemon; the shim works wherever the native engine calls libc's pread as an
imported symbol (checked below with nm) and a C compiler is installed. On macOS the test
checks the same: the engine imports `_pread` (`nm -u`), the interposed pread fails with
EIO, the request fails naming layer and expert, and the daemon serves on.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from moestream.client.client import Client, RequestRejected
from moestream.shared import protocol as proto
from moestream.shared.store_format import load_manifest

from .conftest import CASES

# A prompt routed through most experts of every layer: its first token misses in a
# fresh pool, so a broken expert file is read at once.
WIDE_PROMPT_IDS = list(range(3, 90))


def _exact(client: Client, reference, case=CASES[0]) -> None:
    result = client.complete(case[0], max_tokens=case[1])
    assert tuple(result.tokens) == reference[case].tokens
    assert result.text == reference[case].text


def _failing_request(client: Client) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        client.complete(prompt_ids=WIDE_PROMPT_IDS, max_tokens=4)
    return info.value


@dataclass(frozen=True)
class ShimPlan:
    """How the EIO shim is built and loaded on one platform."""

    nm: tuple[str, ...]  # lists the undefined (imported) symbols of a shared library
    imported: re.Pattern  # how `nm` shows an imported pread
    cc_flags: tuple[str, ...]
    suffix: str
    preload: str  # the environment variable the loader reads


def shim_plan(platform: str) -> ShimPlan:
    if platform == "darwin":
        # Mach-O: symbols carry a leading underscore; dyld reads DYLD_INSERT_LIBRARIES.
        return ShimPlan(
            nm=("nm", "-u"),
            imported=re.compile(r"^_pread$", re.M),
            cc_flags=("-dynamiclib",),
            suffix=".dylib",
            preload="DYLD_INSERT_LIBRARIES",
        )
    return ShimPlan(
        nm=("nm", "-D"),
        imported=re.compile(r" U pread(64)?\b"),
        cc_flags=("-shared", "-fPIC", "-ldl"),
        suffix=".so",
        preload="LD_PRELOAD",
    )


PLAN = shim_plan(sys.platform)


@pytest.fixture(scope="module")
def eio_shim(tmp_path_factory) -> Path:
    import moestream._native as native

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the EIO shim")
    if sys.platform == "darwin" and os.path.realpath(sys.executable).startswith(("/usr/bin/", "/System/")):
        pytest.skip("System Integrity Protection strips DYLD_INSERT_LIBRARIES for the system's Python")
    symbols = subprocess.run([*PLAN.nm, native.__file__], capture_output=True, text=True).stdout
    assert PLAN.imported.search(symbols), "the native engine no longer calls libc pread: the shim cannot interpose"
    out = tmp_path_factory.mktemp("shim") / f"eio_shim{PLAN.suffix}"
    source = str(Path(__file__).with_name("eio_shim.c"))
    subprocess.run([cc, "-O2", "-o", str(out), source, *PLAN.cc_flags], check=True)
    return out


def test_eio_on_an_expert_file_fails_the_request_naming_layer_and_expert(
    eio_shim, store_copy, start_daemon, workdir, rel_reference
):
    layer = load_manifest(store_copy).layers[1]
    gate = workdir / "eio-on"
    gate.touch()
    env = {PLAN.preload: str(eio_shim), "MS_EIO_PATH": str(store_copy / layer.file), "MS_EIO_GATE": str(gate)}
    daemon = start_daemon(store_copy, env=env)
    with Client(daemon.paths, timeout=30) as c:
        err = _failing_request(c)
        assert err.code == proto.ENGINE
        assert f"of layer {layer.ordinal}" in err.message and "expert" in err.message
        assert "Input/output error" in err.message and layer.file in err.message
        # The same again: still a clear error, the daemon is still there.
        assert _failing_request(c).code == proto.ENGINE
        gate.unlink()  # the "disk" recovers
        _exact(c, rel_reference)
        assert c.ping().pid == daemon.pid
        assert c.status().requests.failed == 2


def test_a_store_truncated_before_start_fails_then_serves_once_repaired(store_copy, start_daemon, rel_reference):
    """Regression: the engine keeps the size it saw at open, so a file repaired in place
    kept failing as truncated until a restart; now it is reopened when it has grown."""
    layer = load_manifest(store_copy).layers[0]
    path = store_copy / layer.file
    original = path.read_bytes()
    with open(path, "r+b") as f:
        f.truncate(layer.experts[2].offset)  # experts 2.. of layer 0 are gone
    daemon = start_daemon(store_copy)
    with Client(daemon.paths, timeout=30) as c:
        err = _failing_request(c)
        assert err.code == proto.ENGINE
        assert f"of layer {layer.ordinal}" in err.message and "expert" in err.message and "truncated" in err.message
        with open(path, "r+b") as f:  # repaired in place
            f.write(original)
        _exact(c, rel_reference)
        _exact(c, rel_reference, CASES[3])


def test_a_checksum_mismatch_is_caught_when_checksums_are_verified(store_copy, start_daemon, rel_reference):
    layer = load_manifest(store_copy).layers[0]
    path = store_copy / layer.file
    daemon = start_daemon(store_copy, knobs={"verify_checksums": True})
    flips = [layer.experts[e].offset + layer.experts[e].length // 2 for e in range(len(layer.experts))]
    data = path.read_bytes()
    original = {at: data[at : at + 1] for at in flips}
    with open(path, "r+b") as f:  # one byte flipped in every expert of layer 0
        for at, byte in original.items():
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    with Client(daemon.paths, timeout=30) as c:
        err = _failing_request(c)
        assert err.code == proto.ENGINE
        assert f"of layer {layer.ordinal}" in err.message and "expert" in err.message
        assert "checksum" in err.message.lower() or "crc" in err.message.lower()
        with open(path, "r+b") as f:
            for at, byte in original.items():
                f.seek(at)
                f.write(byte)
        _exact(c, rel_reference)


def test_an_expert_file_written_over_in_place_is_refused_not_served_wrong(store_copy, start_daemon, rel_reference):
    """A layer file written over in place (same size) after the daemon opened it: its reads
    are refused, naming the file, the expert and what to do, without checksums (they were
    served, the answer silently wrong); put back, it is served exactly again."""
    layer = load_manifest(store_copy).layers[0]
    path = store_copy / layer.file
    daemon = start_daemon(store_copy)
    with Client(daemon.paths, timeout=30) as c:
        _exact(c, rel_reference)
        original = path.read_bytes()
        data = bytearray(original)
        for x in layer.experts:
            data[x.offset + x.length // 2] ^= 0xFF
        with open(path, "r+b") as f:  # one byte of every expert of layer 0, in place
            f.write(data)
        err = _failing_request(c)
        assert err.code == proto.ENGINE
        assert str(path) in err.message and "changed on disk after the daemon opened it" in err.message
        assert "expert 0 no longer matches its checksum" in err.message and "put the store's file back" in err.message
        assert _failing_request(c).code == proto.ENGINE  # still, until it is put back
        with open(path, "r+b") as f:
            f.write(original)
        _exact(c, rel_reference)
        _exact(c, rel_reference, CASES[3])
        assert c.ping().pid == daemon.pid


def _remove_while_written(folder: Path) -> None:
    """Delete a folder the heat keeper is writing into: its temporary files for an atomic
    save can appear and vanish between rmtree's listing and its unlink, so retry until the
    folder is gone (once it is, the keeper can no longer create anything in it)."""
    deadline = time.monotonic() + 10
    while folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
        assert time.monotonic() < deadline, f"could not remove {folder}"


def test_a_store_deleted_under_a_running_daemon(store_copy, start_daemon, rel_reference):
    """What happens: the daemon keeps serving exactly from the descriptors it holds open
    (Linux keeps unlinked files readable); the heat keeper cannot write pool_usage.json
    into the vanished folder and says so in status; the daemon still stops cleanly, and
    a new start on the missing store is refused with a clear message."""
    daemon = start_daemon(store_copy, env={"MOESTREAM_HEAT_FLUSH_SECONDS": "0.1"})
    with Client(daemon.paths, timeout=30) as c:
        _exact(c, rel_reference)
        _remove_while_written(store_copy)
        _exact(c, rel_reference, CASES[5])
        _exact(c, rel_reference, CASES[2])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            heat = c.status().heat
            if heat.get("last_flush_ok") is False:
                break
            time.sleep(0.1)
        assert heat["last_flush_ok"] is False
        assert "No such file or directory" in heat["last_error"] and str(store_copy) in heat["last_error"]
        assert c.ping().pid == daemon.pid
    assert daemon.stop() == 0
    with pytest.raises(RuntimeError, match="exited with status") as info:
        start_daemon(store_copy, name="rt2")
    assert "cannot load the model" in str(info.value) and str(store_copy) in str(info.value)
