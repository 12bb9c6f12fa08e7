"""Where a KV pool's pages lie in memory, and the descriptors that name some of them.

A pool keeps K and V as ``(layers, pages × page_size, heads, head_dim)`` tensors, so one
page is ``layers`` separate spans in each, one per layer; a run of consecutive page ids is
one span per layer. A transfer therefore costs ``2 × layers`` descriptors per run of pages
that are consecutive on both sides, and pages are given out low ids first (``KVPool``), so
a prompt's pages are mostly one run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from preble_backend.model.kv_pool import KVPool


@dataclass(frozen=True)
class PoolLayout:
    """A pool's memory as a peer needs to know it: plain numbers, sent as JSON."""

    k_address: int
    v_address: int
    stamps_address: int
    num_layers: int
    num_pages: int
    page_bytes: int  # one page of one layer, K or V
    memory: str  # NIXL's memory type: "DRAM" or "VRAM"
    device_id: int
    page_size: int
    dtype: str

    @classmethod
    def of(cls, pool: KVPool) -> PoolLayout:
        k = pool.k_cache
        layers, _, heads, dim = k.shape
        return cls(
            k_address=k.data_ptr(),
            v_address=pool.v_cache.data_ptr(),
            stamps_address=pool.stamps.ctypes.data,
            num_layers=layers,
            num_pages=pool.num_pages,
            page_bytes=pool.page_size * heads * dim * k.element_size(),
            memory="VRAM" if k.is_cuda else "DRAM",
            device_id=(k.device.index or 0) if k.is_cuda else 0,
            page_size=pool.page_size,
            dtype=str(k.dtype).removeprefix("torch."),
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> PoolLayout:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})

    def mismatch(self, other: PoolLayout) -> str | None:
        """Why pages cannot move between the two pools, or None."""
        for name in ("num_layers", "page_bytes", "page_size", "dtype"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} differs: {getattr(self, name)} here, {getattr(other, name)} there"
        return None

    def page_descriptors(self, runs: list[tuple[int, int]]) -> np.ndarray:
        """``(address, bytes, device)`` rows for runs ``(first page, pages)``: per run, each
        layer's K span then its V span, in that order on both sides of a transfer."""
        rows = []
        layer_bytes = self.num_pages * self.page_bytes
        for first, count in runs:
            for base in (self.k_address, self.v_address):
                start = base + first * self.page_bytes
                rows.extend((start + layer * layer_bytes, count * self.page_bytes, self.device_id)
                            for layer in range(self.num_layers))  # fmt: skip
        return np.array(rows, dtype=np.uint64).reshape(-1, 3)

    def stamp_descriptors(self, pages: list[int]) -> np.ndarray:
        return stamp_rows(self.stamps_address, pages)


def stamp_rows(address: int, indices) -> np.ndarray:
    """``(address, bytes, device)`` rows of the int64 stamps at ``indices`` of an array in
    host memory at ``address``."""
    rows = np.zeros((len(indices), 3), dtype=np.uint64)
    rows[:, 0] = address + 8 * np.asarray(indices, dtype=np.uint64)
    rows[:, 1] = 8
    return rows


def page_runs(source: list[int], target: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Pairs of pages cut into runs consecutive on both sides: ``(first, count)`` lists of
    equal length for the source and the target."""
    if len(source) != len(target):
        raise ValueError(f"{len(source)} source pages for {len(target)} target pages")
    src_runs: list[tuple[int, int]] = []
    dst_runs: list[tuple[int, int]] = []
    for i, (s, d) in enumerate(zip(source, target)):
        if i and s == source[i - 1] + 1 and d == target[i - 1] + 1:
            src_runs[-1] = (src_runs[-1][0], src_runs[-1][1] + 1)
            dst_runs[-1] = (dst_runs[-1][0], dst_runs[-1][1] + 1)
        else:
            src_runs.append((s, 1))
            dst_runs.append((d, 1))
    return src_runs, dst_runs
