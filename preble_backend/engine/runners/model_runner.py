"""Turns a scheduled batch into one forward pass: flat token ids, positions, slot mapping,
page tables; returns the logits of the requests that sample this iteration."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from pathlib import Path

import torch

from preble_backend.engine.runners.tp_ranks import Group, RankLost, Ranks, check_devices, rank_device
from preble_backend.engine.scheduling.local_scheduler import ScheduledBatch
from preble_backend.kv_transfer.rank_transport import follower_reads, join_store, stop_follower
from preble_backend.model.attention import AttentionBatch, shared_prefix_groups
from preble_backend.model.attention_backends import make_attention_backend
from preble_backend.model.decode_graphs import DecodeGraphs
from preble_backend.model.kv_pool import KVPool
from preble_backend.model.llama import LlamaForCausalLM
from preble_backend.model.model_config import ModelConfig
from preble_backend.model.tensor_parallel import TPGroup, head_split

log = logging.getLogger("preble.engine")


@functools.cache
def device_facts(device: torch.device) -> dict[str, str]:
    """The device, as an engine reports it; a GPU's also by its UUID, NVML's name for it
    whatever ``CUDA_VISIBLE_DEVICES`` renumbered (the router samples it by that). Found
    once per device, not on every report; callers copy it (``**``), never change it."""
    facts = {"device": str(device)}
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None) if device.type == "cuda" else None
    if uuid is not None:
        facts["gpu_uuid"] = f"GPU-{uuid}"
    return facts


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: fp32 on CPU (bf16 matmuls there are slow and lossy), bf16 on CUDA."""
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {name!r}")
    return table[name]


class ModelRunner:
    """``tensor_parallel_size`` > 1: this process is rank 0 and starts the other ranks
    (``tp_ranks.py``), which hold the rest of the model and follow each forward pass.
    ``graph_batch``: decode batches up to this size replay CUDA graphs (``decode_graphs``),
    captured with the device's KV pool; on CUDA at one rank with a backend that can be
    captured, else every pass runs eagerly."""

    def __init__(self, model_path: str | Path, dtype: str, device: str, attention_backend: str,
                 tensor_parallel_size: int = 1, group: Group | None = None,
                 graph_batch: int = 0) -> None:  # fmt: skip
        rank = group.rank if group is not None else 0
        self.device = torch.device(rank_device(device, rank))
        self.dtype = resolve_dtype(dtype, self.device)
        self.ranks = None
        if tensor_parallel_size > 1 and group is None:  # rank 0: it starts the others
            check_devices(device, tensor_parallel_size)
            head_split(ModelConfig.from_dir(model_path), tensor_parallel_size, 0)  # heads that divide
            args = (str(model_path), dtype, device, attention_backend)
            self.ranks = Ranks(tensor_parallel_size, device, follow, args)
            group = self.ranks.group
        tp = TPGroup(rank, tensor_parallel_size, group) if tensor_parallel_size > 1 else None
        self.model = LlamaForCausalLM.from_pretrained(model_path, self.dtype, self.device, tp)
        self.cfg = self.model.cfg
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads  # this rank's
        self.backend = make_attention_backend(attention_backend, self.device)
        if self.backend.name == "flashinfer" and (any(self.cfg.layer_windows) or self.cfg.attn_scale
                                                  or self.cfg.attention_sinks):  # fmt: skip
            raise ValueError("attention_backend 'flashinfer' does not run sliding-window layers, attention "
                             f"sinks or a score scale of the model's own yet ({self.cfg.architecture} has "
                             "them): use 'triton'")  # fmt: skip
        self.graph_batch = graph_batch if tensor_parallel_size == 1 and self.device.type == "cuda" else 0
        self.graphs: DecodeGraphs | None = None

    def make_pool(self, num_pages: int, page_size: int, host: bool = False, window_pages: int = 0) -> KVPool:
        """The device's KV pool, or (``host``) the host tier's: in host memory, pinned when
        the device is a GPU (the engine refuses a host tier with more ranks than one, or
        with sliding layers). A model with sliding layers keeps theirs in a window pool of
        ``window_pages`` (``kv_pool.py``), and the device pool only the full layers'."""
        if self.ranks is not None:
            self.ranks.send(("pool", num_pages, page_size, host, window_pages))
        cfg, gpu = self.cfg, self.device.type == "cuda"
        sliding = self.num_sliding_layers
        kv = (self.num_kv_heads, cfg.head_dim, self.dtype, "cpu" if host else self.device)
        pool = KVPool(num_pages, page_size, cfg.num_layers - sliding, *kv, pin_memory=host and gpu)
        if sliding and not host:
            pool.add_window(KVPool(window_pages, page_size, sliding, *kv), cfg.sliding_window)
        if self.graph_batch and self.backend.capturable and not host:
            self.use_decode_graphs(pool, self.graph_batch)
        return pool

    @property
    def num_sliding_layers(self) -> int:
        return sum(w is not None for w in self.cfg.layer_windows)

    def use_decode_graphs(self, pool: KVPool, max_batch: int, capture: bool = True) -> None:
        """Serve decode batches up to ``max_batch`` through ``DecodeGraphs`` over ``pool``,
        for the longest context the model and pool allow; without ``capture`` (the CPU:
        tests, the benchmark's smoke run) the same buffers run eagerly. A capture that fails
        leaves the engine serving eagerly, said in the log: the graphs are an optimization,
        and a lent GPU's minutes are better spent measuring the stack than watching it
        refuse to load (the engine's stats have no ``decode_graph_steps`` then)."""
        longest = min(self.cfg.max_context, pool.capacity_tokens)
        try:
            self.graphs = DecodeGraphs(self.model, self.backend, pool, max_batch, longest, capture)
        except Exception as exc:  # noqa: BLE001 - any failure to capture falls back to eager
            self.graphs = None
            log.error("decode runs eagerly: capturing its CUDA graphs failed (%s: %s); "
                      "cuda_graph_max_batch = 0 skips the capture", type(exc).__name__, exc)  # fmt: skip

    def kv_bytes_per_token(self, sliding: bool | None = None) -> int:
        """This rank's: its KV heads only; of every layer, or (``sliding``) of the sliding
        or the full layers alone."""
        cfg, n = self.cfg, self.cfg.num_layers
        if sliding is not None:
            n = self.num_sliding_layers if sliding else n - self.num_sliding_layers
        return 2 * n * self.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    def move_kv_slices(self, name: str, lanes: int, net_devices: str) -> int | None:
        """On the engine's thread: tell the other ranks to serve KV reads of their slices
        (``rank_transport.py``); the rendezvous port they are told through, or None at
        one rank."""
        if self.ranks is None:
            return None
        self.ranks.send(("kv_transfer", name, lanes, net_devices))
        return self.ranks.port

    def went_idle(self) -> None:
        """The engine ran out of work (an emulated device stops overlapping; this one has
        nothing to do)."""

    def stats(self) -> dict[str, float]:
        return {} if self.graphs is None else {"decode_graph_steps": self.graphs.replays}

    def graph_replays(self) -> int:
        """Decode passes that replayed a CUDA graph so far (their cost is told apart)."""
        return 0 if self.graphs is None else self.graphs.replays

    def close(self) -> None:
        """Stop the other ranks (a single-device runner has none)."""
        if self.ranks is not None:
            self.ranks.close()

    def forward(self, batch: ScheduledBatch, pool: KVPool) -> tuple[torch.Tensor, list[int]]:
        """Logits for the requests whose whole sequence is computed after this pass, and
        their indices in ``batch``; the other ranks run the same pass without logits."""
        inputs, logit_rows, sampling = prepare(batch, pool, self.backend.min_shared_tokens)
        if self.ranks is None:
            return self.run(inputs, pool, logit_rows), sampling
        try:
            self.ranks.send(("forward", inputs))
            return self.run(inputs, pool, logit_rows), sampling
        except RuntimeError as exc:  # a collective failed: was it a rank that died?
            if (lost := self.ranks.lost()) is not None:
                raise RankLost(f"{lost}; the engine must be restarted") from exc
            raise

    def run(self, inputs: tuple, pool: KVPool, logit_rows: list[int]) -> torch.Tensor:
        ids, positions, attn = inputs
        dev = self.device
        if self.graphs is not None and self.graphs.accepts(attn):
            return self.graphs.run(ids, positions, attn)[logit_rows]
        attn = on_device(attn, dev)
        return self.model(ids.to(dev), positions.to(dev), attn, pool, self.backend,
                          torch.tensor(logit_rows, dtype=torch.long, device=dev))  # fmt: skip


def on_device(attn: AttentionBatch, dev: torch.device) -> AttentionBatch:
    window = None if attn.window is None else on_device(attn.window, dev)
    return dataclasses.replace(
        attn, slot_mapping=attn.slot_mapping.to(dev), page_table=attn.page_table.to(dev), window=window
    )


def prepare(batch: ScheduledBatch, pool: KVPool,
            min_shared_tokens: int | None) -> tuple[tuple, list[int], list[int]]:  # fmt: skip
    """The pass's inputs on the host (token ids, positions, the attention batch), the rows
    whose logits are sampled, and their requests' indices in ``batch``."""
    ps = pool.page_size
    ids, positions, slots, logit_rows, sampling = [], [], [], [], []
    offset = 0
    for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        start = req.num_computed
        ids.extend(req.tokens(start, start + n))
        pos = range(start, start + n)
        positions.extend(pos)
        slots.extend(req.page_table[p // ps] * ps + p % ps for p in pos)
        offset += n
        if start + n == req.num_tokens:
            logit_rows.append(offset - 1)
            sampling.append(i)
    reqs = batch.requests
    width = max(len(r.page_table) for r in reqs)
    table = torch.tensor([r.page_table + [0] * (width - len(r.page_table)) for r in reqs], dtype=torch.int32)
    groups = []
    if min_shared_tokens is not None and len(reqs) > 1:
        tree_pages = [r.page_table[: r.num_tree_pages] for r in reqs]
        groups = shared_prefix_groups(tree_pages, ps, min_shared_tokens)
    attn = AttentionBatch(
        q_lens=list(batch.num_new_tokens),
        prefix_lens=[r.num_computed for r in reqs],
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        page_table=table,
        page_size=ps,
        shared_prefixes=groups,
    )
    if pool.window is not None:
        attn.window = window_batch(attn, [r.page_table for r in reqs], slots, pool)
    inputs = (torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), attn)
    return inputs, logit_rows, sampling


def window_batch(
    attn: AttentionBatch, tables: list[list[int]], slots: list[int], pool: KVPool
) -> AttentionBatch:
    """``attn`` in the window pool's pages, for the sliding layers: each page translated,
    no shared prefixes (queries whose windows differ do not share one set of keys)."""
    ps, width, of = pool.page_size, attn.page_table.shape[1], pool.window_of
    rows = [pool.window_table(t) + [0] * (width - len(t)) for t in tables]
    written = [of[s // ps] for s in slots]
    if written and min(written) < 0:  # a new token's page always has its window page: a bug if not
        raise RuntimeError("a page written in this pass has no window page")
    mapping = torch.tensor([p * ps + s % ps for p, s in zip(written, slots)], dtype=torch.long)
    return dataclasses.replace(attn, slot_mapping=mapping,
                               page_table=torch.tensor(rows, dtype=torch.int32), shared_prefixes=[],
                               plan=None, sliding_plan=None)  # fmt: skip


def follow(rank: int, size: int, port: int, model_path: str, dtype: str, device: str,
           attention_backend: str) -> None:  # fmt: skip
    """A follower rank's life (in a process of its own): join the group, load its slice,
    then run every pass rank 0 sends until told to stop."""
    group = Group(rank, size, join_store(port, 120.0), device, timeout_s=120.0)
    runner = ModelRunner(model_path, dtype, device, attention_backend, size, group)
    pool, reads, at = None, None, [""]
    while (message := group.receive()) is not None:
        if message[0] == "pool":
            pool = runner.make_pool(*message[1:])
        elif message[0] == "kv_transfer":  # a prefill or decode engine: this rank moves its slice
            reads = threading.Thread(target=follower_reads, args=(rank, port, pool, *message[1:], at),
                                     daemon=True, name="preble-kv-rank")  # fmt: skip
            reads.start()
        else:
            runner.run(message[1], pool, [])
    if reads is not None and reads.is_alive():
        with contextlib.suppress(Exception):  # rank 0's store is gone: so is the thread's wait
            stop_follower(port, at)
        reads.join(timeout=5)
