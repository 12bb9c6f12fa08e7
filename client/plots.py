"""Latency against request rate, one line per policy, like the paper's Figure 5: the
live benchmark (``preble bench``) and the simulator's sweeps draw the same picture."""

from __future__ import annotations

from pathlib import Path

import numpy as np

MARKERS, STYLES = "osD^vx<>", ("-", "--", ":", "-.")


def latency_vs_rate(records: list[dict], path: str | Path, caption: str) -> None:
    """Average and p99 latency against ``rps``; records of one policy at one rate (repeats,
    or traces) are averaged, their spread drawn as error bars. Distinct markers and line
    styles keep coinciding policies visible; linear axes with plain ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for k, policy in enumerate(dict.fromkeys(r["policy"] for r in records)):
        rows = [r for r in records if r["policy"] == policy]
        rates = sorted({r["rps"] for r in rows})
        for ax, key in zip(axes, ("avg_latency_s", "p99_latency_s")):
            values = [[r[key] for r in rows if r["rps"] == rps] for rps in rates]
            mean = [float(np.mean(v)) for v in values]
            spread = [[m - min(v) for m, v in zip(mean, values)], [max(v) - m for m, v in zip(mean, values)]]
            ax.errorbar(rates, mean, yerr=spread, marker=MARKERS[k % len(MARKERS)],
                        linestyle=STYLES[k % len(STYLES)], capsize=3, label=policy)  # fmt: skip
    for ax, title in zip(axes, ("average latency (s)", "p99 latency (s)")):
        ax.set_xlabel("requests per second")
        ax.set_ylabel(title)
        ax.set_ylim(bottom=0)
        ax.ticklabel_format(style="plain", axis="both")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(caption)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
