"""The host-RAM tier: expert blocks in host memory between the store and the pool.

`HostTier` is the memory: slots of one expert block each, LRU over (layer, expert) keys.
`TieredAdmitter` is the `Admitter` (daemon/pool/admission.py) that goes through it: store
-> host tier -> pool rows. With `caching=True` it is the host-RAM tier of `--host-cache`, an
LRU cache over all layers, so an expert is read from disk at most once while it stays hot.
On an NVIDIA GPU the tier is page-locked and its bytes reach the pool by DMA on a CUDA
stream (`CudaCopier`), since MLX's own ways of writing GPU memory from the host run at
1-4 GB/s where DMA runs at the link's speed; with `caching=False` the same buffer is only a
staging area for that DMA. Which admitter a machine gets is `make_admitter`'s choice.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx

from ..._native import CudaCopier, HostBuffer, copy_spans
from ...shared.store_format import Manifest, MoELayer
from .expert_reader import ExpertReader, ReadJob

if TYPE_CHECKING:
    from .admission import Failure, Placement

_ALIGN = 4096


def row_spans(
    layer: MoELayer, dst: dict[str, mx.array], src: dict[str, mx.array], rows: Sequence[tuple[int, int]]
) -> list[tuple[Any, int, Any, int, int]]:
    """The (dst, offset, src, offset, bytes) spans that copy (dst row, src row) pairs."""
    return [
        (dst[t.name], dr * t.nbytes, src[t.name], sr * t.nbytes, t.nbytes) for dr, sr in rows for t in layer.tensors
    ]


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_from_disk: int = 0
    bytes_to_pool: int = 0
    copy_seconds: float = 0.0
    # Prefetch straight into pool rows (`prestage`): experts, and seconds the layer that
    # needed them waited for their copies.
    prestaged: int = 0
    prestage_bytes: int = 0
    prestage_wait_seconds: float = 0.0


# How pages a smaller tier no longer uses go back to the system: dropped at once on Linux
# (read again, they are zeros); on macOS marked reusable, as its malloc does, so that the
# process's footprint (what memory pressure counts) drops, and reused before a grow.
_RELEASE = getattr(mmap, "MADV_FREE_REUSABLE", None) if sys.platform == "darwin" else mmap.MADV_DONTNEED
_REUSE = getattr(mmap, "MADV_FREE_REUSE", None) if sys.platform == "darwin" else None
_PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC = ctypes.CDLL(None, use_errno=True)


def _advise(buffer: Any, start: int, end: int, advice: int | None) -> bool:
    """madvise(2) the whole pages of `buffer` (host memory exported as a buffer) within
    [start, end); False where it failed or there is nothing to advise."""
    start = (start + _PAGE - 1) // _PAGE * _PAGE
    end = end // _PAGE * _PAGE
    if advice is None or end <= start:
        return False
    base = ctypes.addressof(ctypes.c_char.from_buffer(memoryview(buffer).cast("B")))
    done = _LIBC.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(end - start), ctypes.c_int(advice))
    return done == 0


class HostTier:
    """Expert blocks in host memory: `slots` slots of `stride` bytes, LRU over
    (layer, expert) keys. Touched only on the decode thread: by the admitter that owns
    it, and by the prefetcher, which adds the experts it read from disk.

    `resize` (the elastic pool, daemon/pool/elastic.py) gives bytes back and takes them
    again, up to the `most` slots it was made with: page-locked memory (DMA's) is made
    again at the new size, other memory keeps its address and gives back its pages."""

    def __init__(self, slots: int, stride: int, copier: CudaCopier | None) -> None:
        self.slots = self.most = slots
        self.stride = stride
        self._copier = copier
        self.buffer = HostBuffer(slots * stride, copier)
        self.view = memoryview(self.buffer).cast("B")
        self._slot_of: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._free = list(range(slots - 1, -1, -1))
        # Whether the pages of the last shrink went back to the system.
        self.released = True

    def resize(self, slots: int) -> None:
        """Hold at most `slots` experts (1 to `most`): a shrink keeps the most recently
        used, moved into the slots below `slots`, and gives back the bytes above them; a
        grow takes them again. No copy may be in flight (the admitter settles first)."""
        slots = max(1, min(int(slots), self.most))
        if slots == self.slots:
            return
        stride = self.stride
        if slots < self.slots:
            for key in list(self._slot_of)[: max(len(self._slot_of) - slots, 0)]:
                self.forget(key)
            low_free = sorted(s for s in self._free if s < slots)
            for key, s in list(self._slot_of.items()):
                if s >= slots:
                    d = low_free.pop(0)
                    self.view[d * stride : (d + 1) * stride] = self.view[s * stride : (s + 1) * stride]
                    self._slot_of[key] = d  # keeps its place in the LRU order
            self._free = low_free[::-1]
        else:
            self._free = list(range(slots - 1, self.slots - 1, -1)) + self._free
        if self.buffer.pinned:
            # Page-locked memory cannot give back part of itself: made again at the new size.
            used = min(slots, self.slots) * stride
            buffer = HostBuffer(slots * stride, self._copier)
            view = memoryview(buffer).cast("B")
            view[:used] = self.view[:used]
            self.buffer, self.view = buffer, view
        elif slots < self.slots:
            self.released = _advise(self.buffer, slots * stride, self.slots * stride, _RELEASE)
        else:
            _advise(self.buffer, self.slots * stride, slots * stride, _REUSE)
        self.slots = slots

    @property
    def pinned(self) -> bool:
        return self.buffer.pinned

    def lookup(self, key: tuple[int, int]) -> int | None:
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
        return slot

    def assign(self, key: tuple[int, int], protected: set[tuple[int, int]]) -> tuple[int, bool]:
        """A slot for `key` (a free one, or the least recently used unprotected one);
        returns (slot, whether something was evicted)."""
        if self._free:
            slot, evicted = self._free.pop(), False
        else:
            victim = next((k for k in self._slot_of if k not in protected), None)
            if victim is None:
                raise RuntimeError("host tier: every slot is in use by this fill")
            slot, evicted = self._slot_of.pop(victim), True
        self._slot_of[key] = slot
        return slot, evicted

    def forget(self, key: tuple[int, int]) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        self._slot_of.clear()
        self._free = list(range(self.slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def holds(self, key: tuple[int, int]) -> bool:
        """Whether `key` is in the tier (without touching its LRU order)."""
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)


class TieredAdmitter:
    """Store -> host tier -> pool rows. `caching=False` makes the tier a staging area only:
    it is cleared before each fill and holds nothing between fills."""

    def __init__(
        self,
        reader: ExpertReader,
        tier: HostTier,
        copier: CudaCopier | None,
        *,
        caching: bool,
        ahead_blocks: int | None = None,
    ) -> None:
        self.reader = reader
        self.tier = tier
        self.copier = copier
        self.caching = caching
        # Blocks per span of the copy kernel for `prestage`'s copies, which run beside
        # the GPU's work (Settings.prefetch_copy_blocks; None: the copier's own).
        self.ahead_blocks = ahead_blocks
        self.s = TierStats()
        # Whether copies queued by `prestage` may still be running: until `settle`, the
        # tier slots they read must not be reused, nor the rows they write read.
        self._in_flight = False

    def fill(self, layer: MoELayer, placements: Sequence[Placement], arrays: dict[str, mx.array]) -> list[Failure]:
        self.settle()
        failures: list[Failure] = []
        step = self.tier.slots
        for i in range(0, len(placements), step):
            failures += self._fill_chunk(layer, placements[i : i + step], arrays)
        return failures

    def _fill_chunk(
        self, layer: MoELayer, placements: Sequence[Placement], arrays: dict[str, mx.array]
    ) -> list[Failure]:
        if not self.caching:
            self.tier.clear()
        keys = {(layer.ordinal, e) for e, _ in placements}
        slots: dict[int, int] = {}
        jobs = []
        for e, _ in placements:
            key = (layer.ordinal, e)
            slot = self.tier.lookup(key) if self.caching else None
            if slot is not None:
                self.s.hits += 1
            else:
                slot, evicted = self.tier.assign(key, keys)
                self.s.evictions += evicted
                self.s.misses += 1
                entry = layer.experts[e]
                jobs.append(ReadJob(layer, e, [(self.tier.buffer, slot * self.tier.stride, 0, entry.length)]))
            slots[e] = slot
        failed = self.reader.read(jobs)
        bad = {job.expert for job, _ in failed}
        self.s.bytes_from_disk += sum(layer.experts[j.expert].length for j in jobs if j.expert not in bad)
        for e in bad:
            self.tier.forget((layer.ordinal, e))
        spans = [
            (arrays[t.name], row * t.nbytes, self.tier.buffer, slots[e] * self.tier.stride + t.offset, t.nbytes)
            for e, row in placements
            if e not in bad
            for t in layer.tensors
        ]
        self._copy(spans)
        return [(job.expert, error) for job, error in failed]

    def _copy(self, spans: list[tuple[Any, int, Any, int, int]]) -> None:
        if not spans:
            return
        if self.copier is not None:
            seconds = self.copier.copy(spans)
        else:
            tic = time.perf_counter()
            copy_spans(spans)
            seconds = time.perf_counter() - tic
        self.s.copy_seconds += seconds
        self.s.bytes_to_pool += sum(span[4] for span in spans)

    def held(self, layer: MoELayer, experts: Sequence[int]) -> list[int]:
        if not self.caching:
            return []
        return [e for e in experts if self.tier.holds((layer.ordinal, e))]

    def prestage(self, layer: MoELayer, placements: Sequence[Placement], arrays: dict[str, mx.array]) -> None:
        """Copy held experts into their rows. With the CUDA copier the copies are only
        queued, so they run while the GPU computes; elsewhere they are done on return."""
        spans = []
        for e, row in placements:
            slot = self.tier.lookup((layer.ordinal, e)) if self.caching else None
            if slot is None:
                raise ValueError(f"expert {e} of layer {layer.ordinal} is not in the host tier")
            base = slot * self.tier.stride
            spans += [
                (arrays[t.name], row * t.nbytes, self.tier.buffer, base + t.offset, t.nbytes) for t in layer.tensors
            ]
        if not spans:
            return
        self.s.prestaged += len(placements)
        # Counted apart from bytes_to_pool: these copies overlap compute, so they have
        # no copy time of their own to measure bandwidth by.
        self.s.prestage_bytes += sum(span[4] for span in spans)
        if self.copier is None:
            copy_spans(spans)
            return
        self.copier.copy(spans, wait=False, blocks=self.ahead_blocks)
        self._in_flight = True

    def warm(self, layers: Sequence[MoELayer], keys: Sequence[tuple[int, int]], batch: int = 256) -> int:
        """Read these (layer ordinal, expert) keys, hottest first, into free tier slots
        (never evicting), in parallel batches: a warm start's tier then serves them
        without the disk. Unreadable experts are left out. Returns the bytes read."""
        if not self.caching:
            return 0
        self.settle()
        layer_of = {layer.ordinal: layer for layer in layers}
        todo = [k for k in dict.fromkeys(keys) if not self.tier.holds(k)][: self.tier.free_slots]
        read = 0
        # Coldest first, so that the hottest end up most recently used (evicted last).
        todo.reverse()
        for i in range(0, len(todo), batch):
            jobs = []
            for ordinal, e in todo[i : i + batch]:
                slot, _ = self.tier.assign((ordinal, e), set())
                length = layer_of[ordinal].experts[e].length
                jobs.append(ReadJob(layer_of[ordinal], e, [(self.tier.buffer, slot * self.tier.stride, 0, length)]))
            failed = {(job.layer.ordinal, job.expert) for job, _ in self.reader.read(jobs)}
            for key in failed:
                self.tier.forget(key)
            read += sum(
                job.layer.experts[job.expert].length for job in jobs if (job.layer.ordinal, job.expert) not in failed
            )
        self.s.bytes_from_disk += read
        return read

    def resize_tier(self, slots: int) -> None:
        """The host tier at `slots` experts (`HostTier.resize`), once no copy reads it."""
        self.settle()
        self.tier.resize(slots)

    def settle(self) -> None:
        if self._in_flight:
            self._in_flight = False
            self.s.prestage_wait_seconds += self.copier.sync()

    def copy_rows(
        self, layer: MoELayer, dst: dict[str, mx.array], src: dict[str, mx.array], rows: Sequence[tuple[int, int]]
    ) -> None:
        self.settle()
        spans = row_spans(layer, dst, src, rows)
        if self.copier is not None:
            # Not batched: a batch's location hints say host to GPU, and these copies
            # run from GPU to GPU (and only on the rare overflow path).
            self.copier.copy(spans)
        else:
            copy_spans(spans)

    def prepare(self, arrays: dict[str, mx.array]) -> None:
        if self.copier is not None:
            # The arrays become managed memory that stays in GPU memory, so DMA writes
            # them in place and the kernels read them at full speed.
            for a in arrays.values():
                self.copier.place(a, "device")

    def stats(self) -> dict[str, Any]:
        s = self.s
        lookups = s.hits + s.misses
        return {
            "mode": "host-tier" if self.caching else "staged",
            "device_copy": "cuda" if self.copier is not None else "memcpy",
            "tier_capacity_experts": self.tier.slots if self.caching else 0,
            "tier_resident_experts": len(self.tier) if self.caching else 0,
            "tier_bytes": self.tier.slots * self.tier.stride,
            # The bytes it was made with (--host-cache); less while the elastic pool holds it smaller.
            "tier_most_bytes": self.tier.most * self.tier.stride,
            "pinned": self.tier.pinned,
            "tier_hits": s.hits if self.caching else 0,
            "tier_misses": s.misses if self.caching else 0,
            "tier_hit_rate": (s.hits / lookups if lookups else None) if self.caching else None,
            "tier_evictions": s.evictions if self.caching else 0,
            "bytes_from_disk": s.bytes_from_disk,
            "bytes_to_pool": s.bytes_to_pool,
            "copy_seconds": s.copy_seconds,
            "admission_bytes_per_s": s.bytes_to_pool / s.copy_seconds if s.copy_seconds > 0 else None,
            "prestaged": s.prestaged,
            "prestage_bytes": s.prestage_bytes,
            "prestage_wait_seconds": s.prestage_wait_seconds,
        } | ({"copier": self.copier.counters()} if self.copier is not None else {})


def expert_stride(manifest: Manifest) -> int:
    """Bytes of one host-tier slot: the largest expert block, page-aligned."""
    longest = max(entry.length for layer in manifest.layers for entry in layer.experts)
    return (longest + _ALIGN - 1) // _ALIGN * _ALIGN
