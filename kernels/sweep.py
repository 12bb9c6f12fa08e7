"""Block-size sweep of the extend kernel on this GPU, so the row of ``tuning.TABLE`` for its
generation is chosen by measurement:

    python -m kernels.sweep        # on the GPU machine; prints every config, best last

Each config runs the benchmark's extend shapes (bf16, Llama-3-8B heads) and must give the
table's current config's output (to bf16 rounding) before its time counts; the summary is
the geometric mean of the times against the current config's.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import torch

from kernels import extend_attention, tuning
from kernels.benchmark import GPU, bench_ms, paged


def main() -> int:
    if not torch.cuda.is_available():
        print("kernels.sweep needs a CUDA GPU")
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    major, minor = torch.cuda.get_device_capability(device)
    key = f"sm{major}{minor}" if f"sm{major}{minor}" in tuning.TABLE else "sm90" if major >= 9 else "sm80"
    current = tuning.TABLE[key]
    torch.manual_seed(0)
    cases = []
    for batch, chunk, prefix in GPU.extend:
        q_lens, prefix_lens = [chunk] * batch, [prefix] * batch
        q, k, v, table = paged(q_lens, prefix_lens, GPU, dtype, device)
        cases.append((q, k, v, table, q_lens, prefix_lens, GPU.page_size))
    expected = [extend_attention(*case) for case in cases]
    base = [bench_ms(device, extend_attention, *case) for case in cases]
    print(f"{key} current {current}: " + ", ".join(f"{t:.3f}" for t in base) + " ms")
    results = []
    for m, n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        blocks = replace(current, extend_m=m, extend_n=n, chunk_warps=warps, num_stages=stages)
        tuning.TABLE[key] = blocks
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
        ratio = math.exp(sum(math.log(t / b) for t, b in zip(times, base)) / len(base))
        results.append((ratio, label, times))
        print(f"{label}: {ratio:.3f}x current; " + ", ".join(f"{t:.3f}" for t in times))
    tuning.TABLE[key] = current
    print("\nbest (geometric mean of time vs current; lower is faster):")
    for ratio, label, times in sorted(results, reverse=True)[-5:]:
        print(f"  {ratio:.3f}  {label}  " + ", ".join(f"{t:.3f}" for t in times))
    return 0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


if __name__ == "__main__":
    raise SystemExit(main())
