"""Every router's global tree stays exact however the engine is polled: cache events go
through a numbered log each router reads from its own cursor, not to whoever asks first."""

from __future__ import annotations

import queue
import random
import threading

from preble_backend.common.block_hash import chain_hashes
from preble_backend.common.cache_event import CacheEvent, EventBatch
from preble_backend.engine.cache.event_log import EventLog
from preble_backend.router.engines.event_feed import EventFeed
from preble_backend.serving.protocol import decode_report, encode_report
from scheduler.global_tree import GlobalPrefixTree

PAGE = 4


def event(n: int) -> CacheEvent:
    return CacheEvent.of("stored", list(range(n * PAGE)), 0, PAGE)


def test_a_reader_gets_what_followed_its_cursor_and_a_snapshot_when_it_fell_behind():
    log = EventLog(capacity=3)
    assert log.read("") is None and log.read("other/0") is None  # new reader, another log
    log.append([event(1), event(2)])
    batch = log.read(f"{log.log_id}/0")
    assert (batch.first, batch.next, batch.events) == (0, 2, [event(1), event(2)])
    log.append([event(3), event(4)])  # capacity 3: event(1) is gone
    assert log.read(batch.cursor).events == [event(3), event(4)]
    assert log.read(f"{log.log_id}/0") is None  # fell off the end: resync
    assert log.read(f"{log.log_id}/9") is None  # a cursor from the future is not this log's
    walks = []
    snap = log.snapshot(lambda: walks.append(1) or [event(4)])
    assert snap.snapshot and (snap.first, snap.next, snap.events) == (4, 4, [event(4)])
    assert log.snapshot(lambda: walks.append(1) or []) is snap and len(walks) == 1  # shared
    log.append([event(5)])
    assert log.snapshot(lambda: [event(5)]).next == 5  # an event since: taken afresh


def test_a_feed_applies_each_event_once_whatever_order_reports_come_in():
    feed = EventFeed()
    snap = EventBatch("L", 2, 2, [event(1)], snapshot=True)
    assert feed.take(snap) == ([event(1)], True) and feed.cursor == "L/2"
    late = EventBatch("L", 2, 5, [event(2), event(3), event(4)])  # sent at L/2
    early = EventBatch("L", 2, 3, [event(2)])  # also sent at L/2, arrives after ``late``
    assert feed.take(late) == ([event(2), event(3), event(4)], False)
    assert feed.take(early) == ([], False)
    assert feed.take(EventBatch("L", 3, 6, [event(3), event(4), event(5)])) == ([event(5)], False)
    assert feed.take(EventBatch("L", 4, 4, [event(1)], snapshot=True)) == ([], False)  # older
    assert feed.take(EventBatch("M", 0, 1, [event(6)])) == ([], False)  # another log: ignored
    assert feed.take(EventBatch("M", 7, 7, [event(6)], snapshot=True)) == ([event(6)], True)
    feed.reset()
    assert feed.cursor == ""


def test_reports_carry_the_batch():
    batch = EventBatch("L", 3, 5, [event(1), CacheEvent.of("evicted", list(range(8)), 4, PAGE)])
    assert decode_report(encode_report({"running": 1}, batch)) == (batch, {"running": 1})
    assert decode_report(encode_report({"running": 0})) == (None, {"running": 0})


class Router:
    """A router's mirror of one engine: its feed and its global tree."""

    def __init__(self) -> None:
        self.feed = EventFeed()
        self.tree = GlobalPrefixTree(1, page_size=PAGE)

    def apply(self, batch: EventBatch) -> None:
        events, resync = self.feed.take(batch)
        if resync:
            self.tree.forget(0)
        self.tree.apply_events(0, events)


def engine_paths(engine) -> set[tuple[int, ...]]:
    return {tuple(chain_hashes(leaf.path_tokens(), PAGE)) for leaf in engine.cache.leaves}


def test_two_routers_stay_exact_under_polling_and_flushes(tiny_model, make_engine):
    """Two routers share an engine that a monitor polls and flushes while they work (the
    old design drained events into whichever call came first). Each router's tree must
    equal the engine's cache after each of its reads, and after the last flush."""
    engine = make_engine(tiny_model, page_size=PAGE, chunk_size=32, max_num_tokens=256)
    engine.events = EventLog(capacity=8)  # small: a router that falls behind resyncs
    engine.start()
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 200) for _ in range(24)] for _ in range(4)]
    routers = [Router(), Router()]
    polling = threading.Event()
    mismatches: list[str] = []

    def poll() -> None:
        k = 0
        while not polling.is_set():
            k += 1
            op = engine.flush_cache if k % 5 == 0 else engine.stats
            engine.run_in_loop(op).result(timeout=30)

    def route(index: int, n: int) -> None:
        router = routers[index]
        for i in range(n):
            done: queue.Queue = queue.Queue()
            prompt = rng.choice(prefixes) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 9))]
            cursor = router.feed.cursor

            def finished(out, cursor=cursor, done=done) -> None:  # engine thread, as the engine model
                if out.finished:
                    done.put((engine.cache_events(cursor), engine_paths(engine)))

            engine.add_request(f"r{index}-{i}", prompt, {"max_tokens": 3, "ignore_eos": True}, finished)
            batch, truth = done.get(timeout=60)
            router.apply(batch)  # the events up to the moment ``truth`` was taken
            if router.tree.cached_sequences(0) != truth:
                mismatches.append(f"router {index} after request {i}")

    poller = threading.Thread(target=poll)
    poller.start()
    workers = [threading.Thread(target=route, args=(k, 12)) for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    polling.set()
    poller.join()
    engine.run_in_loop(engine.flush_cache).result(timeout=30)
    for router in routers:
        batch, truth = engine.run_in_loop(
            lambda r=router: (engine.cache_events(r.feed.cursor), engine_paths(engine))
        ).result(timeout=30)
        router.apply(batch)
        assert router.tree.cached_sequences(0) == truth == set()  # the flush reached both
    assert not mismatches
