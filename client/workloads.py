"""Workload generators: prompts with the sharing structure of the paper's workloads.

``toolbench``: a shared system prompt, then the documentation of one tool chosen with
Zipf(1.1) popularity (so a few tools are hot), then a user question. Requests that pick
the same tool share system prompt + tool documentation, the part the paper calls the key
portion. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = (
    "query result list item value range filter limit offset page sort field name type date time "
    "city weather price stock flight hotel route map video frame scene object person score rank "
    "search fetch update create delete status report summary detail language translate convert"
).split()


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: str
    max_tokens: int
    group: str  # which shared prefix (tool, document, video...) it uses


def _zipf_index(rng: random.Random, n: int, s: float) -> int:
    weights = [1.0 / (k**s) for k in range(1, n + 1)]
    return rng.choices(range(n), weights=weights)[0]


def _tool_doc(rng: random.Random, tool: int, words: int) -> str:
    params = ", ".join(
        f"{rng.choice(_WORDS)}_{i}: {rng.choice(['str', 'int', 'float', 'bool'])}" for i in range(6)
    )
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"Tool tool_{tool}({params}).\nDescription: {body}\n"


def toolbench(
    num_requests: int, num_tools: int = 200, doc_words: int = 400, max_tokens: int = 32, seed: int = 0
) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    system = "You are an agent that calls tools. Answer with a JSON tool call.\n" + " ".join(
        rng.choice(_WORDS) for _ in range(100)
    )
    docs = [_tool_doc(random.Random(seed * 100_003 + t), t, doc_words) for t in range(num_tools)]
    requests = []
    for _ in range(num_requests):
        tool = _zipf_index(rng, num_tools, 1.1)
        question = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 30)))
        requests.append(
            WorkloadRequest(
                f"{system}\n{docs[tool]}User: {question}?\nAssistant:", max_tokens, f"tool_{tool}"
            )
        )
    return requests


WORKLOADS = {"toolbench": toolbench}
