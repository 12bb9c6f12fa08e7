"""Benchmark of the attention kernels on a CUDA GPU, against the card's own ceilings and
FlashInfer when it is installed.

    python -m kernels.benchmark [--out docs/KERNELS.md]    # on the GPU machine
    python -m kernels.benchmark --smoke --out /tmp/k.md    # tiny shapes (the CPU interpreter without a GPU)

It measures the copy bandwidth (bytes read + written by a large device copy) and the bf16
matmul rate first, then each kernel over a grid of shapes (random data, never zeros;
median of CUDA-event timings), and writes the table between the ``bench`` markers of the
output file with the machine and the date. ``--smoke`` runs the same code paths on tiny
shapes so CI keeps the script working; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from kernels import cascade_attention, decode_attention, extend_attention, kv_write, merge_state
from kernels.flashinfer_paged import FlashInferPaged

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


@dataclass
class Shapes:
    heads: tuple[int, int, int]  # query heads, KV heads, head dim
    page_size: int
    decode: list[tuple[int, int]]  # (batch, context)
    extend: list[tuple[int, int, int]]  # (batch, chunk, prefix)
    cascade: list[tuple[int, int, int]]  # (batch, shared prefix, own suffix)
    rows: int  # merge_state rows and kv_write tokens
    copy_elems: int
    matmul_n: int


GPU = Shapes(
    heads=(32, 8, 128), page_size=16,
    decode=[(b, c) for b in (1, 32, 128) for c in (2048, 8192, 32768)],
    extend=[(1, 4096, 0), (4, 2048, 0), (8, 512, 8192), (32, 128, 4096), (16, 1024, 2048)],
    cascade=[(128, 32768, 256), (64, 8192, 256), (128, 4096, 64)],
    rows=8192, copy_elems=1 << 30, matmul_n=8192,
)  # fmt: skip
SMOKE = Shapes(
    heads=(4, 2, 64), page_size=4, decode=[(2, 40)], extend=[(2, 16, 24)], cascade=[(3, 32, 4)],
    rows=8, copy_elems=1 << 16, matmul_n=64,
)  # fmt: skip


def bench_ms(device: torch.device, fn, *args, **kwargs) -> float:
    """Median milliseconds of ``fn(*args, **kwargs)``: CUDA events on a GPU."""
    if device.type == "cuda":
        return triton.testing.do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn(*args, **kwargs)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def paged(q_lens, prefix_lens, shapes: Shapes, dtype, device, shared: int = 0):
    """Random q and K/V over randomly permuted pages; the first ``shared`` tokens of every
    request map to the same pages, as the radix cache would hand them out."""
    num_heads, num_kv_heads, head_dim = shapes.heads
    ps = shapes.page_size
    shared_pages = shared // ps
    own = [-(-(p + q) // ps) - shared_pages for p, q in zip(prefix_lens, q_lens)]
    perm = torch.randperm(shared_pages + sum(own), device=device, dtype=torch.int32)
    table = torch.zeros((len(q_lens), shared_pages + max(own)), dtype=torch.int32, device=device)
    table[:, :shared_pages] = perm[:shared_pages]
    used = shared_pages
    for b, n in enumerate(own):
        table[b, shared_pages : shared_pages + n] = perm[used : used + n]
        used += n
    slots = used * ps
    k = torch.randn((slots, num_kv_heads, head_dim), dtype=dtype, device=device)
    v = torch.randn_like(k)
    q = torch.randn((sum(q_lens), num_heads, head_dim), dtype=dtype, device=device)
    return q, k, v, table


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(shapes: Shapes, device: torch.device, dtype: torch.dtype) -> tuple[list[str], list[list[str]]]:
    notes, rows = [], []

    def add(row: list[str]) -> None:  # printed as measured: a run cut short still reports
        rows.append(row)
        print("| " + " | ".join(row) + " |", flush=True)

    n = shapes.copy_elems
    src = torch.randn(n, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * n * src.element_size() / bench_ms(device, dst.copy_, src) / 1e6
    m = shapes.matmul_n
    a, b = torch.randn((m, m), dtype=dtype, device=device), torch.randn((m, m), dtype=dtype, device=device)
    mm_tflops = 2 * m**3 / bench_ms(device, torch.matmul, a, b) / 1e9
    notes.append(
        f"copy bandwidth {copy_gbs:,.0f} GB/s (read + write); {dtype} matmul {mm_tflops:,.0f} TFLOP/s"
    )
    del src, dst, a, b
    fi = None
    if device.type == "cuda":
        try:
            fi = FlashInferPaged(device)
        except ValueError as err:
            notes.append(f"FlashInfer unavailable ({err}): its columns are empty")
    num_heads, num_kv_heads, head_dim = shapes.heads
    ps, kv_bytes = (
        shapes.page_size,
        2 * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size(),
    )

    def compare(q, k, v, table, q_lens, seq_lens, ours_ms, ours_out):
        nonlocal fi
        if fi is None:
            return ["", "", ""]
        try:  # FlashInfer compiles its kernels at first use; a failure leaves our columns standing
            wrapper = fi.plan(q, k, table, q_lens, seq_lens, ps)
            paged_kv = (k.view(-1, ps, *k.shape[1:]), v.view(-1, ps, *v.shape[1:]))
            theirs = wrapper.run(q, paged_kv)
            fi_ms = bench_ms(device, wrapper.run, q, paged_kv)
        except Exception as err:  # noqa: BLE001 - any failure of the optional comparison
            notes.append(f"FlashInfer failed ({type(err).__name__}: {str(err)[:200]}): its columns are empty")
            fi = None
            return ["", "", ""]
        return [f"{fi_ms:.3f}", f"{ours_ms / fi_ms:.2f}", f"{rel(ours_out, theirs):.1e}"]

    for batch, ctx in shapes.decode:
        q, k, v, table = paged([1] * batch, [ctx - 1] * batch, shapes, dtype, device)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        out = decode_attention(q, k, v, table, lens, ps, max_kv_len=ctx)
        ms = bench_ms(device, decode_attention, q, k, v, table, lens, ps, max_kv_len=ctx)
        gbs = batch * ctx * kv_bytes / ms / 1e6
        fi_cols = compare(q, k, v, table, [1] * batch, [ctx] * batch, ms, out)
        add(
            [
                "decode",
                f"b={batch} ctx={ctx}",
                f"{ms:.3f}",
                f"{gbs:,.0f} GB/s",
                f"{gbs / copy_gbs:.0%}",
                *fi_cols,
            ]
        )
    for batch, chunk, prefix in shapes.extend:
        q_lens, prefix_lens = [chunk] * batch, [prefix] * batch
        q, k, v, table = paged(q_lens, prefix_lens, shapes, dtype, device)
        out = extend_attention(q, k, v, table, q_lens, prefix_lens, ps)
        ms = bench_ms(device, extend_attention, q, k, v, table, q_lens, prefix_lens, ps)
        flops = 4 * num_heads * head_dim * batch * (chunk * prefix + chunk * (chunk + 1) / 2)
        tflops = flops / ms / 1e9
        fi_cols = compare(q, k, v, table, q_lens, [chunk + prefix] * batch, ms, out)
        add(
            ["extend", f"b={batch} q={chunk} prefix={prefix}", f"{ms:.3f}", f"{tflops:,.0f} TFLOP/s",
             f"{tflops / mm_tflops:.0%}", *fi_cols]
        )  # fmt: skip
    for batch, shared, suffix in shapes.cascade:
        q_lens, prefix_lens = [1] * batch, [shared + suffix - 1] * batch
        q, k, v, table = paged(q_lens, prefix_lens, shapes, dtype, device, shared=shared)
        groups = [(list(range(batch)), shared)]
        lens = torch.full((batch,), shared + suffix, dtype=torch.int32, device=device)
        plain_out = decode_attention(q, k, v, table, lens, ps)
        out = cascade_attention(q, k, v, table, q_lens, prefix_lens, ps, groups)
        plain = bench_ms(device, decode_attention, q, k, v, table, lens, ps)
        ms = bench_ms(device, cascade_attention, q, k, v, table, q_lens, prefix_lens, ps, groups)
        speedup = f"{plain / ms:.2f}x plain decode ({plain:.3f} ms)"
        shape = f"b={batch} shared={shared} suffix={suffix}"
        add(
            ["cascade decode", shape, f"{ms:.3f}", speedup, "", "", "", f"{rel(out, plain_out):.1e} vs plain"]
        )
    r = shapes.rows
    va, vb = (
        torch.randn((r, num_heads, head_dim), device=device),
        torch.randn((r, num_heads, head_dim), device=device),
    )
    sa, sb = torch.randn((r, num_heads), device=device), torch.randn((r, num_heads), device=device)
    ms = bench_ms(device, merge_state, va, sa, vb, sb)
    gbs = 3 * va.numel() * 4 / ms / 1e6
    add(
        [
            "merge_state",
            f"rows={r} fp32",
            f"{ms:.3f}",
            f"{gbs:,.0f} GB/s",
            f"{gbs / copy_gbs:.0%}",
            "",
            "",
            "",
        ]
    )
    k_new = torch.randn((r, num_kv_heads, head_dim), dtype=dtype, device=device)
    k_cache = torch.empty((4 * r, num_kv_heads, head_dim), dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(4 * r, device=device)[:r]
    ms = bench_ms(device, kv_write, k_cache, v_cache, k_new, k_new, slots)
    gbs = 4 * k_new.numel() * k_new.element_size() / ms / 1e6
    add(["kv_write", f"tokens={r}", f"{ms:.3f}", f"{gbs:,.0f} GB/s", f"{gbs / copy_gbs:.0%}", "", "", ""])
    return notes, rows


def markdown(notes: list[str], rows: list[list[str]], machine: str, command: str) -> str:
    head = [
        "kernel",
        "shape",
        "ms",
        "achieved",
        "of ceiling",
        "FlashInfer ms",
        "ours / FlashInfer",
        "rel. diff",
    ]
    lines = [
        f"Measured {datetime.date.today().isoformat()} on {machine} with `{command}`.",
        "",
        *[f"- {n}" for n in notes],
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *["| " + " | ".join(r) + " |" for r in rows],
    ]
    return "\n".join(lines)


def write_between_markers(path: Path, text: str) -> None:
    body = path.read_text() if path.exists() else f"# Kernels\n\n{START}\n{END}\n"
    if START not in body:
        body += f"\n{START}\n{END}\n"
    before, rest = body.split(START, 1)
    after = rest.split(END, 1)[1]
    path.write_text(f"{before}{START}\n{text}\n{END}{after}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/KERNELS.md"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (interpreted without a GPU)")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("kernels.benchmark needs a CUDA GPU (or --smoke for the CPU interpreter)")
        return 2
    if not torch.cuda.is_available():  # --smoke here: the kernels need Triton's interpreter
        device, shapes, dtype = torch.device("cpu"), SMOKE, torch.float32
        machine = (
            f"{platform.processor() or platform.machine()} CPU, Triton interpreter (timings meaningless)"
        )
    else:  # --smoke on a GPU host runs the tiny shapes compiled
        device, shapes, dtype = torch.device("cuda"), SMOKE if args.smoke else GPU, torch.bfloat16
        props = torch.cuda.get_device_properties(device)
        machine = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
        machine += f", torch {torch.__version__}, triton {triton.__version__}"
    torch.manual_seed(0)
    notes, rows = run(shapes, device, dtype)
    command = "python -m kernels.benchmark" + (" --smoke" if args.smoke else "")
    text = markdown(notes, rows, machine, command)
    write_between_markers(args.out, text)
    print(text)
    return 0 if all(math.isfinite(float(r[2])) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
