"""Table 1 of the paper for our workloads: prompt and output lengths, the share of each
prompt that is a shared prefix, the key portion's share and how many requests share it,
measured over the prefix tree of all prompts (an infinite cache), with the paper's
numbers (``TABLE1``) to print beside them."""

from __future__ import annotations

import math

import numpy as np

from preble_backend.common.block_hash import chain_hashes
from scheduler.global_tree import GlobalPrefixTree

TABLE1 = {
    "toolbench": ((1835, 742), (43, 16), (85, 13), (76, 16), (39, 64)),
    "embodied_agent": ((2285, 471), (16, 13), (97, 14), (76, 12), (48, 8)),
    "programming": ((3871, 1656), (190, 343), (97, 7.4), (78, 13), (126, 2157)),
    "videoqa": ((9865, 5976), (4, 1.5), (88, 32), (99, 0.2), (8.6, 2)),
    "loogle": ((23474, 6105), (16, 9.9), (91, 24), (94, 15), (18, 8.6)),
}
STAT_NAMES = ("prompt_len", "output_len", "shared_prefix_pct", "key_portion_pct", "req_share_key")


def summarize(prompts: list[list[int]], output_lens: list[int]) -> dict[str, tuple[float, float]]:
    """Table 1's statistics over the prefix tree of all prompts (an infinite cache)."""
    tree = GlobalPrefixTree(1, window_s=math.inf, page_size=1)  # token-exact, as Table 1
    ends = [tree.route(chain_hashes(p, 1), 0, 0.0) for p in prompts]
    shared, key_pct, key_share = [], [], []
    for prompt, end in zip(prompts, ends):
        path = end.path() if end is not tree.root else []
        shared.append(100 * sum(len(n.hashes) for n in path if n.pending.get(0, 0) >= 2) / len(prompt))
        key, before = None, 0
        for node in path:
            if len(node.hashes) > before:
                key = node
            before += len(node.hashes)
        key_pct.append(100 * len(key.hashes) / len(prompt) if key else 0.0)
        key_share.append(key.pending.get(0, 0) if key else 0)
    columns = ([len(p) for p in prompts], output_lens, shared, key_pct, key_share)
    return {name: (float(np.mean(c)), float(np.std(c))) for name, c in zip(STAT_NAMES, columns)}


def summary_table(name: str, stats: dict[str, tuple[float, float]], paper: str | None = None) -> str:
    """Our statistics beside Table 1's row for ``paper`` (default: ``name``); a workload
    the paper did not measure (chat, multi_tenant) gets ours alone."""
    row = TABLE1.get(paper or name)
    if row is None:
        lines = [f"{name}: (mean, std); the paper did not measure it", "| statistic | ours |", "|---|---|"]
        lines += [f"| {key} | ({stats[key][0]:.1f}, {stats[key][1]:.1f}) |" for key in STAT_NAMES]
        return "\n".join(lines)
    paper_row = dict(zip(STAT_NAMES, row))
    lines = [f"{name}: ours (mean, std) vs paper Table 1", "| statistic | ours | paper |", "|---|---|---|"]
    for key in STAT_NAMES:
        m, s = stats[key]
        pm, ps = paper_row[key]
        lines.append(f"| {key} | ({m:.1f}, {s:.1f}) | ({pm}, {ps}) |")
    return "\n".join(lines)
