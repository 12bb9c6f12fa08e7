"""Latency against request rate, one line per policy, like the paper's Figure 5: the
live benchmark (``preble bench``) and the simulator's sweeps draw the same picture."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

MARKERS, STYLES = "osD^vx<>", ("-", "--", ":", "-.")


def latency_vs_rate(records: list[dict], path: str | Path, caption: str) -> list[tuple[float, float]]:
    """Average and p99 latency against ``rps``; records of one policy at one rate (repeats,
    or traces) are averaged, their spread drawn as error bars. Distinct markers and line
    styles keep coinciding policies visible; linear axes with plain ticks. Returns each
    axis's y range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    peaks: list[dict[str, float]] = [{}, {}]  # per axis: each policy's highest point
    highest: dict[str, float] = {}  # per metric: the top of the highest error bar
    for k, policy in enumerate(dict.fromkeys(r["policy"] for r in records)):
        rows = [r for r in records if r["policy"] == policy]
        rates = sorted({r["rps"] for r in rows})
        for ax, key, peak in zip(axes, ("avg_latency_s", "p99_latency_s"), peaks):
            values = [[r[key] for r in rows if r["rps"] == rps] for rps in rates]
            mean = [float(np.mean(v)) for v in values]
            spread = [[m - min(v) for m, v in zip(mean, values)], [max(v) - m for m, v in zip(mean, values)]]
            # Hollow markers, each policy's smaller than the one before: where two policies
            # coincide (round-robin and least-load often do) both stay visible.
            ax.errorbar(rates, mean, yerr=spread, marker=MARKERS[k % len(MARKERS)], markersize=11 - 1.2 * k,
                        markerfacecolor="none", markeredgewidth=1.6, linestyle=STYLES[k % len(STYLES)],
                        capsize=3, label=policy)  # fmt: skip
            peak[policy] = max(mean)
            highest[key] = max(highest.get(key, 0.0), *(m + up for m, up in zip(mean, spread[1])))
    for ax, key in zip(axes, ("avg_latency_s", "p99_latency_s")):  # room above the top marker
        ax.set_ylim(0, max(ax.get_ylim()[1], 1.12 * highest.get(key, 0.0)))
    for ax, peak in zip(axes, peaks):
        _clip_outlier(ax, peak)
    for ax, title in zip(axes, ("average latency (s)", "p99 latency (s)")):
        ax.set_xlabel("requests per second")
        ax.set_ylabel(title)
        ax.ticklabel_format(style="plain", axis="both")
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc="upper left")
    fig.suptitle(caption)
    fig.tight_layout()
    save_png(fig, path)
    limits = [ax.get_ylim() for ax in axes]
    plt.close(fig)
    return limits


def save_png(fig, path: str | Path) -> None:
    """The figure as a 256-colour PNG: a third of matplotlib's RGBA bytes for a picture of
    a few line colours, so the records the repository keeps stay small enough to travel
    with every device call (``kernels/device_bundle.py``)."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=90, format="png")
    palette = (
        Image.open(buffer).convert("RGB").quantize(256, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    )
    palette.save(path, format="PNG", optimize=True)


def _clip_outlier(ax, peak: dict[str, float], factor: float = 2.5) -> None:
    """One policy far above the rest would flatten them all: cut the axis above the
    others and print the outlier's highest value instead."""
    ranked = sorted(peak.items(), key=lambda item: item[1], reverse=True)
    if len(ranked) < 2 or ranked[0][1] <= factor * ranked[1][1]:
        return
    ax.set_ylim(0, 1.3 * ranked[1][1])
    ax.text(0.98, 0.97, f"{ranked[0][0]} off scale (up to {ranked[0][1]:,.0f} s)", transform=ax.transAxes,
            ha="right", va="top", fontsize=8, color="dimgray")  # fmt: skip
