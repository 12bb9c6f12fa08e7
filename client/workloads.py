"""The paper's five workloads (§3, Table 1) and two that dominate real prefix-sharing
traffic (multi-turn chat, multi-tenant system prompts) as deterministic generators, plus
mixes and Poisson arrivals (Azure trace replay: ``azure_trace.py``).

A request is a list of *segments* (an id and a length in tokens) and an output length.
Requests that share a segment id share its tokens, so the sharing structure (system
prompts, tool documentation, demonstrations, videos, documents, multi-turn chains,
parallel samples) is explicit. A chat turn *follows* the previous one (``after``): it is
sent ``think_s`` after that answer arrives, closed-loop, as a user types only after
reading, and its prompt replays that answer (``answer``: the tokens the previous turn
generates, which the simulator's engine then outputs). Segments become token ids
(``token_ids``, for the simulator: any vocabulary) or text whose length is measured in a
real tokenizer (``text``, for live servers). Table 1's statistics over a trace are
``scheduler/sim/workload_stats.py``'s.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

# Table 1: (mean, std) of prompt length, output length, shared prefix %, key portion %,
# requests sharing the key portion.
_WORDS = (
    "query result list item value range filter limit offset page sort field name type date time city "
    "weather price stock flight hotel route map video frame scene object person score rank search fetch "
    "update create delete status report summary detail language translate convert robot kitchen table "
    "drawer apple knife cabinet fridge sink lamp book chapter section argument proof theorem function class"
).split()


@dataclass(frozen=True)
class Segment:
    id: str
    length: int  # tokens


@dataclass
class WorkloadRequest:
    segments: list[Segment]
    output_len: int
    group: str  # the sharing unit (tool, task, problem, video, document, tenant)
    arrival: float = 0.0  # for a follower: its predecessor's arrival + think_s (a lower bound)
    answer: Segment | None = None  # what it generates, when a later prompt replays it
    after: int | None = None  # the index of the request whose answer must come first
    think_s: float = 0.0  # how long after that answer it is sent

    @property
    def prompt_len(self) -> int:
        return sum(s.length for s in self.segments)


def _normal(rng: random.Random, mean: float, std: float, lo: float, hi: float = math.inf) -> int:
    return int(min(hi, max(lo, rng.gauss(mean, std))))


def _lognormal(rng: random.Random, mean: float, std: float, lo: float, hi: float) -> int:
    sigma2 = math.log(1 + (std / mean) ** 2)
    return int(min(hi, max(lo, rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2)))))


def _zipf(rng: random.Random, n: int, s: float) -> int:
    return rng.choices(range(n), weights=[1 / (k**s) for k in range(1, n + 1)])[0]


def toolbench(n: int, seed: int = 0, num_tools: int = 0, scale: float = 1.0) -> list[WorkloadRequest]:
    """Shared system prompt, one tool's documentation (Zipf-1.1 popularity), a question."""
    rng = random.Random(seed)
    tools = num_tools or max(8, n // 3)
    doc = [
        _normal(random.Random(seed * 7919 + t), 1250 * scale, 650 * scale, 100 * scale) for t in range(tools)
    ]
    out = []
    for i in range(n):
        t = _zipf(rng, tools, 1.1)
        segs = [
            Segment("tb-system", int(100 * scale)),
            Segment(f"tb-tool-{t}", doc[t]),
            Segment(f"tb-q-{seed}-{i}", _normal(rng, 250 * scale, 200 * scale, 10)),
        ]
        out.append(WorkloadRequest(segs, _normal(rng, 43, 16, 1), f"tool-{t}"))
    return out


def embodied_agent(n: int, seed: int = 0, scale: float = 1.0) -> list[WorkloadRequest]:
    """A task's demonstration, an episode's environment, then a growing chain of steps:
    each step's prompt is the previous prompt plus its output and a new observation."""
    rng = random.Random(seed)
    demos = max(1, n // 48)
    active: list[dict] = []
    out = []
    episode = 0
    while len(out) < n:
        if len(active) < 8:
            d = rng.randrange(demos)
            env = Segment(f"ea-env-{seed}-{episode}", _normal(rng, 250 * scale, 200 * scale, 10))
            segs = [Segment("ea-system", int(30 * scale)), Segment(f"ea-demo-{d}", int(1600 * scale)), env]
            active.append({"segs": segs, "steps": _normal(rng, 16, 8, 2), "demo": d, "id": episode})
            episode += 1
        ep = active[rng.randrange(len(active))]
        step = len(ep["segs"]) - 3
        obs = Segment(f"ea-obs-{seed}-{ep['id']}-{step}", _normal(rng, 30 * scale, 10 * scale, 3))
        output = _normal(rng, 16, 13, 1)
        out.append(WorkloadRequest(ep["segs"] + [obs], output, f"demo-{ep['demo']}"))
        ep["segs"] = ep["segs"] + [obs, Segment(f"ea-out-{seed}-{ep['id']}-{step}", output)]
        if step + 1 >= ep["steps"]:
            active.remove(ep)
    return out


def _grouped(n: int, rng: random.Random, group) -> list[WorkloadRequest]:
    """Requests made a group at a time (``group(k)``: the k-th shared item's requests),
    shuffled so that a group's requests spread over the trace."""
    out: list[WorkloadRequest] = []
    k = 0
    while len(out) < n:
        out.extend(group(k))
        k += 1
    rng.shuffle(out)
    return out[:n]


def programming(n: int, seed: int = 0, scale: float = 1.0) -> list[WorkloadRequest]:
    """A shared code demonstration, a problem, and several parallel samples per problem."""
    rng = random.Random(seed)

    def problem(k: int) -> list[WorkloadRequest]:
        length = _lognormal(rng, 2950 * scale, 1650 * scale, 50 * scale, 16000 * scale)
        segs = [Segment("pg-demo", int(900 * scale)), Segment(f"pg-problem-{seed}-{k}", length)]
        return [
            WorkloadRequest(segs, _lognormal(rng, 190, 343, 1, 2048), f"problem-{k}")
            for _ in range(rng.randint(1, 12))
        ]

    return _grouped(n, rng, problem)


def videoqa(n: int, seed: int = 0, scale: float = 1.0) -> list[WorkloadRequest]:
    """A tokenized video and a multiple-choice question; ~8.6 questions per video."""
    rng = random.Random(seed)

    def video(k: int) -> list[WorkloadRequest]:
        frames = Segment(f"vq-video-{seed}-{k}", _normal(rng, 9800 * scale, 6000 * scale, 500 * scale))
        count = 1 if rng.random() < 0.1 else _normal(rng, 9.5, 2, 2)
        return [
            WorkloadRequest([frames, Segment(f"vq-q-{seed}-{k}-{q}", _normal(rng, 25, 8, 5))],
                            _normal(rng, 4, 1.5, 1), f"video-{k}")
            for q in range(count)
        ]  # fmt: skip

    return _grouped(n, rng, video)


def loogle(n: int, seed: int = 0, scale: float = 1.0) -> list[WorkloadRequest]:
    """A 13-token system prompt, a long document, a question; ~18 questions per document."""
    rng = random.Random(seed)

    def document(k: int) -> list[WorkloadRequest]:
        doc = Segment(f"lg-doc-{seed}-{k}", _normal(rng, 23400 * scale, 6100 * scale, 1000 * scale))
        count = 1 if rng.random() < 0.3 else _normal(rng, 20, 8.6, 2)
        system = Segment("lg-system", 13)
        return [
            WorkloadRequest([system, doc, Segment(f"lg-q-{seed}-{k}-{q}", _normal(rng, 40, 15, 5))],
                            _normal(rng, 16, 9.9, 1), f"doc-{k}")
            for q in range(count)
        ]  # fmt: skip

    return _grouped(n, rng, document)


def chat(n: int, seed: int = 0, scale: float = 1.0) -> list[WorkloadRequest]:
    """Multi-turn chat: conversations over one of a few application system prompts (Zipf
    popularity), 40% of them over one shared document as well (Zipf-1.0 over the
    documents: a few are hot), each turn's prompt the whole conversation so far. Shapes
    from ShareGPT-style statistics: turns long-tailed around 5, user messages ~90 tokens
    and answers ~220 with long tails, think times of seconds to minutes. A conversation
    ends before a turn that would pass a 16k-token context (× scale), as a chat
    application bounds its history; a first turn's answer is cut to fit."""
    rng = random.Random(seed)
    context = int(16000 * scale)
    systems = [_lognormal(random.Random(seed * 31 + k), 1300 * scale, 500 * scale, 200 * scale, 3000 * scale)
               for k in range(3)]  # fmt: skip
    num_docs = max(6, n // 150)
    docs = [_lognormal(random.Random(seed * 37 + k), 5000 * scale, 2500 * scale, 500 * scale, 8000 * scale)
            for k in range(num_docs)]  # fmt: skip
    out: list[WorkloadRequest] = []
    conv = 0
    while len(out) < n:
        app = _zipf(rng, len(systems), 1.0)
        history = [Segment(f"ct-system-{app}", systems[app])]
        group = f"app-{app}"
        if rng.random() < 0.4:
            d = _zipf(rng, num_docs, 1.0)
            history.append(Segment(f"ct-doc-{seed}-{d}", docs[d]))
            group = f"doc-{d}"
        for turn in range(_lognormal(rng, 5, 3.5, 1, 24)):
            words = _lognormal(rng, 90 * scale, 110 * scale, 4, 1500 * scale)
            user = Segment(f"ct-u-{seed}-{conv}-{turn}", words)
            length = _lognormal(rng, 220, 180, 8, 1024)
            prompt = sum(s.length for s in history) + user.length
            if prompt + length > context:
                if turn:
                    break
                length = context - prompt
            history.append(user)
            answer = Segment(f"ct-a-{seed}-{conv}-{turn}", length)
            request = WorkloadRequest(list(history), length, group, answer=answer)
            if turn:
                request.after, request.think_s = len(out) - 1, _lognormal(rng, 20, 15, 2, 120)
            out.append(request)
            history.append(answer)
            if len(out) == n:
                break
        conv += 1
    return out


def multi_tenant(n: int, seed: int = 0, scale: float = 1.0, num_tenants: int = 0) -> list[WorkloadRequest]:
    """Multi-tenant system prompts, the shape llm-d benchmarks its prefix-cache scorer on:
    many tenants each with a long private context (~6,000 tokens), several users per
    tenant (five) each asking ~1,200-token questions, Poisson arrivals. Tenants' traffic is
    mildly skewed (Zipf-0.6): real tenants differ in size."""
    rng = random.Random(seed)
    tenants = num_tenants or max(8, n // 10)
    context = [_normal(random.Random(seed * 41 + t), 6000 * scale, 1500 * scale, 1000 * scale)
               for t in range(tenants)]  # fmt: skip
    out = []
    for i in range(n):
        t, user = _zipf(rng, tenants, 0.6), rng.randrange(5)
        segs = [
            Segment(f"mt-tenant-{seed}-{t}", context[t]),
            Segment(f"mt-q-{seed}-{t}-{user}-{i}", _normal(rng, 1200 * scale, 400 * scale, 50 * scale)),
        ]
        out.append(WorkloadRequest(segs, _lognormal(rng, 200, 150, 4, 1024), f"tenant-{t}"))
    return out


def shifting_docs(n: int, seed: int = 0, scale: float = 1.0, epoch: int = 0) -> list[WorkloadRequest]:
    """Retrieval over documents whose popularity shifts abruptly, as news, a launch or a
    viral document makes it: questions over one long document each (a 300-token system
    prompt, a document of ~6,000 tokens, a ~60-token question, ~120-token answers), the
    document drawn by Zipf-1.2 over a popularity order that is drawn anew every ``epoch``
    requests (default ``n / 10``: ~4 s at four instances' stress rate for 1,000), so the
    few hot documents of one epoch are cold in the next; 30% of requests are a background
    of unshared prompts (~900 tokens, ~200-token answers)."""
    rng = random.Random(seed)
    num_docs = max(40, n // 25)
    docs = [_lognormal(random.Random(seed * 43 + k), 6000 * scale, 3000 * scale, 1000 * scale, 16000 * scale)
            for k in range(num_docs)]  # fmt: skip
    epoch_len, order, out = epoch or max(1, n // 10), list(range(num_docs)), []
    system = Segment("sd-system", int(300 * scale) or 1)
    for i in range(n):
        if i % epoch_len == 0:
            rng.shuffle(order)  # the new epoch's popularity: its hot documents
        if rng.random() < 0.3:
            length = _lognormal(rng, 900 * scale, 600 * scale, 50 * scale, 4000 * scale)
            prompt = Segment(f"sd-bg-{seed}-{i}", length)
            out.append(WorkloadRequest([prompt], _lognormal(rng, 200, 150, 4, 1024), "background"))
            continue
        d = order[_zipf(rng, num_docs, 1.2)]
        question = Segment(f"sd-q-{seed}-{i}", _lognormal(rng, 60 * scale, 30 * scale, 5, 400 * scale))
        doc = Segment(f"sd-doc-{seed}-{d}", docs[d])
        out.append(WorkloadRequest([system, doc, question], _lognormal(rng, 120, 80, 4, 512), f"doc-{d}"))
    return out


def agentic(n: int, seed: int = 0, scale: float = 1.0) -> list[WorkloadRequest]:
    """Agent trajectories: one of four agent applications' tool-definition system prompts
    (~4,000 tokens, Zipf popularity), a task (~200 tokens), then steps until done (~8,
    2–30, at most a 32k-token context × scale): each step the model writes an action
    (~80-token answer) and the tool's output (~400 tokens, long-tailed) joins the prompt
    of the next step, sent when the tool returns (a follower, ``think_s`` ~2 s, 0.2–30 s):
    long shared prefixes, and trajectories that grow while their tools run."""
    rng = random.Random(seed)
    tools = [_lognormal(random.Random(seed * 47 + k), 4000 * scale, 1500 * scale, 800 * scale, 9000 * scale)
             for k in range(4)]  # fmt: skip
    out: list[WorkloadRequest] = []
    run = 0
    while len(out) < n:
        app = _zipf(rng, len(tools), 1.0)
        task = Segment(f"ag-task-{seed}-{run}", _lognormal(rng, 200 * scale, 100 * scale, 20, 1000 * scale))
        history = [Segment(f"ag-tools-{app}", tools[app]), task]
        for step in range(_lognormal(rng, 8, 6, 2, 30)):
            action = Segment(f"ag-a-{seed}-{run}-{step}", _lognormal(rng, 80, 60, 8, 512))
            if sum(s.length for s in history) + action.length > 32000 * scale:
                break
            request = WorkloadRequest(list(history), action.length, f"agent-{app}", answer=action)
            if step:
                tool_s = min(30.0, max(0.2, rng.lognormvariate(math.log(1.5), 0.8)))  # median 1.5 s, mean ~2
                request.after, request.think_s = len(out) - 1, tool_s
            out.append(request)
            observation = _lognormal(rng, 400 * scale, 600 * scale, 10, 4000 * scale)
            history += [action, Segment(f"ag-o-{seed}-{run}-{step}", observation)]
            if len(out) == n:
                break
        run += 1
    return out


WORKLOADS: dict[str, Callable[..., list[WorkloadRequest]]] = {
    "toolbench": toolbench,
    "embodied_agent": embodied_agent,
    "programming": programming,
    "videoqa": videoqa,
    "loogle": loogle,
    "chat": chat,
    "multi_tenant": multi_tenant,
    "shifting_docs": shifting_docs,
    # popularity that holds for ~a minute at four instances' stress rate (1,400 requests)
    "shifting_docs_minute": functools.partial(shifting_docs, epoch=1400),
    "agentic": agentic,
}


def generate(name: str, n: int, seed: int = 0, scale: float = 1.0) -> list[WorkloadRequest]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: expected one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name](n, seed=seed, scale=scale)


def mix(parts: list[tuple[list[WorkloadRequest], float]], seed: int = 0) -> list[WorkloadRequest]:
    """Interleave workloads, drawing from each in proportion to its weight."""
    rng = random.Random(seed)
    queues = [list(reqs) for reqs, _ in parts]
    weights = [w for _, w in parts]
    out = []
    while any(queues):
        k = rng.choices(
            [i for i, q in enumerate(queues) if q], weights=[weights[i] for i, q in enumerate(queues) if q]
        )[0]
        out.append(queues[k].pop(0))
    return out


def poisson_arrivals(requests: list[WorkloadRequest], rps: float, seed: int = 0) -> list[WorkloadRequest]:
    """Poisson arrivals averaging ``rps`` requests per second: the independent requests
    (conversation starts) at ``rps`` × their share, so that with their followers the trace
    offers ``rps`` on average; a follower's ``arrival`` is its predecessor's plus its think
    time, the earliest it can be sent (closed-loop players wait for the answer too)."""
    rng = random.Random(seed)
    independent = sum(1 for r in requests if r.after is None)
    rate = rps * independent / len(requests) if requests else rps
    t = 0.0
    for r in requests:
        if r.after is None:
            t += rng.expovariate(rate)
            r.arrival = t
        else:
            r.arrival = requests[r.after].arrival + r.think_s
    return requests


# ---- materializing segments ---------------------------------------------------------------


@dataclass
class Materializer:
    """Token ids for the simulator (any vocabulary), or text sized in a real tokenizer."""

    vocab_size: int = 32000
    tokenizer: object = None
    _ids: dict[str, list[int]] = field(default_factory=dict)
    _text: dict[str, str] = field(default_factory=dict)

    def segment_ids(self, seg: Segment) -> list[int]:
        if seg.id not in self._ids:
            import numpy as np  # here, not at the top: ``preble --help`` lists the workloads

            gen = np.random.default_rng(_stable_seed(seg.id))
            self._ids[seg.id] = gen.integers(10, self.vocab_size, seg.length).tolist()
        return self._ids[seg.id]

    def token_ids(self, req: WorkloadRequest) -> list[int]:
        return [t for seg in req.segments for t in self.segment_ids(seg)]

    def _segment_text(self, seg: Segment) -> str:
        if seg.id not in self._text:
            rng = random.Random(_stable_seed(seg.id))
            words = [rng.choice(_WORDS) for _ in range(max(1, seg.length))]
            text = " " + " ".join(words)
            if self.tokenizer is not None:  # trim to the wanted number of tokens (a segment may
                # pass the tokenizer's model_max_length: it is sized here, not sent whole)
                ids = self.tokenizer(text, add_special_tokens=False, verbose=False).input_ids[: seg.length]
                text = self.tokenizer.decode(ids)
            self._text[seg.id] = text
        return self._text[seg.id]

    def text(self, req: WorkloadRequest) -> str:
        return "".join(self._segment_text(s) for s in req.segments)


def _stable_seed(text: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
