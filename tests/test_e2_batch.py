"""E2's batch load model (its default): L and P priced as a batching engine pays them, the
rebalancer guarded by the same cost, and a hot prefix replicated when its holders queue,
every expected choice computed by hand (helpers from ``test_e2``)."""

from __future__ import annotations

import pytest
from test_e2 import AVG_DECODE, e2, req, route, stored

from preble_backend.common.block_hash import chain_hashes
from preble_backend.common.cache_event import CacheEvent
from preble_backend.common.cost_model import CostModel
from scheduler.load_cost import InstanceHistory, memory_cost

# A batch's proportions: a request in flight lengthens each decoding iteration by 1 ms (its
# share of the batch), against a 10 ms step at a typical batch (DECODETIME) and 1 ms per
# prefilled token. With the default 32-token decoding length and nothing queued for
# prefill, b requests in flight cost a new one 32·b (its 32 steps, each b ms longer) plus
# 16·b (it lengthens their iterations over 16 steps on average), and its prefill of m
# tokens costs m·(1 + b): it waits for it, and so do the b requests decoding beside it.
BATCH = CostModel(base_ms=0, prefill_ms_per_token=1, decode_ms_per_request=1,
                  attention_ms_per_context_token=0, decode_step_ms=10)  # fmt: skip
SYSTEM = list(range(5000, 5500))  # a 500-token system prompt every instance caches


def conversation_at_home(b0: int, load_model: str = "batch"):
    """Instance 0 holds a conversation (the system prompt and a 500-token history) and
    runs ``b0`` other requests, fully cached (no prefill queued); instance 1 holds the
    system prompt and is idle."""
    policy, clock = e2(cost=BATCH, load_model=load_model)
    history = SYSTEM + list(range(7000, 7500))
    policy.tree.apply_events(0, [CacheEvent.of("stored", history, 0, 1)])
    policy.tree.apply_events(1, [CacheEvent.of("stored", SYSTEM, 0, 1)])
    for k in range(b0):
        policy.history[0].add(f"busy{k}", clock(), 0.0, 1.0, 1000)
    return policy, history


@pytest.mark.parametrize("b0, expected", [(0, 0), (7, 0), (8, 1)])
def test_a_chat_turn_stays_with_its_conversation_while_the_load_gap_is_below_the_recompute(b0, expected):
    """The next turn (history + 20 new tokens) costs 20·(1 + b0) + 48·b0 on its home and
    520 (the history's 500 tokens again, and its own 20) on the idle instance: it stays
    while 68·b0 + 20 < 520, through b0 = 7 (496), and moves at 8 (564). The system prompt
    is the key portion, so both are candidates. Priced as Algorithm 2 prices load (a
    10 ms × 32 DECODETIME per request in flight), it would leave at b0 = 2."""
    turn = conversation_at_home(b0)[1] + list(range(9000, 9020))
    for load_model, home_cost, leaves_at in (("batch", 68 * b0 + 20, 8), ("serial", 320 * b0 + 20, 2)):
        policy, _ = conversation_at_home(b0, load_model)
        m = policy.tree.match(chain_hashes(turn, 1))
        assert (policy.load_cost(0, m, 1020, 0.0), policy.load_cost(1, m, 1020, 0.0)) == (home_cost, 520)
        _, d = route(policy, turn)
        assert d.branch == "exploit" and d.instance == (1 if b0 >= leaves_at else 0)
    assert (b0 >= 8) == (expected == 1)


def test_requests_waiting_for_their_prefill_do_not_wait_for_the_new_one():
    """P is paid by the requests *decoding* beside the new one, expected from how a
    request's time splits: with two in flight whose prefills take 320 ms each, against a
    DECODETIME of 320 ms, half of each one's time is decoding: one of the two."""
    policy, _ = e2(cost=BATCH, load_model="batch")
    for k in range(2):
        policy.history[0].add(f"q{k}", 0.0, 320.0, 0.0, 320)
    assert policy.history[0].decoding(BATCH.decode_time(AVG_DECODE)) == 1.0
    m = policy.tree.match(chain_hashes(range(100), 1))
    # 640 queued + 32·2 + 16·2 (L), and 100 tokens of prefill paid twice (P)
    assert policy.load_cost(0, m, 100, 0.0) == 640 + 64 + 32 + 100 * 2


def in_flight(policy, instance: int, tokens, prefill_ms: float = 0.0) -> None:
    """A request running on ``instance`` since time 0: in its history, and in the tree by
    its pending marks (the pages it holds there)."""
    policy.tree.route(chain_hashes(tokens, 1), instance, 0.0)
    policy.history[instance].add(req(tokens).request_id, 0.0, prefill_ms, 1.0, len(tokens))


def test_a_full_batch_makes_the_request_wait_for_part_of_it():
    """KV capacity 3,000: two requests in flight hold 2·(1,000 + 32) tokens; a 1,000-token
    prompt would need 3,096: the 96 over are 96/2,064 of the batch, whose 32 steps of 2 ms
    it waits through in that proportion."""
    policy, _ = e2(cost=BATCH, load_model="batch", capacity=3000)
    for k in range(2):
        in_flight(policy, 0, range(10000 * k, 10000 * k + 1000))
    m = policy.tree.match(chain_hashes(range(20000, 21000), 1))
    wait = 96 / 2064 * 32 * 2
    assert policy.load_cost(0, m, 1000, 0.0) == pytest.approx(64 + 32 + wait + 1000 * 3)


def test_a_prefix_the_batch_shares_is_held_once_on_an_engine_with_a_host_tier():
    """KV capacity 1,250: two requests in flight share a 900-token document and add 100
    tokens each, so the engine holds 1,100 (+ 2·32 decoded), not the 2,000 their prompts
    sum to. A third question on the document adds only its own 100: 46 over, 46/1,164 of
    the batch's 32 steps of 2 ms; a 1,000-token prompt without it is 946 over. Each pays
    L = 64 + 32 and its missed tokens' prefill three times (its own and the two decoding);
    nothing is evicted, since the batch holds all the instance has. Without a host tier
    the prompts are summed: the question is 2,064 + 1,000 + 32 - 1,250 = 1,846 over."""
    policy, _ = e2(cost=BATCH, load_model="batch", capacity=1250)
    doc = list(range(20000, 20900))
    for k in range(2):
        in_flight(policy, 0, doc + list(range(30000 + 100 * k, 30100 + 100 * k)))
    assert policy.tree.pinned_tokens[0] == 1100 and policy.history[0].in_flight_tokens == 2000
    question = doc + list(range(40000, 40100))
    m = policy.tree.match(chain_hashes(question, 1))
    assert (m.pinned_on(0), m.cached_on(0)) == (900, 900)
    assert policy.load_cost(0, m, 1000, 0.0) == pytest.approx(96 + 1846 / 2064 * 64 + 100 * 3)
    policy.tiered[0] = True  # as the engine's load report says
    assert policy.load_cost(0, m, 1000, 0.0) == pytest.approx(96 + 46 / 1164 * 64 + 100 * 3)
    fresh = policy.tree.match(chain_hashes(range(50000, 51000), 1))
    assert policy.load_cost(0, fresh, 1000, 0.0) == pytest.approx(96 + 946 / 1164 * 64 + 1000 * 3)


def test_a_prefill_already_run_is_no_longer_queued_ahead_on_an_engine_with_a_host_tier():
    """Two requests routed at time 0 brought 320 ms of prefill each. At 0 all 640 ms are
    ahead of a new request; the instance works through it at a millisecond a millisecond,
    so 140 ms are left at 0.5 s and none at 1 s, though both are still in flight
    (decoding). A request routed at 1 s queues its own 100 ms again. Without a host tier
    every prefill in flight counts as queued (740 ms)."""
    policy, clock = e2(cost=BATCH, load_model="batch")
    for k in range(2):
        in_flight(policy, 0, range(1000 * k, 1000 * k + 320), prefill_ms=320.0)
    history = policy.history[0]
    assert [history.queued_prefill(t) for t in (0.0, 0.5, 1.0, 9.0)] == [640.0, 140.0, 0.0, 0.0]
    history.add("late", 1.0, 100.0, 0.0, 100)
    assert history.queued_prefill(1.0) == 100.0 and history.in_flight_prefill_ms == 740.0
    m = policy.tree.match(chain_hashes(range(5000, 5010), 1))
    decoding = history.decoding(BATCH.decode_time(32))
    clock.t = 1.05  # 50 ms later: 50 of the 100 left; 3 in flight, none cached for the new one
    rest = 32 * 3 + 3 * 16 + 10 * (1 + decoding)
    assert policy.load_cost(0, m, 10, clock.t) == pytest.approx(740 + rest)
    policy.tiered[0] = True
    assert policy.load_cost(0, m, 10, clock.t) == pytest.approx(50 + rest)


def test_the_queued_prefill_never_holds_more_than_the_requests_in_flight_brought():
    """A (600 ms) and B (500 ms) are routed at 0 and A finishes at 50 ms: at most B's
    500 ms is left. C (400 ms) comes at 100 ms, so 900 ms are queued then, and 400 ms
    later 500 ms are left. Capping the backlog after C is counted in flight would keep a
    second copy of C's prefill: 900 ms at 0.5 s."""
    history = InstanceHistory(window_s=60.0)
    history.add("a", 0.0, 600.0, 0.0, 600)
    history.add("b", 0.0, 500.0, 0.0, 500)
    history.finish("a")
    history.add("c", 0.1, 400.0, 0.0, 400)
    assert history.queued_prefill(0.1) == pytest.approx(900.0)
    assert history.queued_prefill(0.5) == pytest.approx(500.0)


def test_an_evicted_prefix_costs_one_recompute_however_many_used_it():
    """KV capacity 120. Instance 0 caches A (100 tokens), used by three requests within W,
    and is idle; instance 1 caches E (100 tokens), used by one, and runs a cached 10-token
    request. A new 50-token prompt must evict the 100-token node on either. Under the batch
    model M is one recompute of it on both (100): the idle instance costs 100 + 50; the
    busy one 48 (L: 32 steps 1 ms longer, and 16 of its steps lengthened) + 4/42 · 32 (the
    KV over capacity) + 100 + 50 · 2 (its prefill, paid by the decoding request too). So
    the request goes to the idle instance; priced per user as Algorithm 2 does, M would be
    300 there and the busy instance would win."""
    a, e = list(range(100)), list(range(200, 300))
    policy, clock = e2(cost=BATCH, load_model="batch", capacity=120)
    for tokens, instance in ((a, 0), (e, 1), (a, 0), (a, 0)):
        r, d = route(policy, tokens)
        assert d.instance == instance
        policy.on_finish(d.instance, r, stored(tokens))
    in_flight(policy, 1, range(600, 610))
    new = list(range(400, 450))
    m = policy.tree.match(chain_hashes(new, 1))
    busy = 48 + 4 / 42 * 32 + 100 + 50 * 2
    assert policy.load_cost(0, m, 50, clock()) == 100 + 50
    assert policy.load_cost(1, m, 50, clock()) == pytest.approx(busy)
    assert memory_cost(policy.tree, 0, 30, m, clock(), BATCH, per_user=True) == 300 > busy - 50
    _, d = route(policy, new)
    assert (d.instance, d.branch) == (0, "explore")


def test_rebalancing_moves_only_what_the_cost_model_says_pays_for_its_recompute():
    """Under the batch model the rebalancer's guard is the same L + M + P: the home of a
    conversation is the heaviest by history load (th_bal 1.5) but keeps the turn while
    staying is cheaper (b0 = 7), and gives it up when moving is (b0 = 8)."""
    for b0, expected in ((7, (0, "exploit")), (8, (1, "exploit"))):
        policy, history = conversation_at_home(b0)
        policy.th_bal = 1.5
        _, d = route(policy, history + list(range(9000, 9020)))
        assert (d.instance, d.branch) == expected


def test_a_hot_prefix_gets_a_replica_when_its_holders_queue_reaches_the_bound():
    """A 1,000-token document cached on instance 0 only; each question (the document + 20
    tokens) holds 1,020 + 32 tokens of KV. With a 5,000-token KV, a new question waits
    behind b - (5,000 - 1,052) / 1,052 = b - 3.75 requests: fewer than one (the bound)
    through b = 4, one or more from b = 5. So the sixth question, not the fifth, makes
    instance 1 a replica, before the holder's queue passes the bound."""
    policy, _ = e2(cost=BATCH, load_model="batch", capacity=5000)
    doc = list(range(20000, 21000))
    policy.tree.apply_events(0, [CacheEvent.of("stored", doc, 0, 1)])
    key = policy.tree.match(chain_hashes(doc + [1], 1)).key
    for k in range(6):
        _, d = route(policy, doc + list(range(30000 + 20 * k, 30020 + 20 * k)))
        assert (d.instance, d.branch) == (0, "exploit")  # the holder is still the cheapest
        assert key.replicas == (set() if k < 5 else {1}), k
    e2_off, _ = e2(cost=BATCH, load_model="batch", capacity=5000, hot_queue=None)
    e2_off.tree.apply_events(0, [CacheEvent.of("stored", doc, 0, 1)])
    for k in range(6):
        route(e2_off, doc + list(range(30000 + 20 * k, 30020 + 20 * k)))
    assert not e2_off.tree.match(chain_hashes(doc + [1], 1)).key.replicas


@pytest.mark.parametrize("b1, replicas", [(4, {1}), (5, set())])
def test_no_replica_where_the_replica_would_queue_too(b1, replicas):
    """The same document and questions, instance 1 now running ``b1`` requests of 1,020
    prompt tokens: it would queue a question behind b1 - 3.75 of them. With four (0.25)
    it has room and becomes the replica at the sixth question, as above; with five (1.25)
    it queues as the holder does, and no replica is made."""
    policy, _ = e2(cost=BATCH, load_model="batch", capacity=5000)
    doc = list(range(20000, 21000))
    policy.tree.apply_events(0, [CacheEvent.of("stored", doc, 0, 1)])
    for k in range(b1):
        policy.history[1].add(f"busy{k}", 0.0, 0.0, 1.0, 1020)
    for k in range(6):
        _, d = route(policy, doc + list(range(30000 + 20 * k, 30020 + 20 * k)))
        assert (d.instance, d.branch) == (0, "exploit")
    assert policy.tree.match(chain_hashes(doc + [1], 1)).key.replicas == replicas


def hot_document(n: int, b1: int, threads: int = 0, own: bool = False, **kw):
    """A 1,000-token document cached on instance 0 with ``n`` questions on it in flight
    there (each the document, then with ``threads`` one of that many 50-token threads
    below it, round-robin, then 10 tokens of question); ``b1`` unrelated 10-token
    requests in flight on instance 1. Returns the policy and the next question: in the
    first thread (``own``) or straight after the document."""
    policy, _ = e2(cost=BATCH, load_model="batch", capacity=100_000, **kw)
    doc = list(range(20000, 21000))
    thread = [list(range(40000 + 100 * t, 40050 + 100 * t)) for t in range(threads)] or [[]]
    policy.tree.apply_events(0, [CacheEvent.of("stored", doc + t, 0, 1) for t in [[], *thread]])
    for k in range(n):
        policy.record(req(doc + thread[k % len(thread)] + list(range(30000 + 10 * k, 30010 + 10 * k))), 0)
    for k in range(b1):
        policy.record(req(range(50000 + 10 * k, 50010 + 10 * k)), 1)
    return policy, doc + (thread[0] if own else []) + list(range(60000, 60010))


@pytest.mark.parametrize(
    "n, b1, threads, own, expected",
    [
        (16, 4, 0, False, (1, "replicate")),  # amortized 890.7 < 1,093.2 at the holder
        (15, 4, 0, False, (0, "exploit")),  # under hot_min_requests (16): not hot yet
        (16, 6, 0, False, (0, "exploit")),  # holder 928 against 1.5 x the mean 638: not overloaded
        (20, 4, 1, True, (0, "exploit")),  # all 20 in the request's own thread: none would follow
        (20, 4, 2, False, (0, "exploit")),  # two threads of ten: two would follow, not 20
    ],
)
def test_a_hot_prefix_is_replicated_when_its_recompute_pays_over_those_it_draws(
    n, b1, threads, own, expected
):
    """A new question costs the holder L + P = 58·n + 10·(1 + 32n/33) (n = 16: 1,093.2);
    instance 1, 58·b1 + 1,010·(1 + 32·b1/33) (b1 = 4: 5,159.6), too much for the
    rebalancer. Made a replica, instance 1 pays the document's 1,000 tokens once for the
    questions that follow it there: with its holder it would serve the n in flight, so
    the recompute is counted 2/n: 5,159.6 - 1,000·(1 + 32·4/33)·(1 - 2/16) = 890.7, below
    the holder's. A thread below the document keeps its later requests with its own
    cache, so it counts once, and the request's own thread not at all; counted request by
    request, the 20 would make the replica pay (768.7 or 1,012.6 against 1,363.9)."""
    policy, question = hot_document(n, b1, threads, own)
    if not threads:
        m = policy.tree.match(chain_hashes(question, 1))
        assert policy.load_cost(0, m, 1010, 0.0) == pytest.approx(58 * n + 10 * (1 + 32 * n / 33))
        assert policy.load_cost(1, m, 1010, 0.0) == pytest.approx(58 * b1 + 1010 * (1 + 32 * b1 / 33))
    _, d = route(policy, question)
    assert (d.instance, d.branch) == expected
    key = policy.tree.match(chain_hashes(question[:1000] + [1], 1)).key
    assert key.replicas == ({1} if expected[0] == 1 else set())
    if expected[0] == 1:  # the rule off: the holder keeps it
        policy, question = hot_document(n, b1, amortized_replicas=False)
        assert route(policy, question)[1].branch == "exploit"
