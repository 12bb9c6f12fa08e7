"""E2 (Algorithms 1 and 2), rebalancing, autoscaling and the baselines, with every expected
choice computed by hand from a cost model where PREFILLTIME(n) = n ms and
DECODETIME(n) = n ms (so a request's history load is its missed tokens + 32). Pages are one
token here, so prefixes match token by token as in the paper. These tests price load as
Algorithm 2 does (``load_model="serial"``); the batch load model, E2's default, has its
own in ``test_e2_batch.py``."""

from __future__ import annotations

import pytest

from preble_backend.common.block_hash import chain_hashes
from preble_backend.common.cache_event import CacheEvent
from preble_backend.common.cost_model import CostModel
from preble_backend.common.sampling_params import SamplingParams
from scheduler.e2 import E2
from scheduler.global_tree import GlobalPrefixTree
from scheduler.policies import make_policy
from scheduler.policy import FinishInfo, InstanceLoad, RoutingRequest
from scheduler.sim.bench_decisions import bench_isolated

UNIT = CostModel(base_ms=0, prefill_ms_per_token=1, decode_ms_per_request=0,
                 attention_ms_per_context_token=0, decode_step_ms=1)  # fmt: skip
AVG_DECODE = 32  # E2's default decode length before any request finished


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def e2(n=2, capacity=10_000, cost=UNIT, load_model="serial", **kw) -> tuple[E2, Clock]:
    clock = Clock()
    kw.update(cost_model=cost, capacity_tokens=capacity, clock=clock, page_size=1, load_model=load_model)
    return E2(n, **kw), clock


_ids = iter(range(10**6))


def req(tokens) -> RoutingRequest:
    return RoutingRequest(f"r{next(_ids)}", list(tokens), SamplingParams())


def route(policy, tokens, n=2):
    r = req(tokens)
    return r, policy.select(r, [InstanceLoad() for _ in range(n)])


X = list(range(1000, 1040))  # a 40-token shared prefix


def test_explore_on_an_empty_cluster_ties_to_the_first_instance():
    policy, _ = e2()
    _, d = route(policy, range(100))
    assert (d.instance, d.branch) == (0, "explore")  # L = M = 0, P = 100 on both


def stored(tokens) -> FinishInfo:
    """A finish report whose engine cached the whole prompt."""
    return FinishInfo([CacheEvent.of("stored", list(tokens), 0, 1)], {}, 0.1, AVG_DECODE)


def test_exploit_when_more_is_cached_than_missed():
    policy, _ = e2()
    r, _ = route(policy, range(100))
    policy.on_finish(0, r, stored(range(100)))
    _, d = route(policy, list(range(90)) + [7] * 10)  # 90 cached > 10 missed
    assert (d.instance, d.branch) == (0, "exploit")
    _, d = route(policy, list(range(40)) + [8] * 60)  # 40 cached < 60 missed
    assert d.branch == "explore"


def test_cached_equal_to_missed_explores_as_the_paper_says():
    """§4.2: exploit when the tokens saved are *larger than* the new computation; a tie
    is not larger, so it explores (docs/SCHEDULER.md on the pseudocode's other test)."""
    policy, _ = e2(th_bal=float("inf"))
    r, _ = route(policy, range(100))
    policy.on_finish(0, r, stored(range(100)))
    _, d = route(policy, list(range(50)) + [9] * 50)  # 50 cached == 50 missed
    assert d.branch.startswith("explore")
    _, d = route(policy, list(range(51)) + [9] * 49)  # 51 cached > 49 missed
    assert (d.instance, d.branch) == (0, "exploit")


def test_explore_picks_the_lowest_l_plus_m_plus_p():
    policy, clock = e2()
    route(policy, range(100))  # instance 0: L = 100 + 32
    m = policy.tree.match(chain_hashes(range(500, 550), 1))
    assert policy.load_cost(0, m, 50, clock()) == 132 + 0 + 50
    assert policy.load_cost(1, m, 50, clock()) == 0 + 0 + 50
    _, d = route(policy, range(500, 550))
    assert (d.instance, d.branch) == (1, "explore")


def test_memory_cost_charges_what_a_virtual_eviction_removes():
    # Capacity 120 tokens. Instance 0 caches A (100 tokens), used by two requests within W;
    # instance 1 caches E (100 tokens), used by one; all have finished. A new 50-token
    # request needs 30 tokens freed on either, which evicts the whole 100-token node.
    policy, clock = e2(capacity=120)
    a, e = list(range(100)), list(range(200, 300))
    done = [route(policy, a), route(policy, e), route(policy, a)]  # explore 0, explore 1, exploit 0
    for r, d in done:
        policy.on_finish(d.instance, r, stored(r.input_ids))
    d_tokens = list(range(400, 450))
    m = policy.tree.match(chain_hashes(d_tokens, 1))
    l0, l1 = (policy.load(i, clock(), "in_flight") for i in (0, 1))
    assert (l0, l1) == (0, 0)  # nothing in flight
    assert policy.load_cost(0, m, 50, clock()) == 0 + 100 * 2 + 50
    assert policy.load_cost(1, m, 50, clock()) == 0 + 100 * 1 + 50
    _, d = route(policy, d_tokens)
    assert (d.instance, d.branch) == (1, "explore")


def test_memory_cost_spares_what_running_requests_hold():
    """The engine never evicts pages a running request holds, so neither does M: an
    instance busy with a long request is charged only for what it could really evict."""
    policy, clock = e2(capacity=90)
    running, _ = route(policy, range(100))  # explore -> 0, still running
    old, d = route(policy, range(200, 240))  # explore -> 1
    policy.on_finish(d.instance, old, stored(old.input_ids))
    policy.tree.apply_events(0, [CacheEvent.of("stored", list(range(100)), 0, 1)])  # prefilled
    m = policy.tree.match(chain_hashes(range(500, 560), 1))  # 60 new tokens: both must evict
    assert policy.tree.held_tokens == [100, 40]
    # On 0 the 100 running tokens are locked: nothing evictable, M = 0 (the engine would
    # wait or preempt, not evict). On 1 the finished 40-token prompt goes: M = 40 x 1.
    assert policy.load_cost(0, m, 60, clock()) == policy.load(0, clock(), "history") + 0 + 60
    assert policy.load_cost(1, m, 60, clock()) == 0 + 40 + 60
    assert running.request_id in policy._routed


def test_decoding_time_uses_the_average_decoding_length_in_the_window_cluster_wide():
    """Algorithm 2's decode_len is the average decoding length in H, over every instance:
    one 1-token answer on an instance that has just started must not make it look 30x
    lighter than the rest (it then drew every exploring request)."""
    policy, clock = e2(n=3)
    finished = [route(policy, range(k * 100, k * 100 + 10), n=3) for k in range(3)]  # 0, 1, 2
    assert [d.instance for _, d in finished] == [0, 1, 2]
    for (r, d), out in zip(finished[:2], (1, 63)):
        policy.on_finish(d.instance, r, FinishInfo([], {}, 0.1, out))  # averages 1 and 63 alone
    running = [route(policy, range(k * 100 + 500, k * 100 + 520), n=3) for k in range(2)]
    assert [d.instance for _, d in running] == [0, 1]  # L: 0 + 10 + 32 (2 still runs) -> 0, 1
    # In flight: 20 + 32 on 0 and on 1, 10 + 32 on 2 (the cluster's average is (1 + 63) / 2).
    assert [policy.load(i, clock(), "in_flight") for i in range(3)] == [52, 52, 42]
    _, d = route(policy, range(900, 930), n=3)
    assert (d.instance, d.branch) == (2, "explore")


def test_rebalance_moves_exploit_traffic_only_when_the_gap_outweighs_recompute():
    policy, _ = e2(th_bal=1.5)
    route(policy, X + [1] * 10)  # explore -> 0: L0 = 50 + 32 = 82
    _, d = route(policy, range(20))  # explore -> 1 (cost 102 vs 20): L1 = 20 + 32 = 52
    assert d.instance == 1
    # Exploit X on 0: 82 > 1.5 * 52 = 78, but the gap 30 is below recomputing 40 tokens.
    _, d = route(policy, X + [2] * 5)
    assert (d.instance, d.branch) == (0, "exploit")
    # Now L0 = 82 + (5 + 32) = 119: 119 > 78 and the gap 67 > 40, so go to instance 1.
    _, d = route(policy, X + [3] * 5)
    assert (d.instance, d.branch) == (1, "rebalance")


def test_rebalance_treats_instances_tied_as_heaviest_alike():
    """Two instances tie as the most loaded: exploit traffic to either moves to the
    lightest, not only traffic to the lower-numbered one."""
    other = list(range(100, 150))
    for first, second, holder in ((X + [1] * 10, other, 0), (other, X + [1] * 10, 1)):
        policy, clock = e2(n=3, th_bal=1.5)
        assert route(policy, first, n=3)[1].instance == 0  # explore: all idle, the first
        assert route(policy, second, n=3)[1].instance == 1  # explore: 1 and 2 idle, round-robin
        assert [policy.load(i, clock(), "history") for i in range(3)] == [82, 82, 0]  # 50 + 32 each
        _, d = route(policy, X + [4] * 5, n=3)  # exploit X on its holder; 82 > 1.5 * 0, gap 82 > 40
        assert (d.instance, d.branch) == (2, "rebalance"), holder


@pytest.mark.parametrize(
    "threshold, expected", [(0.9, (1, "explore_decode_balance")), (None, (0, "explore"))]
)
def test_decode_heavy_instance_takes_the_prefill_heavy_request(threshold, expected):
    """With prefill/decode balancing on (threshold 0.9), the decode-heavy instance takes
    the exploring request; off (the default), the lowest L + M + P does."""
    policy, _ = e2(th_bal=float("inf"), decode_ratio_threshold=threshold)  # rebalancing off
    prefix = list(range(100))
    route(policy, range(5000, 5010))  # explore -> 0: L0 = 10 + 32 = 42
    r1, d = route(policy, prefix + [1])  # explore: 42 + 101 on 0 vs 101 on 1 -> 1
    assert d.instance == 1
    route(policy, prefix + [2])  # exploit -> 1, cached fraction 100/101
    route(policy, prefix + [3])  # exploit -> 1
    policy.on_finish(1, r1, stored(prefix + [1]))
    # L1 = (101 + 32) + 2 * (1 + 32) = 199, so cost alone picks 0 (242 vs 399) for a new
    # 200-token prompt; but instance 1's in-flight work is 99% cached: it takes the prefill.
    _, d = route(policy, range(6000, 6200))
    assert (d.instance, d.branch) == expected


def test_key_portion_is_the_deepest_node_longer_than_its_predecessors():
    policy, _ = e2()
    a = list(range(100))  # system prompt
    b = list(range(100, 250))  # 150 tokens: longer than the 100 before it
    c = list(range(300, 500))  # 200 tokens: shorter than the 250 before it
    route(policy, a + b + c + [1])
    route(policy, a + b + [9])  # splits the path at a+b
    route(policy, a + [8])  # splits at a
    key = policy.tree.match(chain_hashes(a + b + c + [2], 1)).key
    assert key.hashes == chain_hashes(a + b, 1)[len(a) :]


def test_engine_events_replace_pending_marks():
    policy, _ = e2()
    tokens = list(range(64))
    r, d = route(policy, tokens)
    # The engine stored only the first 48 tokens (three full pages of 16).
    policy.on_finish(d.instance, r, FinishInfo([CacheEvent.of("stored", tokens[:48], 0, 1)], {}, None, 4))
    match = policy.tree.match(chain_hashes(tokens, 1))
    assert match.cached_on(d.instance) == 48 and match.cached_on(1) == 0
    policy.on_finish(d.instance, r, FinishInfo([CacheEvent.of("evicted", tokens[:48], 32, 1)]))
    assert policy.tree.match(chain_hashes(tokens, 1)).cached_on(d.instance) == 32
    assert policy.tree.cached_sequences(d.instance) == {tuple(chain_hashes(tokens[:32], 1))}


def test_prefix_hash_sends_equal_leading_tokens_to_one_instance():
    policy = make_policy("prefix_hash", 4, prefix_tokens=8)
    loads = [InstanceLoad() for _ in range(4)]
    first = {policy.select(req(list(range(8)) + [k]), loads).instance for k in range(20)}
    assert len(first) == 1
    spread = {policy.select(req([k] * 9), loads).instance for k in range(64)}
    assert spread == {0, 1, 2, 3}


def test_cache_aware_branches():
    policy = make_policy("cache_aware", 2, {"page_size": 1})
    idle = [InstanceLoad(), InstanceLoad()]
    assert policy.select(req(range(100)), idle).branch == "cache_miss"  # match rate 0
    d = policy.select(req(list(range(40)) + [5] * 60), [InstanceLoad(3), InstanceLoad(0)])
    assert (d.instance, d.branch) == (0, "cache_hit")  # 40% > 30% on instance 0
    d = policy.select(req(range(100)), [InstanceLoad(100), InstanceLoad(10)])
    assert (d.instance, d.branch) == (1, "balance")  # 100 - 10 > 64 and 100 > 1.5 * 10


def test_a_resync_drops_event_learned_caches_but_not_cache_awares_routing_tree():
    """A router's first report from an engine is a snapshot (a resync). It replaces what
    earlier events said, so E2 and kv_cost drop them; cache_aware never read events, and
    forgetting there threw away every placement made before the first request finished
    (live ToolBench, 20 rps: cache hits 317 -> 190 of 400)."""
    aware = make_policy("cache_aware", 2, {"page_size": 1})
    idle = [InstanceLoad(), InstanceLoad()]
    first = aware.select(req(range(100)), idle).instance
    aware.resync(first)
    d = aware.select(req(list(range(100)) + [7]), [InstanceLoad(1), InstanceLoad(1)])
    assert (d.instance, d.branch) == (first, "cache_hit")
    for policy in (e2()[0], make_policy("kv_cost", 2, {"page_size": 1})):
        r, d = route(policy, range(100))
        policy.on_finish(d.instance, r, stored(range(100)))
        assert policy.tree.match(chain_hashes(list(range(100)), 1)).cached_on(d.instance) == 100
        policy.resync(d.instance)
        assert policy.tree.match(chain_hashes(list(range(100)), 1)).cached_on(d.instance) == 0


def test_kv_cost_counts_blocks_to_prefill_plus_active_blocks():
    policy = make_policy("kv_cost", 2, {"page_size": 16})
    loads = [InstanceLoad(), InstanceLoad()]
    r, d = route(policy, range(64))  # 4 blocks on either: tie -> 0; instance 0 now 4 active
    assert d.instance == 0
    policy.on_finish(0, r, FinishInfo([CacheEvent.of("stored", range(64), 0, 16)]))  # 0 active
    # Same prompt + 32 tokens: 6 blocks. Instance 0: 6 - 4 overlap + 0 = 2; instance 1: 6.
    assert policy.select(req(list(range(64)) + [1] * 32), loads).instance == 0


def test_unknown_e2_option_value_is_named():
    with pytest.raises(ValueError, match="load_signal='now' is invalid"):
        E2(2, cost_model=UNIT, load_signal="now")


def test_equal_costs_go_to_the_less_busy_gpu():
    policy, _ = e2()
    busy = [InstanceLoad(reported={"gpu_utilization": 0.9}), InstanceLoad(reported={"gpu_utilization": 0.1})]
    d = policy.select(req(range(100)), busy)
    assert (d.instance, d.branch) == (1, "explore")  # L, M, P equal; NVML says 1 is idler


def test_capacity_comes_from_engine_reports():
    policy, _ = e2(capacity=10**6)
    r, d = route(policy, range(10))
    policy.on_finish(d.instance, r, FinishInfo([], {"kv_pages_total": 64, "page_size": 1}))
    assert policy.capacity[d.instance] == 64 and policy.capacity[1 - d.instance] == 10**6


def test_tail_evictions_shorten_a_node_without_splitting_it():
    tree = GlobalPrefixTree(1, page_size=16)
    tokens = list(range(64))
    chain = chain_hashes(tokens, 16)
    tree.apply_events(0, [CacheEvent.of("stored", tokens, 0, 16)])
    for start in (48, 32, 16):  # the engine evicts the tail page by page...
        tree.apply_events(0, [CacheEvent.of("evicted", tokens[: start + 16], start, 16)])
        assert tree.num_nodes() == 1 and tree.match(chain).cached_on(0) == start
        assert tree.cached_sequences(0) == {tuple(chain[: start // 16])}
    assert tree.cached_tokens == tree.held_tokens == [16]
    tree.apply_events(0, [CacheEvent.of("stored", tokens, 16, 16)])  # ...then stores it again
    assert tree.num_nodes() == 1 and tree.cached_sequences(0) == {tuple(chain)}
    assert tree.match(chain).cached_on(0) == 64 and tree.cached_tokens == [64]


def test_requests_in_window_count_those_routed_within_w_and_survive_a_split():
    """A request at t counts through t + W, and no longer after it."""
    tree = GlobalPrefixTree(2, window_s=10.0, page_size=1)
    a = list(range(1, 9))
    for t in (0.0, 1.0, 5.0):
        tree.route(chain_hashes(a, 1), 0, now=t)
    tree.route(chain_hashes(a, 1), 1, now=2.0)
    node = tree.match(chain_hashes(a, 1)).nodes[0]
    assert tree.requests_in_window(node, 0, now=10.0) == 3
    assert tree.requests_in_window(node, 0, now=10.5) == 2  # t=0 counted through 10
    tree.route(chain_hashes(a[:4] + [99], 1), 0, now=10.5)  # splits a after 4 pages
    upper, lower = tree.match(chain_hashes(a, 1)).nodes
    assert tree.requests_in_window(upper, 0, now=10.5) == 3  # the new request covers a[:4]
    assert tree.requests_in_window(lower, 0, now=15.0) == 1  # t=5 counts through 15
    assert tree.requests_in_window(lower, 0, now=15.5) == 0
    assert (
        tree.requests_in_window(lower, 1, now=11.0) == 1 and tree.requests_in_window(lower, 1, now=12.5) == 0
    )


def test_prune_drops_expired_branches_and_merges_what_they_split():
    tree = GlobalPrefixTree(2, window_s=10.0, page_size=1)
    a, b, c = list(range(30)), list(range(100, 120)), list(range(200, 210))
    ends = [tree.route(chain_hashes(a + b, 1), 0, now=0.0), tree.route(chain_hashes(a + c, 1), 1, now=1.0)]
    assert tree.num_nodes() == 3  # a, b, c
    tree.apply_events(0, [CacheEvent.of("stored", a + b, 0, 1)])
    tree.finish(ends[0], 0)
    tree.finish(ends[1], 1)  # instance 1 never stored anything: a+c is held by nobody
    assert tree.prune(now=10.5) == 0  # a+c's request is still in the window
    assert tree.num_nodes() == 3
    assert tree.prune(now=11.5) == 2  # c goes, and a folds b back in
    assert tree.num_nodes() == 1 and tree.cached_sequences(0) == {tuple(chain_hashes(a + b, 1))}
    assert tree.match(chain_hashes(a + c, 1)).cached_on(0) == 30 and tree.held_tokens == [50, 0]


def test_a_request_in_flight_finishes_where_a_prune_merged_its_end_node():
    """Its end node is folded into the parent while it runs; finishing must still release
    what it holds (the merged node), or the instance looks loaded with it forever."""
    tree = GlobalPrefixTree(1, window_s=10.0, page_size=1)
    a = list(range(1, 5))
    tree.finish(tree.route(chain_hashes(a + [10, 11], 1), 0, now=0.0), 0)
    end = tree.route(chain_hashes(a + [20, 21], 1), 0, now=100.0)  # a is revisited after W
    assert tree.prune(now=100.0) == 2  # a + [10, 11] goes; a and [20, 21] fold into one
    tree.finish(end, 0)
    [node] = tree.root.children.values()
    assert node.hashes == chain_hashes(a + [20, 21], 1) and node.pending == {}
    assert tree.held_tokens == [0] and not tree.lru[0]


def test_decision_benchmark_replays_the_simulated_decisions():
    """The decisions/s benchmark times a replay of the calls E2 got in a simulation; a replay
    that decides differently from the simulation (E2 not a function of what it was told)
    raises inside it. Run in a fresh interpreter, as the command line runs each trace."""
    stats = bench_isolated("toolbench", 2, 60, 60.0, 1, num_tools=50)
    assert stats.decisions_per_s > 0 and stats.select_us > 0 and stats.finish_us > 0
    assert 0 < stats.explore_share < 1 and stats.events_per_finish > 0


def test_a_pinned_placement_is_counted_as_the_policys_own():
    """The later choices of an ``n`` > 1 request are pinned to the first's engine: each
    policy counts them there as if it had chosen so (E2's load and pending tree marks,
    cache_aware's routing tree, kv_cost's active blocks)."""
    policy, clock = e2()
    _, d = route(policy, range(100))
    assert d.instance == 0
    pinned = req(range(100))
    assert policy.place(pinned, 1) == type(d)(1, "pinned")
    m = policy.tree.match(chain_hashes(range(100), 1))
    # instance 1's load: the pinned request's 100 missed tokens + 32 decode; its prompt is
    # now held there (pending), so a third copy would miss nothing
    assert (policy.load_cost(1, m, 100, clock()), m.cached_on(1)) == (132 + 0 + 0, 100)
    aware = make_policy("cache_aware", 2, {"page_size": 1})
    aware.place(req(range(100)), 1)
    d = aware.select(req(list(range(100)) + [7]), [InstanceLoad(1), InstanceLoad(1)])
    assert (d.instance, d.branch) == (1, "cache_hit")
    cost = make_policy("kv_cost", 2, {"page_size": 16})
    cost.place(req(range(64)), 0)
    assert cost.active_blocks == [4, 0]
