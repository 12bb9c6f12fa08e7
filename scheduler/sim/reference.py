"""What any router could at best do with a cluster: the two references every policy's
numbers are read against (a table's "÷ reference" column), so that the gap left to any
router is visible and a policy is not tuned toward what no router can reach.

- **Perfect placement** (``reference``): the trace on one instance holding N instances'
  worth of everything: N× the KV capacity, N× the batch and chunk budgets
  (``max_running_requests``, ``chunk_size``), and every per-token and per-request cost
  divided by N, the per-iteration base kept. No request is ever on the wrong instance
  and no prefix is ever held twice, so it stands in for the best placement over N
  instances. It is an estimate, not a bound: one queue is ordered instead of N, and an
  iteration's base is paid once where N instances pay it side by side.
- **Lower bound** (``lower_bound``): each request alone on an idle instance of the
  cluster, with the longest prefix of its prompt that an earlier request left cached
  (whole pages, as the radix cache keeps them; an earlier request's named output counts,
  as a chat turn's answer is cached after it): its prompt in chunks of ``chunk_size``,
  then its decodes one by one, each iteration charged by the cost model. No schedule
  serves any request sooner, so no policy's average or percentile is below it (for a
  conversation's later turns, as far as the cache they find goes: they are placed at
  the earliest they could arrive).
"""

from __future__ import annotations

import dataclasses
import itertools

from preble_backend.common.block_hash import chain_hashes
from preble_backend.common.cost_model import CostModel
from scheduler.policy import RoundRobin
from scheduler.sim.simulator import RequestRecord, SimConfig, SimRequest, SimResult, metrics, simulate

REFERENCES = ("reference", "lower_bound")


def pooled(cfg: SimConfig, cost: CostModel) -> tuple[SimConfig, CostModel]:
    """The one instance that stands for the cluster under perfect placement."""
    n = cfg.num_instances
    host_tokens = cfg.engine.host_pages(cfg.capacity_tokens // cfg.page_size) * cfg.page_size
    engine = dataclasses.replace(cfg.engine, max_num_tokens=cfg.capacity_tokens * n,
                                 host_kv_tokens=host_tokens * n, host_kv_ratio=0.0,
                                 chunk_size=cfg.engine.chunk_size * n,
                                 max_running_requests=cfg.engine.max_running_requests * n)  # fmt: skip
    faster = dataclasses.replace(
        cost, prefill_ms_per_token=cost.prefill_ms_per_token / n,
        decode_ms_per_request=cost.decode_ms_per_request / n,
        attention_ms_per_context_token=cost.attention_ms_per_context_token / n,
        decode_step_ms=cost.decode_step_ms / n, load_ms_per_token=cost.load_ms_per_token / n,
        source=f"{cost.source} (pooled x{n})",
    )  # fmt: skip
    return SimConfig(1, engine), faster


def perfect_placement(requests: list[SimRequest], cfg: SimConfig, cost: CostModel) -> SimResult:
    one, faster = pooled(cfg, cost)
    return simulate(requests, lambda clock: RoundRobin(1, clock), one, faster)


def alone_ms(prompt_len: int, cached: int, output_len: int, chunk_size: int,
             cost: CostModel) -> tuple[float, float]:  # fmt: skip
    """(time to first token, latency) in milliseconds of one request alone on an idle
    instance, charged as the engine's scheduler batches it (``ScheduledBatch.work``):
    chunks of the uncached prompt (a chunk with one token left is a decode), then one
    decode per further output token over a context growing by one."""
    computed = min(cached, prompt_len - 1)  # the last prompt token is always computed: its logits
    ttft = 0.0
    while computed < prompt_len:
        left = prompt_len - computed
        n = min(chunk_size, left)
        if left == 1:
            ttft += cost.iteration_time(0, 1, computed + 1)
        else:
            ttft += cost.iteration_time(n, 0, computed + n)
        computed += n
    decodes = sum(cost.iteration_time(0, 1, prompt_len + j) for j in range(1, max(1, output_len)))
    return ttft, ttft + decodes


def lower_bound(requests: list[SimRequest], cfg: SimConfig, cost: CostModel) -> dict[str, float]:
    """Each request's latency alone with its longest earlier prefix cached, as ``metrics``
    reports a run (throughput and hit ratio of that ideal included). A conversation's
    next turn comes at the earliest it could: its predecessor's arrival, latency alone
    and think time; it finds cached what came before that."""
    import heapq

    page, order = cfg.page_size, itertools.count()
    followers: dict[str, list[SimRequest]] = {}
    for r in requests:
        if r.after is not None:
            followers.setdefault(r.after, []).append(r)
    due = [(r.arrival, next(order), r) for r in requests if r.after is None]
    heapq.heapify(due)
    seen: set[int] = set()  # the chain hash of every page an earlier request left cached
    result = SimResult()
    while due:
        arrival, _, req = heapq.heappop(due)
        prompt_len = len(req.input_ids)
        sequence = [*req.input_ids, *(req.output_ids or ())]  # a named answer is cached after its prompt
        chain = chain_hashes(sequence, page)
        prompt_pages = prompt_len // page
        pages = next((i for i, h in enumerate(chain[:prompt_pages]) if h not in seen), prompt_pages)
        first_ms, total_ms = alone_ms(prompt_len, pages * page, req.output_len, cfg.engine.chunk_size, cost)
        result.records[req.request_id] = RequestRecord(
            arrival, first_token=arrival + first_ms / 1000, finish=arrival + total_ms / 1000,
            prompt_len=prompt_len, cached_tokens=min(pages * page, prompt_len - 1), output_len=req.output_len,
        )  # fmt: skip
        seen.update(chain)
        for nxt in followers.pop(req.request_id, ()):
            heapq.heappush(due, (arrival + total_ms / 1000 + nxt.think_s, next(order), nxt))
    return metrics(result)


def reference_metrics(name: str, requests: list[SimRequest], cfg: SimConfig, cost: CostModel) -> dict:
    """``reference`` or ``lower_bound``, as a policy's run reports its metrics."""
    if name == "reference":
        return metrics(perfect_placement(requests, cfg, cost))
    if name == "lower_bound":
        return lower_bound(requests, cfg, cost)
    raise ValueError(f"{name!r} is not a reference: expected one of {', '.join(REFERENCES)}")


def over_reference(records: list[dict], key: str = "avg_latency_s") -> None:
    """Add ``÷ reference`` (``<key>_over_reference``) to each record: its ``key`` over the
    perfect-placement reference's at the same rate (1.0: as good as perfect placement)."""
    ref = {r["rps"]: r[key] for r in records if r["policy"] == "reference"}
    for r in records:
        if r["rps"] in ref and ref[r["rps"]] > 0:
            r[f"{key}_over_reference"] = r[key] / ref[r["rps"]]
