"""`moestreamctl bench io`: the native read engine against fio, on like expert reads.

Both sides read whole experts, at random, from the store's layer files: the engine with
`threads` worker threads doing synchronous direct preads of one expert block each, fio
with `numjobs = threads` psync jobs, `direct=1`, the block size of one engine read (the
expert's length rounded up to the direct-I/O alignment) and random offsets aligned to the
expert stride. The two alternate, `rounds` times each, and the medians are reported, so
that drift of the disk or of the machine's load hits both alike.

Imports no MLX: only the engine and the store manifest.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._native import DIRECT_ALIGN, ReadEngine
from ...shared.store_format import Manifest, MoELayer, align_up, load_manifest

FIO_INSTALL_HINT = (
    "install it with `apt-get install fio` (Debian/Ubuntu), `dnf install fio` (Fedora) or `brew install fio` (macOS)"
)


class BenchIOError(RuntimeError):
    """The benchmark could not run; the message says why and what to do."""


@dataclass(frozen=True)
class BenchIOSettings:
    store: Path
    threads: int = 4
    samples: int = 256  # expert reads per run, per side
    seed: int = 0
    rounds: int = 3
    # Engine staging buffers on transparent huge pages (its default); off reads into
    # 4 KiB pages like fio does, for a like-for-like comparison.
    huge_pages: bool = True

    def check(self) -> None:
        if not 1 <= self.threads <= 256:
            raise BenchIOError(f"--threads must be in 1..256, got {self.threads}")
        if self.samples < 1:
            raise BenchIOError(f"--samples must be at least 1, got {self.samples}")
        if self.rounds < 1:
            raise BenchIOError(f"--rounds must be at least 1, got {self.rounds}")


@dataclass(frozen=True)
class RunResult:
    """One timed run of one side."""

    bytes: int
    seconds: float
    latency_us: dict[str, float]  # p50, p90, p99, max of one read

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def huge_pages_used(asked: bool, platform: str | None = None) -> bool:
    """Whether the engine's staging buffers really go on huge pages: asked for, and on
    Linux, the only system whose engine build has MADV_HUGEPAGE (native/read_engine.cpp;
    on macOS the request is accepted and has no effect). `platform`: `sys.platform`."""
    return asked and (sys.platform if platform is None else platform).startswith("linux")


def find_fio() -> str:
    """The fio executable, or BenchIOError saying how to install it."""
    path = shutil.which("fio")
    if path is None:
        raise BenchIOError(f"fio is not installed (the benchmark compares the engine with it); {FIO_INSTALL_HINT}")
    return path


def benchmark_layers(manifest: Manifest) -> list[MoELayer]:
    """The layers whose experts share the most common (length, stride): fio reads one
    block size at one alignment, so both sides read only those."""
    shapes = Counter((layer.expert_bytes, layer.stride) for layer in manifest.layers)
    shape, _ = shapes.most_common(1)[0]
    return [layer for layer in manifest.layers if (layer.expert_bytes, layer.stride) == shape]


def sample_experts(layers: list[MoELayer], samples: int, rng: random.Random) -> list[tuple[int, int]]:
    """(index into layers, expert) pairs: distinct while there are enough experts."""
    population = [(i, e) for i, layer in enumerate(layers) for e in range(layer.num_experts)]
    if samples <= len(population):
        return rng.sample(population, samples)
    return rng.choices(population, k=samples)


def _summary(p: dict[str, float]) -> dict[str, float]:
    return {k: round(float(p[k]), 1) for k in ("p50", "p90", "p99", "max")}


def run_engine(
    store: Path, layers: list[MoELayer], picks: list[tuple[int, int]], threads: int, huge_pages: bool = True
) -> tuple[RunResult, dict[str, Any]]:
    """Read the picked experts through the engine (direct I/O, no copies: targets=[])."""
    with ReadEngine(threads=threads, direct=True, verify=False, huge_pages=huge_pages) as engine:
        fids = [engine.open(str(store / layer.file)) for layer in layers]
        batch = []
        for i, e in picks:
            entry = layers[i].experts[e]
            batch.append((fids[i], entry.offset, entry.length, [], None))
        start = time.perf_counter()
        ids = engine.submit_batch(batch)
        done = engine.wait(ids)
        seconds = time.perf_counter() - start
        failed = [c for c in done if not c.ok]
        if failed:
            raise BenchIOError(f"the engine failed {len(failed)} of {len(done)} reads; first: {failed[0].error}")
        stats = engine.stats()
        infos = [engine.file_info(f) for f in fids]
    reasons = sorted({i["fallback_reason"] for i in infos if not i["direct"]})
    mode = {"direct": all(i["direct"] for i in infos), "fallback_reasons": reasons}
    return RunResult(bytes=stats["bytes_read"], seconds=seconds, latency_us=_summary(stats["read_latency_us"])), mode


def fio_job(files: list[Path], block: int, stride: int, threads: int, ios_per_job: int, seed: int) -> str:
    """A fio job file that reads like the engine: `threads` threads of synchronous direct
    reads of one expert block at a random expert offset of a random layer file."""
    names = ":".join(str(f).replace(":", "\\:") for f in files)
    return "\n".join(
        [
            "[global]",
            "ioengine=psync",
            "direct=1",
            "rw=randread",
            f"bs={block}",
            f"blockalign={stride}",
            "norandommap=1",
            "randrepeat=0",
            f"randseed={seed}",
            "file_service_type=random",
            "thread=1",
            f"numjobs={threads}",
            f"number_ios={ios_per_job}",
            f"io_size={ios_per_job * block}",
            "group_reporting=1",
            f"filename={names}",
            "",
            "[experts]",
            "",
        ]
    )


def run_fio(fio: str, job: str) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="moestream-fio-") as tmp:
        job_path = Path(tmp) / "experts.fio"
        out_path = Path(tmp) / "out.json"
        job_path.write_text(job)
        proc = subprocess.run(
            [fio, "--output-format=json", f"--output={out_path}", str(job_path)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip()[-2000:]
            raise BenchIOError(f"fio failed (exit {proc.returncode}): {tail}")
        try:
            report = json.loads(out_path.read_text())
            read = report["jobs"][0]["read"]
            clat = read["clat_ns"]
            pct = clat.get("percentile", {})
            runtime_ms = float(read["runtime"])
            nbytes = int(read["io_bytes"])
        except (OSError, ValueError, KeyError, IndexError) as e:
            raise BenchIOError(f"cannot read fio's JSON report ({type(e).__name__}: {e})") from e
    if nbytes <= 0 or runtime_ms <= 0:
        raise BenchIOError(f"fio read {nbytes} bytes in {runtime_ms} ms: too little to time; use more --samples")

    def at(q: str) -> float:
        return float(pct.get(q, 0.0)) / 1000.0

    top = float(clat["max"]) / 1000.0
    # fio's percentiles are bucket bounds and can overshoot the true maximum.
    latency = {
        "p50": min(at("50.000000"), top),
        "p90": min(at("90.000000"), top),
        "p99": min(at("99.000000"), top),
        "max": top,
    }
    return RunResult(bytes=nbytes, seconds=runtime_ms / 1000.0, latency_us=_summary(latency))


def fio_version(fio: str) -> str:
    proc = subprocess.run([fio, "--version"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def _median_latency(runs: list[RunResult]) -> dict[str, float]:
    return {k: round(statistics.median(r.latency_us[k] for r in runs), 1) for k in ("p50", "p90", "p99", "max")}


def run_bench_io(settings: BenchIOSettings) -> dict[str, Any]:
    """Run the benchmark; return the report (what `--json` prints)."""
    settings.check()
    store = Path(settings.store)
    manifest = load_manifest(store)
    fio = find_fio()
    layers = benchmark_layers(manifest)
    length, stride = layers[0].expert_bytes, layers[0].stride
    block = align_up(length, DIRECT_ALIGN)
    ios_per_job = -(-settings.samples // settings.threads)
    files = [store / layer.file for layer in layers]

    engine_runs: list[RunResult] = []
    fio_runs: list[RunResult] = []
    mode: dict[str, Any] = {}
    for r in range(settings.rounds):
        picks = sample_experts(layers, settings.samples, random.Random(settings.seed * 1000 + r))
        job = fio_job(files, block, stride, settings.threads, ios_per_job, settings.seed * 1000 + r + 1)
        # Alternate who goes first (engine, fio, fio, engine, ...) so that neither
        # always follows the other's warm-up or cool-down.
        for side in ("engine", "fio") if r % 2 == 0 else ("fio", "engine"):
            if side == "engine":
                result, mode = run_engine(store, layers, picks, settings.threads, settings.huge_pages)
                engine_runs.append(result)
            else:
                fio_runs.append(run_fio(fio, job))

    engine_gbps = statistics.median(r.gbps for r in engine_runs)
    fio_gbps = statistics.median(r.gbps for r in fio_runs)
    return {
        "store": str(store),
        "threads": settings.threads,
        "samples": settings.samples,
        "rounds": settings.rounds,
        "seed": settings.seed,
        "files": len(files),
        "expert_bytes": length,
        "stride": stride,
        "block_bytes": block,
        "engine": {
            "gbps": round(engine_gbps, 3),
            "gbps_runs": [round(r.gbps, 3) for r in engine_runs],
            "read_latency_us": _median_latency(engine_runs),
            "mode": "direct" if mode.get("direct") else "buffered",
            "fallback_reasons": mode.get("fallback_reasons", []),
            "huge_pages": huge_pages_used(settings.huge_pages),
            "reads": settings.samples,
        },
        "fio": {
            "gbps": round(fio_gbps, 3),
            "gbps_runs": [round(r.gbps, 3) for r in fio_runs],
            "clat_us": _median_latency(fio_runs),
            "mode": "direct",
            "ioengine": "psync",
            "numjobs": settings.threads,
            "ios_per_job": ios_per_job,
            "version": fio_version(fio),
        },
        "ratio": round(engine_gbps / fio_gbps, 3) if fio_gbps > 0 else None,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a short table."""
    e, f = report["engine"], report["fio"]

    def lat(d: dict[str, float]) -> str:
        return f"{d['p50']:>9.0f} {d['p90']:>9.0f} {d['p99']:>9.0f} {d['max']:>9.0f}"

    lines = [
        f"store {report['store']}: {report['files']} layer files, expert {report['expert_bytes']} bytes "
        f"(read {report['block_bytes']}), stride {report['stride']}",
        f"{report['samples']} random experts per run, {report['threads']} threads, "
        f"{report['rounds']} interleaved runs each, medians; engine staging on "
        f"{'huge' if e['huge_pages'] else '4 KiB'} pages",
        "",
        f"{'':8} {'GB/s':>7} {'mode':>8}   {'p50 us':>9} {'p90 us':>9} {'p99 us':>9} {'max us':>9}",
        f"{'engine':8} {e['gbps']:>7.3f} {e['mode']:>8}   {lat(e['read_latency_us'])}",
        f"{'fio':8} {f['gbps']:>7.3f} {f['mode']:>8}   {lat(f['clat_us'])}",
        "",
        f"engine/fio: {report['ratio']:.3f}" if report["ratio"] is not None else "engine/fio: n/a",
    ]
    for reason in e["fallback_reasons"]:
        lines.append(f"engine read buffered: {reason}")
    return "\n".join(lines)
