"""Block-size sweep of the extend kernel on this GPU, so the tiles in ``tuning`` for its
generation are chosen by measurement:

    python -m kernels.sweep        # on the GPU machine; prints every config, best last

Each config runs the benchmark's extend shapes (bf16, Llama-3-8B heads) and must give the
current tiles' output (to bf16 rounding) before its time counts. It prints the best config
over all shapes (the geometric mean of the times against the current ones: ``TABLE``'s row)
and the best for each chunk class (``EXTEND_TILES`` rows, to paste into ``tuning.py``).
"""

from __future__ import annotations

import itertools
import math

import torch

from kernels import extend_attention, tuning
from kernels.benchmark import GPU, bench_ms, paged
from kernels.tuning import ExtendTile, chunk_class

Result = tuple[ExtendTile, list[float]]  # a config and its time on each shape


def geomean_ratio(times: list[float], base: list[float]) -> float:
    return math.exp(sum(math.log(t / b) for t, b in zip(times, base)) / len(base))


def best_per_class(
    results: list[Result], base: list[float], classes: list[str]
) -> dict[str, tuple[float, ExtendTile]]:
    """For each chunk class, the config fastest on that class's shapes (geometric mean of
    time against the current config's), with its ratio; a class keeps the current tile
    (not listed) unless some config beats it."""
    best: dict[str, tuple[float, ExtendTile]] = {}
    for cls in dict.fromkeys(classes):
        idx = [i for i, c in enumerate(classes) if c == cls]
        for tile, times in results:
            ratio = geomean_ratio([times[i] for i in idx], [base[i] for i in idx])
            if ratio < 1.0 and (cls not in best or ratio < best[cls][0]):
                best[cls] = (ratio, tile)
    return best


def main() -> int:
    if not torch.cuda.is_available():
        print("kernels.sweep needs a CUDA GPU")
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    key, head_dim = tuning.generation(device), GPU.heads[2]
    torch.manual_seed(0)
    cases, classes = [], []
    for batch, chunk, prefix in GPU.extend:
        q_lens, prefix_lens = [chunk] * batch, [prefix] * batch
        q, k, v, table = paged(q_lens, prefix_lens, GPU, dtype, device)
        cases.append((q, k, v, table, q_lens, prefix_lens, GPU.page_size))
        classes.append(chunk_class(chunk))
    expected = [extend_attention(*case) for case in cases]
    base = [bench_ms(device, extend_attention, *case) for case in cases]
    print(f"{key} current {tuning.TABLE[key]}, shape tiles {tuning.EXTEND_TILES}: "
          + ", ".join(f"{t:.3f}" for t in base) + " ms")  # fmt: skip
    saved = dict(tuning.EXTEND_TILES)
    results: list[Result] = []
    for m, n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        tile = ExtendTile(m, n, warps, stages)
        tuning.EXTEND_TILES.update({(key, head_dim, c): tile for c in ("short", "medium", "long")})
        label = f"m={m} n={n} warps={warps} stages={stages}"
        try:
            errors = [rel(extend_attention(*case), want) for case, want in zip(cases, expected)]
            if max(errors) > 1e-2:
                print(f"{label}: wrong output (rel. diff {max(errors):.1e})")
                continue
            times = [bench_ms(device, extend_attention, *case) for case in cases]
        except Exception as err:  # noqa: BLE001 - a config past the card's resources is skipped
            print(f"{label}: {type(err).__name__}: {str(err)[:80]}")
            continue
        results.append((tile, times))
        print(f"{label}: {geomean_ratio(times, base):.3f}x current; " + ", ".join(f"{t:.3f}" for t in times))
    tuning.EXTEND_TILES.clear()
    tuning.EXTEND_TILES.update(saved)
    print("\nbest over all shapes (geometric mean of time vs current; lower is faster):")
    for tile, times in sorted(results, key=lambda r: geomean_ratio(r[1], base))[:5]:
        print(f"  {geomean_ratio(times, base):.3f}  {tile}  " + ", ".join(f"{t:.3f}" for t in times))
    print("\nbest per chunk class (EXTEND_TILES rows):")
    for cls, (ratio, tile) in best_per_class(results, base, classes).items():
        print(f'    ("{key}", {head_dim}, "{cls}"): {tile},  # {ratio:.3f}x the current tile')
    return 0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


if __name__ == "__main__":
    raise SystemExit(main())
