"""The native read engine (`moestream._native`) on real files.

Every read is compared with the bytes Python reads from the same file. Direct I/O is
exercised where the test folder's filesystem takes O_DIRECT, and the buffered fallback
on a filesystem that refuses it (tmpfs on older kernels, else a ramfs mounted in a
private user+mount namespace); the statistics must say which happened.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from synthetic_store import QWEN3_30B_A3B_4BIT_TENSORS, expert_block, make_synthetic_store, tensor_bytes, tensor_spec

from moestream._native import DIRECT_ALIGN, ReadEngine, crc32
from moestream.shared.store_format import Manifest

MX_DTYPES = {"uint32": mx.uint32, "float16": mx.float16, "bfloat16": mx.bfloat16, "uint8": mx.uint8}


# macOS's fcntl command that turns the page cache off for one file (sys/fcntl.h).
F_NOCACHE = getattr(fcntl, "F_NOCACHE", 48)


def direct_io_works(folder: Path) -> bool:
    """Whether the engine's direct reads work in this folder, probed with plain Python,
    independently of the engine. Linux: the filesystem accepts O_DIRECT opens and reads.
    macOS, whose `os` has no O_DIRECT: the engine reads uncached through
    fcntl(F_NOCACHE) and reports that as direct, so there the probe is that fcntl, which
    the tests then expect the engine to report as direct."""
    probe = folder / ".direct_probe"
    probe.write_bytes(b"\0" * DIRECT_ALIGN)
    if sys.platform == "darwin":
        fd = os.open(probe, os.O_RDONLY)
        try:
            fcntl.fcntl(fd, F_NOCACHE, 1)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        buf = mmap.mmap(-1, DIRECT_ALIGN)
        try:
            os.preadv(fd, [buf], 0)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        return True
    finally:
        os.close(fd)
        probe.unlink()


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, Manifest]:
    path = tmp_path / "store"
    return path, make_synthetic_store(path, layers=2, experts=8, seed=1)


def open_layers(eng: ReadEngine, path: Path, manifest: Manifest) -> list[int]:
    return [eng.open(str(path / layer.file)) for layer in manifest.layers]


def read_all_experts(eng: ReadEngine, path: Path, manifest: Manifest) -> None:
    """Read every expert into its own bytearray, verified, and compare with the file."""
    fids = open_layers(eng, path, manifest)
    dests = {}
    batch = []
    for li, layer in enumerate(manifest.layers):
        for e, entry in enumerate(layer.experts):
            dests[li, e] = bytearray(entry.length)
            batch.append((fids[li], entry.offset, entry.length, [(dests[li, e], 0, 0, entry.length)], entry.crc32))
    ids = eng.submit_batch(batch)
    done = eng.wait(ids)
    assert [c.id for c in done] == ids
    assert all(c.ok for c in done), [c.error for c in done if not c.ok]
    assert all(c.nbytes == manifest.layers[0].expert_bytes for c in done)
    for (li, e), dest in dests.items():
        assert bytes(dest) == expert_block(path, li, e), f"layer {li} expert {e}"


# ---- crc32 -----------------------------------------------------------------------------


def test_crc32_equals_zlib() -> None:
    rng = random.Random(0)
    blob = rng.randbytes(1 << 20)
    for n in (0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096, 300_000, 1 << 20):
        for start in (0, 1, 3, 8):
            view = memoryview(blob)[start : start + n]
            for value in (0, 1, 0xFFFFFFFF, 0x12345678):
                assert crc32(view, value) == zlib.crc32(view, value), (n, start, value)
    arr = np.frombuffer(blob, dtype=np.uint32).reshape(256, -1)
    assert crc32(arr) == zlib.crc32(blob)
    assert crc32(bytearray(blob[:100])) == zlib.crc32(blob[:100])
    # Chaining, as over several pieces of one block.
    assert crc32(blob[500:], crc32(blob[:500])) == zlib.crc32(blob)
    with pytest.raises(ValueError):
        crc32(arr[:, ::2])
    with pytest.raises(ValueError):
        crc32(b"x", 1 << 32)


# ---- direct reads and the buffered fallback ---------------------------------------------


@pytest.mark.parametrize("preset,huge_pages", [("small", True), ("qwen3-expert", True), ("qwen3-expert", False)])
def test_every_expert_reads_back_exactly(tmp_path: Path, preset: str, huge_pages: bool) -> None:
    path = tmp_path / "store"
    if preset == "small":
        manifest = make_synthetic_store(path, layers=2, experts=8, seed=2)
    else:  # 2.5 MB experts: staging buffers big enough for huge pages
        manifest = make_synthetic_store(path, layers=1, experts=3, tensors=QWEN3_30B_A3B_4BIT_TENSORS, seed=3)
    expect_direct = direct_io_works(tmp_path)
    with ReadEngine(threads=3, direct=True, verify=True, huge_pages=huge_pages) as eng:
        assert eng.huge_pages is huge_pages
        read_all_experts(eng, path, manifest)
        infos = [eng.file_info(f) for f in range(len(manifest.layers))]
        stats = eng.stats()
    n = sum(layer.num_experts for layer in manifest.layers)
    for info, layer in zip(infos, manifest.layers):
        assert info["path"] == str(path / layer.file)
        assert info["size"] == layer.stride * layer.num_experts
        assert info["direct"] is expect_direct
        assert (info["fallback_reason"] is None) is expect_direct
    assert stats["reads"] == n and stats["errors"] == 0 and stats["checksum_failures"] == 0
    assert (stats["direct_reads"], stats["buffered_reads"]) == ((n, 0) if expect_direct else (0, n))
    assert stats["files"] == infos


def test_direct_off_reads_buffered(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    with ReadEngine(threads=2, direct=False) as eng:
        read_all_experts(eng, path, manifest)
        info = eng.file_info(0)
        stats = eng.stats()
    assert info["direct"] is False
    assert "direct=False" in info["fallback_reason"]
    assert stats["buffered_reads"] == 16 and stats["direct_reads"] == 0


FALLBACK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from moestream._native import ReadEngine
    folder = sys.argv[1]
    path = os.path.join(folder, "layer.bin")
    data = os.urandom(16384 * 6)
    with open(path, "wb") as f:
        f.write(data)
    out = {}
    with ReadEngine(threads=2, direct=True, verify=True) as eng:
        fid = eng.open(path)
        dests = [bytearray(10000) for _ in range(6)]
        ids = eng.submit_batch([(fid, i * 16384, 10000, [(dests[i], 0, 0, 10000)], None) for i in range(6)])
        done = eng.wait(ids)
        out["ok"] = all(c.ok for c in done)
        out["errors"] = [c.error for c in done if not c.ok]
        out["equal"] = all(bytes(dests[i]) == data[i * 16384 : i * 16384 + 10000] for i in range(6))
        out["info"] = eng.file_info(fid)
        out["stats"] = {k: v for k, v in eng.stats().items() if isinstance(v, int)}
    print(json.dumps(out))
    """
)


def test_buffered_fallback_where_direct_io_is_refused(tmp_path: Path) -> None:
    """On a filesystem that refuses O_DIRECT the engine reads buffered and says why."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        folder = Path(os.path.realpath(shm)) / f"moestream-test-{os.getpid()}"
        folder.mkdir()
        try:
            if not direct_io_works(folder):  # tmpfs before Linux 6.6: the real thing
                cmd = [sys.executable, "-c", FALLBACK_SCRIPT, str(folder)]
                result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                return check_fallback(result)
        finally:
            shutil.rmtree(folder)
    # tmpfs takes O_DIRECT since Linux 6.6; ramfs never does. Mount one where only this
    # test sees it: a private user + mount namespace.
    unshare = shutil.which("unshare")
    if sys.platform != "linux" or unshare is None:
        pytest.skip("no filesystem here refuses O_DIRECT (macOS F_NOCACHE is never refused)")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    script = f'mount -t ramfs ramfs "$1" && exec "{sys.executable}" -c "$2" "$1"'
    proc = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", str(mnt), FALLBACK_SCRIPT],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 and ("mount" in proc.stderr or "unshare" in proc.stderr):
        pytest.skip(f"cannot mount a ramfs in a user namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    check_fallback(json.loads(proc.stdout))


def check_fallback(result: dict) -> None:
    assert result["ok"], result["errors"]
    assert result["equal"]
    assert result["info"]["direct"] is False
    assert "O_DIRECT" in result["info"]["fallback_reason"]
    assert result["stats"]["buffered_reads"] == 6
    assert result["stats"]["direct_reads"] == 0


# ---- destinations -------------------------------------------------------------------------


def test_reads_into_mlx_arrays_that_mlx_then_computes_with(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    layer = manifest.layers[1]
    slots = 3
    # Like the expert pool: one array per tensor with `slots` experts in it.
    pool = {t.name: mx.zeros((slots, *t.shape), dtype=MX_DTYPES[t.dtype]) for t in layer.tensors}
    mx.eval(list(pool.values()))
    placed = {0: 5, 1: 2, 2: 7}  # slot -> expert
    with ReadEngine(threads=2, verify=True) as eng:
        fid = eng.open(str(path / layer.file))
        batch = []
        for slot, e in placed.items():
            entry = layer.experts[e]
            targets = [
                # memoryview(mx_array) for some, the array itself for the others
                (memoryview(pool[t.name]) if i % 2 else pool[t.name], slot * t.nbytes, t.offset, t.nbytes)
                for i, t in enumerate(layer.tensors)
            ]
            batch.append((fid, entry.offset, entry.length, targets, entry.crc32))
        done = eng.wait(eng.submit_batch(batch))
    assert all(c.ok for c in done), [c.error for c in done]
    for t in layer.tensors:
        arr = pool[t.name]
        for slot, e in placed.items():
            want = tensor_bytes(path, 1, e, t.name)
            assert np.array(arr[slot].view(mx.uint8)).tobytes() == want
            # MLX computes on the new bytes (random floats may be NaN: sum their bytes).
            total = mx.sum(arr[slot].view(mx.uint8).astype(mx.uint32)).item()
            assert total == sum(want) > 0
    # A quantized matmul over a filled slot runs and matches one over a fresh copy.
    w = pool["gate_proj.weight"][0]
    s = pool["gate_proj.scales"][0]
    b = pool["gate_proj.biases"][0]
    x = mx.ones((1, 128), dtype=mx.float16)
    copy = [
        mx.array(np.frombuffer(tensor_bytes(path, 1, 5, f"gate_proj.{n}"), dtype=d).reshape(v.shape))
        for n, d, v in (("weight", np.uint32, w), ("scales", np.float16, s), ("biases", np.float16, b))
    ]
    got = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
    want = mx.quantized_matmul(x, *copy, transpose=True, group_size=64, bits=4)
    assert np.array_equal(np.array(got), np.array(want), equal_nan=True)


def test_reads_into_numpy_with_offsets_and_subranges(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    layer = manifest.layers[0]
    entry = layer.experts[4]
    block = expert_block(path, 0, 4)
    out = np.zeros(3 * entry.length, dtype=np.uint8)
    words = np.zeros(tensor_spec(layer, "down_proj.weight").nbytes // 4, dtype=np.uint32)
    spec = tensor_spec(layer, "down_proj.weight")
    with ReadEngine(threads=2) as eng:
        fid = eng.open(str(path / layer.file))
        rid = eng.submit(
            fid,
            entry.offset,
            entry.length,
            [(out, entry.length, 0, entry.length), (out, 0, 100, 50), (words, 0, spec.offset, spec.nbytes)],
        )
        (c,) = eng.wait([rid])
        # An unaligned offset that is not a block start: a tensor in the middle.
        t = tensor_spec(layer, "up_proj.scales")
        sub = bytearray(t.nbytes)
        (c2,) = eng.wait([eng.submit(fid, entry.offset + t.offset, t.nbytes, [(sub, 0, 0, t.nbytes)])])
    assert c.ok and c2.ok
    assert out[entry.length : 2 * entry.length].tobytes() == block
    assert out[:50].tobytes() == block[100:150]
    assert not out[50 : entry.length].any() and not out[2 * entry.length :].any()
    assert words.tobytes() == tensor_bytes(path, 0, 4, "down_proj.weight")
    assert bytes(sub) == tensor_bytes(path, 0, 4, "up_proj.scales")


def test_targets_none_hands_over_engine_owned_bytes_and_empty_targets_drop(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    layer = manifest.layers[1]
    with ReadEngine(threads=2) as eng:
        fid = eng.open(str(path / layer.file))
        kept = eng.submit(fid, layer.experts[3].offset, layer.experts[3].length, None)
        dropped = eng.submit(fid, layer.experts[3].offset, layer.experts[3].length, [])
        a, b = eng.wait([kept, dropped])
    assert a.ok and a.data == expert_block(path, 1, 3)
    assert b.ok and b.data is None and b.nbytes == layer.experts[3].length


# ---- concurrency and lifetime ---------------------------------------------------------------


def test_concurrent_submits_from_many_python_threads(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    blocks = {(li, e): expert_block(path, li, e) for li in range(2) for e in range(8)}
    errors: list[str] = []
    per_thread = 40
    with ReadEngine(threads=4, verify=True) as eng:
        fids = open_layers(eng, path, manifest)

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(per_thread // 4):
                picks = [(rng.randrange(2), rng.randrange(8)) for _ in range(4)]
                dests = [bytearray(manifest.layers[li].experts[e].length) for li, e in picks]
                ids = []
                for (li, e), d in zip(picks, dests):
                    entry = manifest.layers[li].experts[e]
                    ids.append(eng.submit(fids[li], entry.offset, entry.length, [(d, 0, 0, len(d))], entry.crc32))
                for c, (li, e), d in zip(eng.wait(ids), picks, dests):
                    if not c.ok or bytes(d) != blocks[li, e]:
                        errors.append(f"thread {seed}: layer {li} expert {e}: {c.error or 'bytes differ'}")

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = eng.stats()
        assert eng.pending() == 0 and eng.poll() == []
    assert errors == []
    assert stats["reads"] == 8 * per_thread and stats["errors"] == 0


def test_destinations_are_held_until_taken_and_then_released(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    entry = manifest.layers[0].experts[1]
    dest = bytearray(entry.length)
    base = sys.getrefcount(dest)
    with ReadEngine(threads=1) as eng:
        fid = eng.open(str(path / manifest.layers[0].file))
        ids = [eng.submit(fid, entry.offset, entry.length, [(dest, 0, 0, entry.length)]) for _ in range(20)]
        assert sys.getrefcount(dest) > base
        with pytest.raises(BufferError):  # the export keeps the memory where it is
            dest.extend(b"x")
        assert all(c.ok for c in eng.wait(ids))
        assert sys.getrefcount(dest) == base
        dest.extend(b"x")  # no export left


def test_close_and_destruction_with_reads_pending_are_safe(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    entry = manifest.layers[0].experts[0]
    fd_dir = Path("/proc/self/fd")

    def store_fds() -> list[str] | None:
        """The process's descriptors open on the store's files (not the worker's others,
        which an earlier test's garbage may close meanwhile)."""
        if not fd_dir.is_dir():
            return None
        found = []
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:  # closed between the listing and the read (the listing's own fd)
                continue
            if target.startswith(str(path.resolve())):
                found.append(target)
        return sorted(found)

    fds_before = store_fds()
    dests = [bytearray(entry.length) for _ in range(4)]
    base = [sys.getrefcount(d) for d in dests]

    eng = ReadEngine(threads=1)
    fid = eng.open(str(path / manifest.layers[0].file))
    for _ in range(50):
        eng.submit_batch([(fid, entry.offset, entry.length, [(d, 0, 0, entry.length)], None) for d in dests])
    eng.close()
    eng.close()  # idempotent
    assert eng.closed and eng.pending() == 0
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(fid, entry.offset, entry.length, [])
    with pytest.raises(RuntimeError, match="closed"):
        eng.wait()

    other = ReadEngine(threads=2)
    fid = other.open(str(path / manifest.layers[0].file))
    for _ in range(50):
        other.submit_batch([(fid, entry.offset, entry.length, [(d, 0, 0, entry.length)], None) for d in dests])
    del other  # never closed: the destructor must join and release
    gc.collect()

    assert [sys.getrefcount(d) for d in dests] == base
    for d in dests:
        d.extend(b"x")
    if fds_before is not None:
        assert store_fds() == fds_before


def test_poll_take_and_wait_bookkeeping(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    layer = manifest.layers[0]
    with ReadEngine(threads=1) as eng:
        fid = eng.open(str(path / layer.file))
        ids = eng.submit_batch([(fid, e.offset, e.length, [], None) for e in layer.experts] * 8)
        # 64 reads on one thread cannot all be done the moment they are queued.
        with pytest.raises(TimeoutError, match="still pending"):
            eng.wait(ids, timeout=0)
        first = eng.wait(ids[:3])
        assert [c.id for c in first] == ids[:3] and all(c.ok for c in first)
        with pytest.raises(KeyError):
            eng.take(ids[0])  # already taken
        with pytest.raises(KeyError):
            eng.wait([ids[0]])
        last = eng.take(ids[-1])  # done or not yet: either way no error
        rest = eng.wait()  # everything outstanding
        expected = set(ids[3:]) - ({ids[-1]} if last is not None else set())
        assert {c.id for c in rest} == expected
        assert eng.poll() == [] and eng.pending() == 0

        rid = eng.submit(fid, 0, 4096, [])
        deadline = time.monotonic() + 10
        polled: list = []
        while not polled and time.monotonic() < deadline:
            polled = eng.poll()
            time.sleep(0.001)
        assert [c.id for c in polled] == [rid] and polled[0].ok
        with pytest.raises(KeyError):
            eng.take(rid)
        with pytest.raises(KeyError):
            eng.take(999_999)
        with pytest.raises(ValueError):
            eng.wait(timeout=-1)


# ---- errors ----------------------------------------------------------------------------------


def test_short_read_is_an_error_naming_path_and_offset(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    layer = manifest.layers[1]
    file = path / layer.file
    entry = layer.experts[6]
    dest = bytearray(entry.length)
    with ReadEngine(threads=2) as eng:
        fid = eng.open(str(file))
        os.truncate(file, entry.offset + 5000)  # cut expert 6 short, after open
        (c,) = eng.wait([eng.submit(fid, entry.offset, entry.length, [(dest, 0, 0, entry.length)])])
        (gone,) = eng.wait([eng.submit(fid, layer.experts[7].offset, 4096, [])])
        ok = eng.wait([eng.submit(fid, layer.experts[0].offset, layer.experts[0].length, [])])[0]
        stats = eng.stats()
    assert not c.ok and c.nbytes == 0
    assert c.error.startswith(f"[pread] {file} offset={entry.offset} length={entry.length}: short read")
    assert "got 5000 of" in c.error and f"{entry.offset + 5000} bytes long" in c.error
    assert not any(dest), "a failed read must not fill the destination"
    assert not gone.ok and "short read: got 0 of 4096" in gone.error
    assert ok.ok
    assert stats["errors"] == 2 and stats["reads"] == 3


def test_flipped_byte_is_caught_by_the_checksum(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    layer = manifest.layers[0]
    entry = layer.experts[2]
    file = path / layer.file
    with open(file, "r+b") as f:
        f.seek(entry.offset + 777)
        byte = f.read(1)
        f.seek(entry.offset + 777)
        f.write(bytes([byte[0] ^ 0x10]))
    dest = bytearray(entry.length)
    with ReadEngine(threads=2, verify=True) as eng:
        fid = eng.open(str(file))
        (bad,) = eng.wait([eng.submit(fid, entry.offset, entry.length, [(dest, 0, 0, entry.length)], entry.crc32)])
        (unchecked,) = eng.wait([eng.submit(fid, entry.offset, entry.length, None)])  # no crc given
        stats = eng.stats()
    assert not bad.ok
    assert bad.error.startswith(f"[verify] {file} offset={entry.offset} length={entry.length}: checksum mismatch")
    actual = zlib.crc32(unchecked.data)
    assert f"expected 0x{entry.crc32:08x} got 0x{actual:08x}" in bad.error
    assert not any(dest)
    assert stats["checksum_failures"] == 1 and stats["errors"] == 1
    assert unchecked.ok and unchecked.data[777] == byte[0] ^ 0x10
    with ReadEngine(threads=1, verify=False) as eng:  # verify off: crc ignored
        fid = eng.open(str(file))
        assert eng.wait([eng.submit(fid, entry.offset, entry.length, [], entry.crc32)])[0].ok


def test_open_errors_are_clear_oserrors(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "layer_003.bin"
    with ReadEngine(threads=1) as eng:
        with pytest.raises(FileNotFoundError) as info:
            eng.open(str(missing))
        assert info.value.errno == errno.ENOENT
        assert info.value.filename == str(missing)
        assert "[open]" in str(info.value) and str(missing) in str(info.value)
        with pytest.raises(IsADirectoryError, match="not a regular file"):
            eng.open(str(tmp_path))


def test_bad_requests_raise_at_submit_and_queue_nothing(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    layer = manifest.layers[0]
    entry = layer.experts[0]
    size = layer.stride * layer.num_experts
    dest = bytearray(entry.length)
    with ReadEngine(threads=1) as eng:
        fid = eng.open(str(path / layer.file))
        cases = [
            ((fid, size - 100, 200, []), ValueError, "past the end"),
            ((fid, 0, 0, []), ValueError, "length 0"),
            ((fid, -1, 10, []), ValueError, "offset must be >= 0"),
            ((fid + 5, 0, 10, []), ValueError, "unknown file id"),
            ((fid, 0, 100, [(dest, 0, 50, 51)]), ValueError, "source range"),
            ((fid, 0, 100, [(bytearray(10), 0, 0, 11)]), ValueError, "destination range"),
            ((fid, 0, 100, [(dest, len(dest) - 5, 0, 6)]), ValueError, "destination range"),
            ((fid, 0, 100, [(b"x" * 100, 0, 0, 100)]), ValueError, "writable"),
            ((fid, 0, 100, [(np.zeros((10, 20), np.uint8)[:, ::2], 0, 0, 100)]), ValueError, "C-contiguous"),
            ((fid, 0, 100, [(mx.zeros((10, 10), dtype=mx.uint8).T, 0, 0, 100)]), ValueError, "C-contiguous"),
            ((fid, 0, 100, [("text", 0, 0, 4)]), TypeError, "buffer protocol"),
            ((fid, 0, 100, [(dest, 0, 0)]), ValueError, "expected a tuple"),
            ((fid, 0, 100, "nope"), TypeError, "targets must be"),
        ]
        for args, exc, match in cases:
            with pytest.raises(exc, match=match):
                eng.submit(*args)
        with pytest.raises(ValueError, match="32-bit"):
            eng.submit(fid, 0, 100, [], 1 << 32)
        # A batch with one bad request queues none of them.
        with pytest.raises(ValueError, match="request 1"):
            eng.submit_batch([(fid, 0, 100, [(dest, 0, 0, 100)], None), (fid, size, 1, [], None)])
        assert eng.pending() == 0 and eng.poll() == [] and eng.stats()["reads"] == 0
        dest.extend(b"x")  # and holds no buffer export
    with pytest.raises(ValueError, match="threads"):
        ReadEngine(threads=0)


def test_stats_add_up(store: tuple[Path, Manifest]) -> None:
    path, manifest = store
    layer = manifest.layers[1]
    with ReadEngine(threads=2) as eng:
        fid = eng.open(str(path / layer.file))
        batch = [(fid, e.offset, e.length, [], None) for e in layer.experts]
        batch.append((fid, layer.experts[1].offset + 100, 50, [], None))  # unaligned start
        done = eng.wait(eng.submit_batch(batch))
        os.truncate(path / layer.file, layer.stride * 7)
        done += eng.wait([eng.submit(fid, layer.experts[7].offset, 10, [])])
        s = eng.stats()
        assert all(c.ok for c in done[:-1]) and not done[-1].ok
        assert s["reads"] == 10 and s["errors"] == 1 and s["checksum_failures"] == 0
        assert s["direct_reads"] + s["buffered_reads"] == 9
        assert s["bytes"] == sum(e.length for e in layer.experts) + 50 == sum(c.nbytes for c in done)
        # Whole aligned blocks are read: 8 experts' blocks plus one 4 KiB page.
        assert s["bytes_read"] == 8 * -(-layer.expert_bytes // DIRECT_ALIGN) * DIRECT_ALIGN + DIRECT_ALIGN
        for key in ("latency_us", "read_latency_us"):
            lat = s[key]
            assert lat["count"] == 10 and 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        assert max(c.latency_us for c in done) <= s["latency_us"]["max"] + 1
        assert s["seconds_busy"] > 0 and s["pending"] == 0 and s["threads"] == 2
        eng.reset_stats()
        z = eng.stats()
        assert z["reads"] == z["bytes"] == z["errors"] == 0 and z["latency_us"]["count"] == 0
        assert z["seconds_busy"] == 0
