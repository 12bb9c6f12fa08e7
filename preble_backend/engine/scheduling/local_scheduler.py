"""The paper's local scheduler (§4.3): iteration-level batches with chunked prefill.

Each iteration gets a token budget (``chunk_size``, Sarathi-style). Running requests go
first, oldest first: a decode costs one token, an unfinished prefill takes the next chunk
that fits. A request whose prompt's KV was received from a prefill instance (P/D) and
lacks at most a page of it is admitted next, ahead of the wait queue: its prefill ran
elsewhere, and a running chunked prefill that took the whole budget held it for that
prefill's length (up to a second per 30k-token document, where its first token had been
priced at milliseconds). Then waiting requests are admitted from the priority wait queue
while budget, pages (for the whole prompt) and the running cap allow; one whose prefix
comes back from the host tier while others are in the batch is loaded beside their pass
and computes from the next. When pages run out, unreferenced cache is evicted (what
waiting requests would reuse last); if that is not enough, the newest running request is
preempted: its computed pages go to the cache, and it waits at the front of its group to
be recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import takewhile

from preble_backend.common.fair_share import TenantShares
from preble_backend.engine.cache.host_tier import HostTier
from preble_backend.engine.cache.radix_cache import RadixCache
from preble_backend.engine.cache.sliding_windows import SlidingWindows
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.scheduling.block_manager import BlockManager
from preble_backend.engine.scheduling.fair_queue import FairWaitQueue, fair_victim
from preble_backend.engine.scheduling.priority_queue import PriorityWaitQueue
from preble_backend.engine.scheduling.request import Request, Status
from preble_backend.model.kv_pool import KVPool

MAX_TOUCHED = 128  # waiting requests whose prefixes an eviction spares, the first in line


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    loaded_tokens: int = 0  # brought back from the host tier to form it
    offloaded_tokens: int = 0  # copied down to the host tier by the evictions that formed it
    copied_ahead_tokens: int = 0  # copied down beside its forward pass, ahead of their eviction
    loaded_beside_tokens: int = 0  # brought back beside its forward pass, for requests in the next

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)

    def drop(self, req: Request) -> int:
        i = self.requests.index(req)
        self.requests.pop(i)
        return self.num_new_tokens.pop(i)

    def work(self) -> tuple[int, int, int, int, int]:
        """(prefill tokens, decodes, context tokens, tokens copied between tiers, tokens
        copied beside): what the cost model charges for this iteration. A request with one
        token left to compute is decoding; the engine waits for the copies both ways that
        formed the batch, while the copies ahead and the loads for the next batch run
        beside the forward pass (one side stream)."""
        prefill = decodes = context = 0
        for req, n in zip(self.requests, self.num_new_tokens):
            if req.num_uncomputed == 1:
                decodes += 1
            else:
                prefill += n
            context += req.num_computed + n
        beside = self.copied_ahead_tokens + self.loaded_beside_tokens
        return prefill, decodes, context, self.loaded_tokens + self.offloaded_tokens, beside


@dataclass
class SchedulerStats:
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    num_preemptions: int = 0


class LocalScheduler:
    def __init__(
        self,
        blocks: BlockManager,
        waiting: PriorityWaitQueue,
        chunk_size: int,
        max_running_requests: int,
        copy_ahead: bool = False,
        shares: TenantShares | None = None,
        source: str = "local",
    ) -> None:
        self.blocks = blocks
        self.waiting = waiting
        self.shares, self.source = shares, source  # fair shares: what each tenant was served here
        self.running: list[Request] = []  # in admission order
        self.chunk_size = chunk_size
        self.max_running = max_running_requests
        self.copy_ahead = KVPool.pages_for(chunk_size, blocks.page_size) if copy_ahead else 0
        self.stats = SchedulerStats()
        self.ready: list[Request] = []  # waiting received requests that lack at most a page
        self._waiting_touched = False
        blocks.before_evict = self._keep_waiting_prefixes

    def add(self, req: Request, front: bool = False) -> None:
        cache = self.blocks.cache
        cached = cache.cached_len(req.tokens(0, req.num_tokens)) if cache is not None else 0
        req.status = Status.WAITING
        self.waiting.push(req, self.waiting.group_for(cached, req.num_tokens), front=front)
        if req.received and req.num_tokens - cached <= self.blocks.page_size:
            self.ready.append(req)
        if req.received and cache is not None and req.num_cached_tokens is None:  # never admitted yet
            self._hold(req)

    def _hold(self, req: Request) -> None:
        """Lock a received prompt's cached pages until the request is first admitted, as
        vLLM's decode side holds the blocks a transfer filled: evictable while it waited for
        room, they went to other prompts and were computed here again (Llama-3-70B on 1
        prefill + 1 decode instance, chat: 9% of moved prompts recomputed; goodput 0.63 ->
        0.91 with them held; docs/benchmarks/disagg.md). Not on a preempted request's
        return: its pages were let go to make room."""
        _, node = self.blocks.cache.match_prefix(req.tokens(0, req.num_tokens - 1))
        self.blocks.cache.lock(node)
        req.held_node = node

    def _let_go(self, req: Request) -> None:
        if req.held_node is not None:
            self.blocks.cache.unlock(req.held_node)
            req.held_node = None

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._waiting_touched = False
        self.blocks.join_loads()  # this pass may read what came up beside the last
        before = self.blocks.tier_traffic()
        budget = self.chunk_size
        room = min(len(self.ready), max(0, self.max_running - len(self.running)))
        kept = min(room * self.blocks.page_size, budget // 2)  # the ready ones' part, from prefills
        first, later = self._prefill_order()
        for req in first:
            budget = self._compute(batch, req, budget, kept)
        if room:
            budget = self._admit(batch, budget, list(self.ready))
        if later:  # the tenants ahead of them admit first, then their chunks, then the rest
            behind = {r.tenant for r in later}
            ahead = takewhile(lambda r: self.shares.order({r.tenant} | behind)[0] not in behind,
                              self.waiting.candidates())  # fmt: skip
            budget = self._admit(batch, budget, ahead)
            for req in later:
                budget = self._compute(batch, req, budget, 0)
        self._admit(batch, budget, self.waiting.candidates())
        if not batch and not self.running and any(r.held_node is not None for r in self.waiting):
            for req in list(self.waiting):  # held pages leave no room for any of them: let go
                self._let_go(req)
            return self.schedule()
        after = self.blocks.tier_traffic()
        batch.loaded_tokens = after[0] - before[0] - batch.loaded_beside_tokens
        batch.offloaded_tokens = after[1] - before[1]
        if batch:
            batch.copied_ahead_tokens = self.blocks.copy_ahead(self.copy_ahead)
            if batch.loaded_beside_tokens:
                self.blocks.join_loads(batch.requests)  # one of them shares a prefix coming up
        return batch

    def _prefill_order(self) -> tuple[list[Request], list[Request]]:
        """The running requests to compute before admitting, and those after. Without fair
        shares: all before, oldest first. With them, the prefill budget follows the shares
        as admission does: running requests by their tenant's service (least per weight
        first, oldest first within a tenant), and the prefill chunks of tenants served more
        than the tenant next to admit wait until the tenants ahead of them are admitted
        (and no longer: admitting heavier tenants' prompts before them left more prompts
        half computed, holding pages, and cost ~1% of throughput at stress). A light tenant's prompt is
        not held behind a heavy tenant's running prefills (its TTFT was ~1.8x alone
        with a flood); decodes are one token and always run. Other rules for the wait
        queue (the simulator's anchors: ``orders_passes`` false) order admissions only."""
        running = list(self.running)
        if not running or not self.waiting.orders_passes:
            return running, []
        head = self.waiting.turn_order()[:1] if len(self.waiting) else []
        tenants = {r.tenant for r in running} | set(head)
        if len(tenants) == 1:  # one tenant (the usual case): the paper's order, nothing to rank
            return running, []
        rank = {t: i for i, t in enumerate(self.shares.order(tenants))}
        running.sort(key=lambda r: rank[r.tenant])  # stable: oldest first within a tenant
        ahead = rank[head[0]] if head else len(rank)
        first, later = [], []
        for r in running:
            (later if r.num_uncomputed > 1 and rank[r.tenant] > ahead else first).append(r)
        return first, later

    def _compute(self, batch: ScheduledBatch, req: Request, budget: int, kept: int) -> int:
        """Put a running request's next tokens into ``batch`` (a decode always, a prefill
        chunk as the budget less ``kept`` allows), preempting the newest running request
        while its pages do not fit; returns the budget left."""
        if req.status is not Status.RUNNING:
            return budget  # preempted earlier in this pass
        n = 1 if req.num_uncomputed == 1 else min(req.num_uncomputed, budget - kept)
        if n <= 0:
            return budget
        while not self.blocks.reserve(req, n):
            victim = self.running[-1]
            if victim in batch.requests:
                budget += batch.drop(victim)
            self._preempt(victim)
            if victim is req:
                break
        if req.status is Status.RUNNING:
            batch.add(req, n)
            budget -= n
        return budget

    def _admit(self, batch: ScheduledBatch, budget: int, candidates: Iterable[Request]) -> int:
        """Admit ``candidates`` in order until one cannot be; returns the budget left. One
        is admitted only when its whole prompt fits (free pages and evictable cache) beside
        what the running requests still need for theirs, as SGLang admits: admitted on its
        first chunk's pages alone, prompts ran the pool dry halfway at overload and
        preempted one another, recomputing 4-10% of the prompt tokens computed (the
        simulator's tenant mix at stress)."""
        made_room, owed = False, None
        for req in candidates:
            if budget <= 0:
                return budget
            if owed is None:  # counted once a candidate gets here: not on passes that admit none
                owed = sum(self._prompt_pages_owed(r) for r in self.running)
            if len(self.running) >= self.max_running:  # fair shares: a tenant under its share of slots
                fair = self.shares is not None and not made_room  # takes one, at most one per pass
                victim = fair_victim(self.shares, req, self.running, self.max_running) if fair else None
                if victim is None:
                    return budget
                if victim in batch.requests:
                    budget += batch.drop(victim)
                self._preempt(victim)
                made_room = True
            # while others run, a prefix on the host waits for room to come back whole; when
            # others are in this batch it comes up beside their pass, and the request joins
            # the next one
            beside = bool(batch)
            loaded = self.blocks.tier_traffic()[0]
            cached = self.blocks.admit(req, budget, wait=bool(self.running), beside=beside, owed=owed)
            if cached is None:
                return budget
            loaded = self.blocks.tier_traffic()[0] - loaded
            if beside:
                batch.loaded_beside_tokens += loaded
            n = min(req.num_uncomputed, budget)
            fits = not self.running or owed + self._prompt_pages_owed(req) <= self.blocks.room()
            if not fits or not self.blocks.reserve(req, n):
                self.blocks.release(req)
                return budget
            owed += self._prompt_pages_owed(req)
            self.waiting.take(req)
            self._let_go(req)  # its own lock holds the prefix now
            if req in self.ready:
                self.ready.remove(req)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = min(cached, len(req.prompt_ids))
                req.admitted = time.monotonic()
                if self.shares is not None:  # its prompt's cost is committed now: charged now
                    computed = len(req.prompt_ids) - req.num_cached_tokens
                    self.shares.charge(
                        req.tenant, self.source, computed=computed, cached=req.num_cached_tokens
                    )
            self.stats.prompt_tokens_cached += min(cached, len(req.prompt_ids))
            req.status = Status.RUNNING
            self.running.append(req)
            if beside and loaded:
                continue
            batch.add(req, n)
            budget -= n
        return budget

    def _prompt_pages_owed(self, req: Request) -> int:
        """The pages ``req`` still needs beyond those it holds for the tokens it has (its
        prompt, and a resumed request's output so far)."""
        return max(0, KVPool.pages_for(req.num_tokens, self.blocks.page_size) - len(req.page_table))

    def _keep_waiting_prefixes(self) -> None:
        """Before an iteration's first eviction, mark the cached prefixes of the requests
        waiting here as just used (the highest priority group last), so LRU eviction takes
        what nobody waits for first. Without it a running chunked prefill, which takes the
        whole token budget while it runs, evicted the document the requests queued behind
        it were routed here to reuse (LooGLE with two documents' worth of KV: half the
        requests E2 sent to a holder missed). SGLang's scheduler touches them the same way
        when it matches its waiting queue each step; like it, at most ``MAX_TOUCHED``."""
        if self._waiting_touched or self.blocks.cache is None:
            return
        self._waiting_touched = True
        for req in list(self.waiting)[-MAX_TOUCHED:]:
            self.blocks.cache.touch(req.tokens(0, req.num_tokens - 1))

    def advance(self, batch: ScheduledBatch) -> None:
        """Account for an iteration that computed ``batch``; share finished prefill pages."""
        for req, n in zip(batch.requests, batch.num_new_tokens):
            p = len(req.prompt_ids)
            self.stats.prompt_tokens_computed += min(req.num_computed + n, p) - min(req.num_computed, p)
            if self.shares is not None:  # output tokens, as their KV is computed
                output = max(0, req.num_computed + n - p) - max(0, req.num_computed - p)
                self.shares.charge(req.tenant, self.source, output=output)
            req.num_computed += n
            if n > 1:
                self.blocks.share_computed(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.release(req)
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.add(req, front=True)

    def finish(self, req: Request) -> None:
        """Release a running or waiting request (finished or aborted)."""
        if req in self.running:
            self.running.remove(req)
            self.blocks.release(req)
        else:
            self.waiting.remove(req)
            self._let_go(req)
            if req in self.ready:
                self.ready.remove(req)
        req.status = Status.FINISHED


def make_local_scheduler(
    pool: KVPool, config: EngineConfig, host_pool: KVPool | None = None,
    shares: TenantShares | None = None, source: str = "local",
) -> LocalScheduler:  # fmt: skip
    """The local scheduler an engine with ``config`` runs over ``pool`` (and ``host_pool``,
    its host tier, if it has one). The engine and the simulator both build it here, so a
    simulated instance schedules as a real one does. With ``fair_share``, tenants are
    admitted by ``shares`` (a counter of its own when None), this engine counted as
    ``source``."""
    host = HostTier(pool, host_pool) if host_pool is not None else None
    windows = SlidingWindows(pool, pool.window_tokens) if pool.window is not None else None
    cache = RadixCache(config.page_size, host, windows) if config.enable_prefix_caching else None
    shares = (shares or TenantShares()) if config.fair_share else None
    waiting = (FairWaitQueue(shares, config.priority_groups, config.priority_quota) if shares is not None
               else PriorityWaitQueue(config.priority_groups, config.priority_quota))  # fmt: skip
    return LocalScheduler(BlockManager(pool, cache, windows), waiting, config.chunk_size,
                          config.max_running_requests, config.host_copy_ahead, shares, source)  # fmt: skip
