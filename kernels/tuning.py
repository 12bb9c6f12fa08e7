"""Block sizes per GPU generation, in one explicit table (as SGLang keeps them).

Keys are CUDA compute capabilities; ``interpreter`` is for ``TRITON_INTERPRET=1`` on the CPU,
where small tiles keep the tests fast. A head dimension above 128 halves the KV block so
the K and V tiles still fit in shared memory. Plain prefill chunks may also have a tile per
shape (``EXTEND_TILES``: generation, head dimension, chunk class), chosen per shape by
``python -m kernels.sweep``; a shape with no row takes its generation's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Blocks:
    extend_m: int  # query rows (token x head-in-group) per extend tile
    extend_n: int  # KV positions per extend step
    decode_n: int  # KV positions per decode step
    num_warps: int  # the extend kernel's over shared prefixes (cascade) and fp32 tiles
    chunk_warps: int  # the extend kernel's over plain 16-bit prefill chunks
    num_stages: int
    sm_count: int  # used to pick the decode split count


TABLE: dict[str, Blocks] = {  # extend_m, extend_n, decode_n, num_warps, chunk_warps, num_stages, sm_count
    # sm90's chunk_warps measured by ``python -m kernels.sweep`` on an H100 (2026-11-25): 4 warps
    # beat 8 by 17% on chunked prefill, but slowed cascade's shared-prefix pass 3.4x -> 2.7x.
    "sm90": Blocks(128, 64, 64, 8, 4, 3, 132),
    "sm89": Blocks(64, 64, 64, 4, 4, 2, 128),
    "sm80": Blocks(128, 64, 64, 8, 8, 3, 108),
    "default": Blocks(64, 32, 32, 4, 4, 2, 80),
    "interpreter": Blocks(16, 16, 16, 1, 1, 1, 4),
}


@dataclass(frozen=True)
class ExtendTile:
    extend_m: int
    extend_n: int
    warps: int
    stages: int


def chunk_class(max_q_len: int) -> str:
    """A launch's longest chunk, in the classes the sweep measures apart: decode-heavy
    batches and short chunks, mid-sized chunks, and long prefills."""
    return "short" if max_q_len <= 128 else "medium" if max_q_len <= 1024 else "long"


# (generation, head dim, chunk class) -> the plain 16-bit chunk's tile, as ``kernels.sweep``
# printed it on that generation's card. Empty until a lent GPU runs the sweep per shape
# (the one H100 sweep, 2026-11-25, chose one row for all shapes: TABLE's sm90).
EXTEND_TILES: dict[tuple[str, int, str], ExtendTile] = {}


def generation(device: torch.device) -> str:
    """``TABLE``'s key for ``device``."""
    if interpreting() or device.type != "cuda":
        return "interpreter"
    major, minor = torch.cuda.get_device_capability(device)
    key = f"sm{major}{minor}"
    return key if key in TABLE else "sm90" if major >= 9 else "sm80" if major == 8 else "default"


def chunk_tile(device: torch.device, head_dim: int, max_q_len: int, upcast: bool) -> ExtendTile:
    """The tile for plain prefill chunks: the shape's own row where the sweep chose one,
    else the generation's (``chunk_warps`` for 16-bit tiles, ``num_warps`` for fp32)."""
    tile = EXTEND_TILES.get((generation(device), head_dim, chunk_class(max_q_len)))
    if tile is not None:
        return tile
    blocks = blocks_for(device, head_dim)
    warps = blocks.num_warps if upcast else blocks.chunk_warps
    return ExtendTile(blocks.extend_m, blocks.extend_n, warps, blocks.num_stages)


@dataclass(frozen=True)
class MoEBlocks:
    m: int  # (token, expert) rows per tile: each expert's rows are padded to a multiple
    n: int  # output features per tile
    k: int  # reduction step
    warps: int
    stages: int


# The fused MoE kernel's tiles. Not yet swept on any GPU: sm90 and sm80 start from the
# sizes vLLM's fused_moe uses where it has no tuned config (M 64, N 64-128, K 32-64).
MOE_TABLE: dict[str, MoEBlocks] = {
    "sm90": MoEBlocks(64, 128, 64, 4, 3),
    "sm89": MoEBlocks(64, 64, 32, 4, 2),
    "sm80": MoEBlocks(64, 64, 32, 4, 3),
    "default": MoEBlocks(32, 64, 32, 4, 2),
    "interpreter": MoEBlocks(16, 16, 16, 1, 1),
}


def moe_blocks_for(device: torch.device) -> MoEBlocks:
    return MOE_TABLE[generation(device)]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def blocks_for(device: torch.device, head_dim: int) -> Blocks:
    key = generation(device)
    if key == "interpreter":
        return TABLE[key]
    blocks = TABLE[key]
    if head_dim > 128:
        blocks = replace(blocks, extend_n=blocks.extend_n // 2, decode_n=blocks.decode_n // 2, num_stages=2)
    # The real SM count beats the table's guess (an H100 PCIe has 114, not 132).
    return replace(blocks, sm_count=torch.cuda.get_device_properties(device).multi_processor_count)


def upcast_loads(dtype: torch.dtype) -> bool:
    """Convert every loaded tile to fp32: always under the interpreter (it computes bf16
    wrongly and silently), and for fp32 data; on a GPU, fp16/bf16 tiles stay narrow so
    ``tl.dot`` runs on tensor cores with fp32 accumulation."""
    return interpreting() or dtype == torch.float32
