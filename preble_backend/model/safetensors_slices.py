"""A tensor-parallel rank's slice of a safetensors tensor, read with ``pread`` into memory
of its own rather than through a memory map.

Through a map, a column slice (a few bytes of every row: ``o_proj`` and ``down_proj`` at
TP N) faults in whole pages of every row, and the kernel maps the neighbouring pages
around each fault, so a rank's resident memory held far more of the file than its slice
(docs/benchmarks/engine.md, "Tensor parallelism: what a rank loads"). Read row by row, a rank's memory
grows by its slice and nothing else; the file's pages stay in the page cache, shared and
reclaimable, not mapped into the rank.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# What read_slice reads, by torch's name (torch is imported where a tensor is made: the
# model card reads headers here in processes that never load torch).
DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def read_header(path: Path) -> tuple[int, dict]:
    """Where the file's data begins, and its header: each tensor's dtype, shape and byte
    range within the data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


def read_slice(fd: int, data_start: int, entry: dict, dim: int, start: int, count: int) -> torch.Tensor:
    """``tensor[..., start:start + count, ...]`` along ``dim`` of the tensor ``entry``
    describes, from the open file ``fd``: one contiguous run per index of the dimensions
    before ``dim`` (one run for ``dim`` 0, one per row for a 2-D tensor's columns, one per
    expert for a stacked [experts, rows, cols] tensor's rows)."""
    import torch

    dtype, shape = getattr(torch, DTYPES[entry["dtype"]]), entry["shape"]
    item = torch.empty((), dtype=dtype).element_size()
    base = data_start + entry["data_offsets"][0]
    inner = math.prod(shape[dim + 1 :]) * item  # bytes per index of ``dim``
    run, stride = count * inner, shape[dim] * inner
    out = torch.empty((*shape[:dim], count, *shape[dim + 1 :]), dtype=dtype)
    spans = [(base + o * stride + start * inner, o * run, run) for o in range(math.prod(shape[:dim]))]
    _read_into(fd, out, spans)
    return out


def _read_into(fd: int, out: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
    """Fill ``out``'s bytes: each span is (file offset, offset in ``out``, length)."""
    import torch

    view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
    for offset, at, length in spans:
        done = 0
        while done < length:  # pread may return less than asked
            n = os.preadv(fd, [view[at + done : at + length]], offset + done)
            if n <= 0:
                raise OSError(f"safetensors file ended {length - done} bytes short of a tensor")
            done += n
