"""Loads beside the pass: a request whose prefix comes back from the host tier while others
are in the batch is loaded beside their forward pass and computes from the next
iteration; alone, it loads in line (nothing would run beside it). The cost model charges
such a load only past the pass, and engines loading beside give transformers' tokens."""

from __future__ import annotations

from conftest import make_request, random_prompts
from test_host_copy_ahead import doc
from test_host_tier import PAGE
from test_host_tier_admission import compute, tiered
from test_parity import GREEDY, expected, vocab

from preble_backend.common.cost_model import CostModel
from preble_backend.engine.scheduling.local_scheduler import LocalScheduler
from preble_backend.engine.scheduling.priority_queue import PriorityWaitQueue


def on_host(pages: int):
    """A scheduler over a device of 16 pages and a host tier holding a prefix of ``pages``."""
    device, cache, blocks = tiered(16, 16)
    prefix = doc(100, pages)
    compute(blocks, prefix, "p", pages)
    device.free(cache.evict(cache.num_evictable_pages))
    assert cache.num_host_pages == pages
    return LocalScheduler(blocks, PriorityWaitQueue(10, 10), 64, 8), prefix


def test_a_prefix_from_the_host_comes_up_beside_the_pass_and_computes_in_the_next():
    """R decodes; Q's four-page prefix is on the host. Q's admission loads it beside R's
    decode (charged beside, not in line) and Q is not in that batch; the next batch holds
    R's decode and Q's last two tokens."""
    sched, prefix = on_host(4)
    r = make_request(doc(300, 1) + [1], "r")
    sched.add(r)
    sched.advance(sched.schedule())  # R's prompt
    r.output_ids.append(1)
    q = make_request(prefix + [7, 8], "q")
    sched.add(q)
    batch = sched.schedule()
    assert (batch.requests, batch.num_new_tokens) == ([r], [1])
    assert (batch.loaded_tokens, batch.loaded_beside_tokens, batch.work()[3:]) == (0, 4 * PAGE, (0, 4 * PAGE))
    assert q in sched.running and q.num_computed == 4 * PAGE
    assert sched.blocks.cache.host.stats.pages_loaded_beside == 4
    sched.advance(batch)
    r.output_ids.append(1)
    batch = sched.schedule()
    assert (batch.requests, batch.num_new_tokens, batch.loaded_beside_tokens) == ([r, q], [1, 2], 0)
    cost = CostModel(10.0, 0.5, 1.0, 0.0, 20.0, load_ms_per_token=0.25)
    assert cost.iteration_time(0, 1, 18, 0, 4 * PAGE) == 10 + 1  # 4 ms of load beside: hidden
    assert cost.iteration_time(0, 1, 18, 4 * PAGE, 0) == 10 + 1 + 4  # in line: waited for


def test_alone_a_prefix_from_the_host_loads_in_line_and_computes_at_once():
    sched, prefix = on_host(4)
    q = make_request(prefix + [7, 8], "q")
    sched.add(q)
    batch = sched.schedule()
    assert (batch.requests, batch.num_new_tokens) == ([q], [2])
    assert (batch.loaded_tokens, batch.loaded_beside_tokens, batch.work()[3:]) == (4 * PAGE, 0, (4 * PAGE, 0))
    assert sched.blocks.cache.host.stats.pages_loaded_beside == 0


def test_an_engine_loading_beside_a_pass_gives_transformers_tokens(any_model, make_engine, hf_reference):
    """A 240-token prefix on the host, asked for while another prompt decodes: it comes up
    beside that decode, and both answers are transformers' greedy tokens."""
    engine = make_engine(any_model, page_size=16, chunk_size=64, max_num_tokens=512, host_kv_tokens=4096)
    prefix, other = random_prompts([240, 40], vocab(any_model), seed=41)
    out = engine.generate([prefix + [5]], {**GREEDY, "max_tokens": 4})
    engine.pool.free(engine.cache.evict(engine.cache.num_evictable_pages))  # the prefix goes down
    outputs: dict[str, list[int]] = {}

    def collect(o) -> None:
        outputs.setdefault(o.request_id, []).extend(o.token_ids)

    prompts = [prefix + [5], other, prefix + [6, 7]]
    engine.add_request("other", other, {**GREEDY, "max_tokens": 8}, collect)
    engine.step()  # its prompt: it decodes from here on
    engine.add_request("q", prompts[2], {**GREEDY, "max_tokens": 8}, collect)
    while engine.has_work():
        engine.step()
    assert engine.stats()["host_pages_loaded_beside"] == 240 // 16
    want = expected(hf_reference, any_model, prompts, 8)
    assert [out[0], outputs["other"], outputs["q"]] == [want[0][:4], want[1], want[2]]
