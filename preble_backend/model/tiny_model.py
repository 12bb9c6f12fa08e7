"""The embedded default model: a seeded, random-init Llama checkpoint with its own tokenizer.

Nothing is downloaded. The tokenizer is a byte-level BPE trained here on text generated
from a fixed seed; the weights come from a seeded generator. The same version always
yields the same directory, byte for byte in what matters (ids and weights). Outputs are
gibberish, but prefill cost grows with tokens and caching behaves as with a real model.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

VERSION = "v2"
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
# A chat template in the tokenizer, as real instruct models ship one: chat requests
# (the OpenAI front) work on the embedded model too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "float32",
}

_WORDS = """the a an of to in for on with by from at as is are was were be been has have had
do does did will would can could should may might must not no yes and or but if then else
when while where which who what why how all any each every some many few more most less
request prompt token tokens cache cached prefix shared tool tools agent agents video question
answer document system user assistant model server engine scheduler router load balance
gpu memory page pages kernel attention query key value batch chunk decode prefill latency
throughput queue priority group round fair starve evict recompute tree node radix match
miss hit explore exploit cost time window history instance instances replica scale hot
programming code function class return import print list dict string number float int
def self data file read write open close path error raise value type name test check
red green blue yellow black white small large long short fast slow early late new old
first second third last next previous left right up down inside outside before after
river mountain forest city road bridge house garden kitchen table chair window door
robot camera frame scene object person car truck bicycle street traffic light sign
""".split()


def corpus(seed: int = 1234, num_lines: int = 6000) -> list[str]:
    """Deterministic training text: sentences, code-ish lines, numbers and JSON."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        kind = i % 4
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 18))]
        if kind == 0:
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ";"]))
        elif kind == 1:
            name, arg = rng.choice(_WORDS), rng.choice(_WORDS)
            lines.append(f"def {name}_{arg}(self, {arg}={rng.randint(0, 999)}):\n    return {arg} + 1")
        elif kind == 2:
            lines.append(json.dumps({w: rng.randint(0, 10 ** rng.randint(1, 6)) for w in words[:4]}))
        else:
            lines.append(
                f"{rng.randint(1, 31)}/{rng.randint(1, 12)}/{rng.randint(1990, 2030)} " + " ".join(words)
            )
    return lines


def train_tokenizer(out_dir: Path, vocab_size: int = 2048) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "model_max_length": TINY_CONFIG["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return tok.get_vocab_size()


def random_weights(config: dict, seed: int = 0, std: float = 0.1) -> dict[str, torch.Tensor]:
    import torch  # here, not at the top: ``preble --help`` reaches this module

    """Seeded normal init in Hugging Face key names; norms start at one. The std is larger
    than training inits use so that outputs vary and depend on the whole context."""
    gen = torch.Generator().manual_seed(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def normal(*shape):
        return torch.randn(*shape, generator=gen) * std

    w = {"model.embed_tokens.weight": normal(config["vocab_size"], h), "model.norm.weight": torch.ones(h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w |= {
            p + "self_attn.q_proj.weight": normal(q_out, h),
            p + "self_attn.k_proj.weight": normal(kv_out, h),
            p + "self_attn.v_proj.weight": normal(kv_out, h),
            p + "self_attn.o_proj.weight": normal(h, q_out),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    if not config.get("tie_word_embeddings"):
        w["lm_head.weight"] = normal(config["vocab_size"], h)
    return w


def cache_root() -> Path:
    return Path(os.environ.get("PREBLE_CACHE", Path.home() / ".cache" / "preble"))


def tiny_model_path() -> Path:
    """The tiny model's directory, written on first use (safe across processes)."""
    target = cache_root() / f"tiny-llama-{VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        config = dict(TINY_CONFIG, vocab_size=train_tokenizer(tmp))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        from safetensors.torch import save_file

        save_file(random_weights(config), str(tmp / "model.safetensors"))
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its directory is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
