"""What one tensor-parallel rank holds and how much memory loading it takes: a checkpoint of
Llama-3-70B's layer shape (hidden 8192, 64 query / 8 KV heads, MLP 28672; random
weights, few layers, a smaller vocabulary so that it fits a small host) is loaded as
rank 0 of TP 1, 2 and 4, each in a fresh process, which reads every parameter once (the
checkpoint is memory-mapped: a weight is resident once read, as a first forward pass
reads it) and reports the bytes of its parameters, its peak resident memory (``VmHWM``) over its
baseline, and after loading its anonymous memory (the weights it copied) and the
checkpoint pages it has mapped (clean file pages, which the kernel reclaims at will).

    python -m preble_backend.benchmarks.tp_load --layers 2 --vocab 32000 --sizes 1,2,4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import json, sys, torch
from preble_backend.model.llama import LlamaForCausalLM
from preble_backend.model.tensor_parallel import TPGroup
torch.set_num_threads(1)
def status_kib(field):  # /proc's VmHWM is this process's own (ru_maxrss survives exec)
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0])
def peak_kib():
    return status_kib("VmHWM")
anon_before = status_kib("RssAnon")
before = peak_kib()
size = int(sys.argv[2])
tp = TPGroup(0, size) if size > 1 else None
model = LlamaForCausalLM.from_pretrained(sys.argv[1], torch.bfloat16, "cpu", tp)
with torch.no_grad():  # a read per 4 KiB page
    touched = sum(float(p.reshape(-1)[::2048].float().sum()) for p in model.parameters())
after = peak_kib()
layers = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers."))
total = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"size": size, "layer_bytes": layers, "param_bytes": total, "peak_kib": after - before,
                  "anon_kib": status_kib("RssAnon") - anon_before, "file_kib": status_kib("RssFile")}))
"""


def write_checkpoint(path: Path, layers: int, vocab: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
                      rope_theta=500000.0, torch_dtype="bfloat16")  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    h, inter, kv = 8192, 28672, 8 * 128
    shapes = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h),
              "model.norm.weight": (h,)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (Llama-3-70B has 80)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (Llama-3's is 128256)")
    parser.add_argument("--sizes", default="1,2,4", help="tensor-parallel sizes to load as rank 0 of")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="preble-tp-load-") as tmp:
        write_checkpoint(Path(tmp), args.layers, args.vocab)
        rows = [json.loads(subprocess.run([sys.executable, "-c", PROBE, tmp, size], check=True,
                                          capture_output=True, text=True).stdout.strip().splitlines()[-1])
                for size in args.sizes.split(",")]  # fmt: skip
    one = rows[0]
    print(
        "| TP size | layer weights on rank 0 (MB) | all parameters (MB) | peak RSS growth (MB) "
        "| peak ÷ TP 1 | anonymous memory after (MB) | checkpoint pages mapped (MB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['layer_bytes'] / 1e6:.0f} | {r['param_bytes'] / 1e6:.0f} | "
              f"{r['peak_kib'] / 1024:.0f} | {r['peak_kib'] / one['peak_kib']:.2f} | "
              f"{r['anon_kib'] / 1024:.0f} | {r['file_kib'] / 1024:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
