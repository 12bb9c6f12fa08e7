"""The Triton kernels against their float64 torch references (under TRITON_INTERPRET=1 on
CPU): ragged batches, random page tables, prefix 0, chunk 1, GQA 1/4/8, head dims 64 and
128, several page sizes, every output buffer poisoned with NaN before the run."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cascade_attention, decode_attention, extend_attention, kv_write, merge_state, merge_states
from kernels import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every float buffer the kernels allocate starts as NaN, so an element a kernel
    forgets to write fails the comparison instead of passing as a lucky zero."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def rel_err(out: torch.Tensor, expect: torch.Tensor) -> float:
    return ((out.double().cpu() - expect).abs().max() / expect.abs().max()).item()


def paged_batch(q_lens, prefix_lens, num_heads, num_kv_heads, head_dim, page_size, seed=0):
    """float64 q and K/V cache, each request's context scattered over random pages."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    pages_per = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per) + 3  # spare pages that no request owns
    perm = torch.randperm(num_pages, generator=gen)
    width = max(pages_per)
    table = torch.zeros((len(q_lens), width), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[used : used + n].int()
        used += n
    slots = num_pages * page_size
    k = torch.randn((slots, num_kv_heads, head_dim), generator=gen, dtype=torch.float64)
    v = torch.randn((slots, num_kv_heads, head_dim), generator=gen, dtype=torch.float64)
    q = torch.randn((sum(q_lens), num_heads, head_dim), generator=gen, dtype=torch.float64)
    return q, k, v, table


def cast(dtype, *tensors):
    """Round to ``dtype`` on the kernel side and take the reference from the rounded values,
    so the comparison measures the kernel's arithmetic, not the input rounding."""
    low = [t.to(dtype).to(DEVICE) for t in tensors]
    return low, [t.double().cpu() for t in low]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_matches_reference(dtype, page_size, group, head_dim):
    q_lens, prefix_lens = [5, 1, 19, 1, 3], [0, 9, 23, 0, 40]  # prefix 0, chunk 1, decodes riding along
    q, k, v, table = paged_batch(
        q_lens, prefix_lens, 2 * group, 2, head_dim, page_size, seed=group + page_size
    )
    (ql, kl, vl, tl_), (q64, k64, v64, _) = cast(dtype, q, k, v, table)
    out, lse = extend_attention(ql, kl, vl, tl_.int(), q_lens, prefix_lens, page_size, return_lse=True)
    expect, expect_lse = ref.extend_attention_ref(q64, k64, v64, table, q_lens, prefix_lens, page_size)
    assert out.dtype == dtype
    assert rel_err(out, expect) < TOL[dtype]
    assert rel_err(lse, expect_lse) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_matches_reference(dtype, group, head_dim, num_splits):
    seq_lens = [1, 70, 33, 129]
    q, k, v, table = paged_batch([1] * 4, [s - 1 for s in seq_lens], 2 * group, 2, head_dim, 8, seed=group)
    (ql, kl, vl), (q64, k64, v64) = cast(dtype, q, k, v)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out, lse = decode_attention(ql, kl, vl, table.to(DEVICE), lens, 8, num_splits=num_splits, return_lse=True)
    expect, expect_lse = ref.decode_attention_ref(q64, k64, v64, table, seq_lens, 8)
    assert rel_err(out, expect) < TOL[dtype]
    assert rel_err(lse, expect_lse) < TOL[dtype]


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])  # below, at and above the interpreter's BLOCK_N (16)
@pytest.mark.parametrize("kind", ["extend", "decode"])
def test_block_gathers_with_ranges_that_start_anywhere(page_size, kind):
    """Each block's K/V is gathered by page (``block_slots``) from loops aligned down to
    BLOCK_N: ranges that start mid-block and mid-page (decode splits, a window's start)
    give the reference's answer, and the page-table entries of pages wholly before a
    range, which a window may have dropped, are never dereferenced (garbage there)."""
    q_lens = [3, 1, 17, 1] if kind == "extend" else [1] * 4
    prefix_lens, kv_starts = [40, 77, 130, 9], [5, 64, 33, 0]
    q, k, v, table = paged_batch(q_lens, prefix_lens, 8, 2, 64, page_size, seed=page_size)
    for b, start in enumerate(kv_starts):
        table[b, : start // page_size] = 1 << 28  # far outside the pool
    (ql, kl, vl), (q64, k64, v64) = cast(torch.float32, q, k, v)
    starts = torch.tensor(kv_starts, dtype=torch.int32, device=DEVICE)
    if kind == "extend":
        out = extend_attention(ql, kl, vl, table.to(DEVICE), q_lens, prefix_lens, page_size, kv_starts=starts)
    else:
        lens = torch.tensor([p + 1 for p in prefix_lens], dtype=torch.int32, device=DEVICE)
        out = decode_attention(ql, kl, vl, table.to(DEVICE), lens, page_size, kv_starts=starts, num_splits=3)
    expect, _ = ref.extend_attention_ref(q64, k64, v64, table, q_lens, prefix_lens, page_size, kv_starts)
    assert rel_err(out, expect) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
@pytest.mark.parametrize("kind", ["extend", "decode"])
def test_sliding_window_attention_matches_reference(dtype, page_size, window, kind):
    """A sliding-window layer's queries see the ``window`` keys up to themselves, chunks
    longer and shorter than the window alike; pages wholly before every query's window
    hold garbage in the table (a window may drop them) and are never read."""
    q_lens = [30, 1, 9, 1, 50] if kind == "extend" else [1] * 5
    prefix_lens = [0, 70, 41, 3, 100]
    q, k, v, table = paged_batch(q_lens, prefix_lens, 8, 2, 64, page_size, seed=window)
    for b, prefix in enumerate(prefix_lens):
        table[b, : max(0, prefix - window + 1) // page_size] = 1 << 28
    (ql, kl, vl), (q64, k64, v64) = cast(dtype, q, k, v)
    if kind == "extend":
        out = extend_attention(ql, kl, vl, table.to(DEVICE), q_lens, prefix_lens, page_size, window=window)
    else:
        lens = torch.tensor([p + 1 for p in prefix_lens], dtype=torch.int32, device=DEVICE)
        out = decode_attention(ql, kl, vl, table.to(DEVICE), lens, page_size, num_splits=2, window=window)
    expect, _ = ref.extend_attention_ref(q64, k64, v64, table, q_lens, prefix_lens, page_size, window=window)
    assert rel_err(out, expect) < TOL[dtype]


def test_a_shapes_own_tile_serves_its_chunks(monkeypatch):
    """``EXTEND_TILES`` gives a shape class its own tile (the sweep's per-shape choice);
    other classes keep the generation's row, and the kernel is exact with either."""
    from kernels import tuning

    device = torch.device(DEVICE)
    own = tuning.ExtendTile(extend_m=32, extend_n=8, warps=1, stages=1)
    monkeypatch.setitem(tuning.EXTEND_TILES, (tuning.generation(device), 64, "short"), own)
    assert tuning.chunk_tile(device, 64, 128, upcast=True) == own
    blocks = tuning.blocks_for(device, 64)
    assert tuning.chunk_tile(device, 64, 129, upcast=True).extend_n == blocks.extend_n  # "medium": no row
    assert tuning.chunk_class(1) == "short" and tuning.chunk_class(1024) == "medium"
    assert tuning.chunk_class(1025) == "long"
    q_lens, prefix_lens = [5, 1, 19], [0, 9, 23]
    q, k, v, table = paged_batch(q_lens, prefix_lens, 8, 2, 64, 4, seed=11)
    (ql, kl, vl), (q64, k64, v64) = cast(torch.float32, q, k, v)
    out = extend_attention(ql, kl, vl, table.to(DEVICE), q_lens, prefix_lens, 4)
    expect, _ = ref.extend_attention_ref(q64, k64, v64, table, q_lens, prefix_lens, 4)
    assert rel_err(out, expect) < TOL[torch.float32]


def test_the_sweep_chooses_a_tile_per_chunk_class_by_its_own_shapes():
    """Times on five shapes (two long, two medium, one short): each class takes the config
    fastest on its own shapes; a class that no config speeds up keeps the current tile."""
    from kernels.sweep import best_per_class
    from kernels.tuning import ExtendTile

    classes = ["long", "long", "medium", "short", "medium"]
    base = [1.0, 2.0, 1.0, 1.0, 4.0]
    a, b = ExtendTile(64, 64, 4, 3), ExtendTile(128, 32, 8, 2)
    results = [(a, [0.8, 1.6, 1.1, 1.2, 4.4]), (b, [0.9, 1.9, 0.5, 1.1, 3.0])]
    best = best_per_class(results, base, classes)
    assert best["long"] == (pytest.approx(0.8), a)
    assert best["medium"] == (pytest.approx(math.sqrt(0.5 * 0.75)), b)
    assert "short" not in best  # both slower than the current tile there


def test_decode_split_count_follows_batch_shape():
    from kernels.decode_attention import choose_num_splits
    from kernels.tuning import TABLE

    h200 = TABLE["sm90"]
    assert choose_num_splits(1, 8, 32768, h200) == 33  # 264 programs wanted, 8 per split
    assert choose_num_splits(128, 8, 32768, h200) == 1  # the batch alone fills the GPU
    assert choose_num_splits(1, 8, 300, h200) == 2  # no split shorter than 4 blocks of 64
    assert choose_num_splits(1, 1, 10**6, h200) == 64  # capped


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_state_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    v_a, v_b = (torch.randn((6, 4, 64), generator=gen, dtype=torch.float64) for _ in range(2))
    s_a, s_b = (torch.randn((6, 4), generator=gen, dtype=torch.float64) * 4 for _ in range(2))
    s_a[0, 0] = -math.inf  # an empty side contributes nothing
    s_a[1, 1] = s_b[1, 1] = -math.inf  # both empty: v = 0, s = -inf
    (va, vb), (va64, vb64) = cast(dtype, v_a, v_b)
    v, s = merge_state(va, s_a.float().to(DEVICE), vb, s_b.float().to(DEVICE))
    expect, expect_s = ref.merge_state_ref(va64, s_a.float().double(), vb64, s_b.float().double())
    assert rel_err(v, expect) < TOL[dtype]
    assert v[1, 1].abs().max() == 0 and s[1, 1] == -math.inf
    assert torch.allclose(v[0, 0].double().cpu(), vb64[0, 0], rtol=TOL[dtype], atol=TOL[dtype])
    finite = torch.isfinite(expect_s)
    assert torch.allclose(s.double().cpu()[finite], expect_s[finite], rtol=1e-6, atol=1e-6)


def test_merge_states_matches_reference():
    gen = torch.Generator().manual_seed(4)
    v = torch.randn((3, 4, 5, 128), generator=gen, dtype=torch.float64)
    s = torch.randn((3, 4, 5), generator=gen, dtype=torch.float64) * 3
    s[0, :, 1:] = -math.inf  # splits that saw no keys
    s[2, 3, :] = -math.inf
    out, lse = merge_states(v.float().to(DEVICE), s.float().to(DEVICE))
    expect, expect_lse = ref.merge_states_ref(v.float().double(), s.float().double())
    assert rel_err(out, expect) < 1e-5
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(expect_lse))
    assert out[2, 3].abs().max() == 0


def test_lse_is_natural_log():
    """Against a direct computation, not the reference: exp(lse) is the softmax denominator."""
    q, k, v, table = paged_batch([1], [6], 1, 1, 64, 4, seed=9)
    (ql, kl, vl), _ = cast(torch.float32, q, k, v)
    _, lse = extend_attention(ql, kl, vl, table.to(DEVICE), [1], [6], 4, return_lse=True)
    slots = ref.context_slots(table[0], 0, 7, 4)
    scores = (q[0, 0] @ k[slots, 0].T) / math.sqrt(64)
    assert lse[0, 0].item() == pytest.approx(math.log(scores.exp().sum().item()), rel=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunked", [False, True], ids=["decode", "extend"])
@pytest.mark.parametrize("group", [1, 4])
def test_cascade_equals_plain_attention(dtype, chunked, group):
    """Two groups sharing 48 and 32 tokens plus a loner; the cascade kernels, the torch
    cascade decomposition and plain attention all agree."""
    page_size = 8
    q_lens = [3, 1, 6, 2, 4] if chunked else [1] * 5
    prefix_lens = [50, 60, 48, 33, 20]
    groups = [([0, 1, 2], 48), ([3, 4], 16)]
    q, k, v, table = paged_batch(q_lens, prefix_lens, 2 * group, 2, 64, page_size, seed=5)
    table[1, :6] = table[0, :6]  # the radix cache hands group members the same pages
    table[2, :6] = table[0, :6]
    table[4, :2] = table[3, :2]
    (ql, kl, vl), (q64, k64, v64) = cast(dtype, q, k, v)
    out, lse = cascade_attention(
        ql, kl, vl, table.to(DEVICE), q_lens, prefix_lens, page_size, groups, return_lse=True
    )
    plain, plain_lse = ref.extend_attention_ref(q64, k64, v64, table, q_lens, prefix_lens, page_size)
    torch_cascade, _ = ref.cascade_attention_ref(q64, k64, v64, table, q_lens, prefix_lens, page_size, groups)
    assert rel_err(torch_cascade, plain) < 1e-12
    assert rel_err(out, plain) < TOL[dtype]
    assert rel_err(lse, plain_lse) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_write_scatters_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(6)
    k = torch.randn((5, 2, 64), generator=gen).to(dtype)
    v = torch.randn((5, 2, 64), generator=gen).to(dtype)
    slots = torch.tensor([7, 0, -1, 12, 3])
    k_cache = torch.full((16, 2, 64), 9.0, dtype=dtype)
    v_cache = torch.full((16, 2, 64), 9.0, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.kv_write_ref(k_ref, v_ref, k, v, slots)
    kc, vc = k_cache.to(DEVICE), v_cache.to(DEVICE)
    kv_write(kc, vc, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(kc.cpu(), k_ref) and torch.equal(vc.cpu(), v_ref)
    assert (k_ref[[1, 2, 4, 5]] == 9).all()  # untouched slots stay as they were


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes in bf16 need a CUDA GPU")
@pytest.mark.parametrize("kind", ["extend", "decode", "cascade"])
def test_real_sizes_bf16_on_gpu(kind):
    """Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), 4k contexts."""
    page_size = 16
    if kind == "extend":
        q_lens, prefix_lens, groups = [512, 1, 2048, 77], [3000, 4095, 0, 1200], []
    else:
        q_lens = [1] * 16 if kind == "decode" else [1] * 12 + [64] * 4
        prefix_lens = [4096 + 37 * i for i in range(16)]
        groups = [] if kind == "decode" else [(list(range(16)), 4096)]
    q, k, v, table = paged_batch(q_lens, prefix_lens, 32, 8, 128, page_size, seed=7)
    if groups:
        table[:, : 4096 // page_size] = table[0, : 4096 // page_size]
    (ql, kl, vl), (q64, k64, v64) = cast(torch.bfloat16, q, k, v)
    gpu_table = table.to(DEVICE)
    if kind == "decode":
        lens = torch.tensor([p + 1 for p in prefix_lens], device=DEVICE)
        out = decode_attention(ql, kl, vl, gpu_table, lens, page_size)
    elif kind == "extend":
        out = extend_attention(ql, kl, vl, gpu_table, q_lens, prefix_lens, page_size)
    else:
        out = cascade_attention(ql, kl, vl, gpu_table, q_lens, prefix_lens, page_size, groups)
    expect, _ = ref.extend_attention_ref(q64, k64, v64, table, q_lens, prefix_lens, page_size)
    assert rel_err(out.cpu(), expect) < TOL[torch.bfloat16]


def test_benchmark_script_runs_and_keeps_the_document(tmp_path):
    """The GPU benchmark's code paths on tiny shapes (timings meaningless); its table goes
    between the markers and the text around them survives."""
    from kernels.benchmark import END, START, main

    doc = tmp_path / "KERNELS.md"
    doc.write_text(f"# Kernels\n\nprose before\n\n{START}\nold table\n{END}\n\nprose after\n")
    assert main(["--smoke", "--out", str(doc)]) == 0
    text = doc.read_text()
    assert "prose before" in text and "prose after" in text and "old table" not in text
    for kernel in ("| decode |", "| extend |", "| cascade decode |", "| merge_state |", "| kv_write |"):
        assert kernel in text
