"""What an engine's prefix cache reports so a global scheduler can mirror it exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from preble_backend.common.block_hash import chain_hashes


@dataclass(frozen=True)
class CacheEvent:
    """Pages ``start`` onwards of a path from the root were stored in, or evicted from, the
    cache; the pages before ``start`` stay cached above them. The path is named by its page
    chain hashes (``block_hash``), the currency the global scheduler matches prompts in."""

    kind: Literal["stored", "evicted"]
    hashes: tuple[int, ...]  # chain hash of every page of the path, root first
    start: int  # first page of the span

    @classmethod
    def of(cls, kind: Literal["stored", "evicted"], tokens, start: int, page_size: int) -> CacheEvent:
        """The event for ``tokens[start:]`` (``start`` in tokens, page-aligned)."""
        return cls(kind, tuple(chain_hashes(tokens, page_size)), start // page_size)
