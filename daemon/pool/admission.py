"""How expert bytes reach the rows of pool arrays.

Two ways, one interface (`Admitter`):

- `DirectAdmitter`: the read engine copies each expert from the store straight into the
  destination arrays' memory. Right where the GPU shares the host's memory (Apple
  Silicon) and on the CPU: there is no second copy at all.
- `TieredAdmitter` (daemon/pool/host_tier.py): experts go through host memory, a
  `HostTier`: the host-RAM tier of `--host-cache`, or on an NVIDIA GPU without one, a
  page-locked staging area for DMA to the pool.

`make_admitter` picks one for the machine and the settings. Destinations are MLX arrays
`[rows, *tensor shape]` per expert tensor; callers make sure no queued computation reads
the rows being written.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import mlx.core as mx

from ..._native import CudaCopier, copy_spans
from ...shared.settings import SettingsError
from ...shared.store_format import Manifest, MoELayer
from .expert_reader import ExpertReader, ReadJob
from .host_tier import HostTier, TieredAdmitter, expert_stride, row_spans

# (expert id, destination row): where `fill` writes an expert (a pool slot, or a row of a
# stack or a scratch). Not daemon/mapped/mapped_pool.py's `MappedPool`.
Placement = tuple[int, int]
# (expert id, why it could not be read)
Failure = tuple[int, str]


class Admitter(Protocol):
    reader: ExpertReader

    def fill(self, layer: MoELayer, placements: Sequence[Placement], arrays: dict[str, mx.array]) -> list[Failure]:
        """Write each expert's tensors into its row of `arrays`; return the failures."""

    def copy_rows(
        self, layer: MoELayer, dst: dict[str, mx.array], src: dict[str, mx.array], rows: Sequence[tuple[int, int]]
    ) -> None:
        """Copy (dst row, src row) pairs between two sets of arrays of this layer."""

    def prepare(self, arrays: dict[str, mx.array]) -> None:
        """Get newly allocated destination arrays ready to be filled."""

    def held(self, layer: MoELayer, experts: Sequence[int]) -> list[int]:
        """Those of `experts` that are in host memory already (a copy away, no read)."""

    def prestage(self, layer: MoELayer, placements: Sequence[Placement], arrays: dict[str, mx.array]) -> None:
        """Start copying held experts into their rows without waiting for the copies;
        `settle` waits. Until then nothing may read those rows."""

    def settle(self) -> None:
        """Wait for the copies `prestage` started."""

    def stats(self) -> dict[str, Any]: ...


class DirectAdmitter:
    """The read engine writes experts straight into the destination arrays."""

    def __init__(self, reader: ExpertReader) -> None:
        self.reader = reader
        self.bytes_from_disk = 0

    def fill(self, layer: MoELayer, placements: Sequence[Placement], arrays: dict[str, mx.array]) -> list[Failure]:
        jobs = [
            ReadJob(layer, e, [(arrays[t.name], row * t.nbytes, t.offset, t.nbytes) for t in layer.tensors])
            for e, row in placements
        ]
        failed = self.reader.read(jobs)
        self.bytes_from_disk += (len(jobs) - len(failed)) * layer.expert_bytes
        return [(job.expert, error) for job, error in failed]

    def copy_rows(
        self, layer: MoELayer, dst: dict[str, mx.array], src: dict[str, mx.array], rows: Sequence[tuple[int, int]]
    ) -> None:
        copy_spans(row_spans(layer, dst, src, rows))

    def prepare(self, arrays: dict[str, mx.array]) -> None:
        return None

    def held(self, layer: MoELayer, experts: Sequence[int]) -> list[int]:
        return []

    def prestage(self, layer: MoELayer, placements: Sequence[Placement], arrays: dict[str, mx.array]) -> None:
        if placements:
            raise ValueError("a direct admitter holds no expert in host memory to prestage")

    def settle(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"mode": "direct", "bytes_from_disk": self.bytes_from_disk}


def cuda_copier() -> tuple[CudaCopier | None, str]:
    """The CUDA copier where MLX runs on an NVIDIA GPU, else None and why not."""
    if mx.default_device().type != mx.gpu:
        return None, "MLX runs on the CPU"
    if mx.metal.is_available():
        return None, "unified memory (Metal): the engine reads straight into the pool"
    try:
        return CudaCopier(), ""
    except ImportError as e:
        return None, str(e)


STAGING_EXPERTS = 64


def make_admitter(
    reader: ExpertReader,
    manifest: Manifest,
    host_cache_bytes: int,
    *,
    cuda: tuple[CudaCopier | None, str] | None = None,
    copy_kernel: bool = False,
    ahead_blocks: int | None = None,
) -> tuple[Admitter, dict[str, Any]]:
    """The admitter for this machine and settings, and a note of what was chosen and why.
    `copy_kernel` (Settings.copy_kernel) is honoured where there is a CUDA copier; `cuda` is
    what `cuda_copier()` gave the caller already (else it is asked here); `ahead_blocks`
    (Settings.prefetch_copy_blocks) caps the copy kernel for copies queued ahead of use."""
    copier, why_not = cuda if cuda is not None else cuda_copier()
    if copier is not None:
        # Every copy through this copier (the tier's, the prefetcher's) goes that way.
        copier.kernel = copy_kernel
    stride = expert_stride(manifest)
    if host_cache_bytes:
        slots = host_cache_bytes // stride
        if slots < 1:
            raise SettingsError(
                f"--host-cache {host_cache_bytes} bytes is below one expert ({stride} bytes); give more or 0 to turn "
                "it off"
            )
        total = sum(layer.num_experts for layer in manifest.layers)
        slots = min(slots, total)
        admitter = TieredAdmitter(
            reader, HostTier(slots, stride, copier), copier, caching=True, ahead_blocks=ahead_blocks
        )
        return admitter, {"cuda": why_not or "on", "copy_kernel": copy_kernel and copier is not None}
    if copier is not None:
        largest = max(layer.num_experts for layer in manifest.layers)
        tier = HostTier(min(STAGING_EXPERTS, largest), stride, copier)
        return TieredAdmitter(reader, tier, copier, caching=False), {"cuda": "on", "copy_kernel": copy_kernel}
    return DirectAdmitter(reader), {"cuda": why_not}
