"""What the engine needs to know about a checkpoint of a supported family (Llama, Mistral,
Qwen2, Qwen3, and the mixture-of-experts Qwen3-MoE and Mixtral), read from its config.json.

Hugging Face has written RoPE settings two ways (``rope_theta`` + ``rope_scaling`` before
transformers 5, one ``rope_parameters`` dict after); both are accepted here so checkpoints
from either era load.

Loading is strict: every config.json field is either honoured (``HONOURED``, per family),
known to leave the forward pass unchanged (``NO_EFFECT``, plus Hugging Face's generic
config and generation keys), or off (a false, zero or empty value). Anything else would
make our arithmetic differ from the checkpoint's, so it is refused by name.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where RoPE is computed: the model card reads configs
    import torch  # in processes that never load it (the front)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3",
}
# Wrappers whose text model is a supported one: named in the refusal (their vision tower and
# projector are not served here).
TEXT_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_COMMON = {
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "hidden_act", "tie_word_embeddings", "rope_theta", "rope_scaling",
    "rope_parameters", "eos_token_id", "bos_token_id",
}  # fmt: skip
_QWEN_WINDOW = {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}
_MOE = {"num_experts_per_tok", "num_experts", "num_local_experts"}
HONOURED = {
    "llama": _COMMON | {"attention_bias", "mlp_bias"},
    "mistral": _COMMON | {"sliding_window"},
    "qwen2": _COMMON | _QWEN_WINDOW,
    "qwen3": _COMMON | _QWEN_WINDOW | {"attention_bias"},
    "qwen3_moe": _COMMON
    | _QWEN_WINDOW
    | _MOE
    | {"attention_bias", "decoder_sparse_step", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers"},
    "mixtral": _COMMON | _MOE | {"sliding_window"},
    # Gemma 3: its own activation key, the query scale, local and global RoPE bases, windows
    # on five layers of six; attention soft-capping and bidirectional attention only off
    "gemma3": _COMMON
    | {
        "hidden_activation",
        "query_pre_attn_scalar",
        "sliding_window",
        "layer_types",
        "sliding_window_pattern",
        "rope_local_base_freq",
        "final_logit_softcapping",
        "attention_bias",
    },
}
# Fields that do not change inference: training-only settings, metadata (and any key
# starting with "_", such as the GGUF loader's ``_model_name_or_path``), token ids the
# forward pass never reads. (``pretraining_tp`` only split matmuls in old transformers.)
NO_EFFECT = {
    "attention_dropout", "initializer_range", "use_cache", "pad_token_id", "pretraining_tp",
    "torch_dtype", "dtype", "model_type", "transformers_version", "_name_or_path",
    "tokenizer_class", "sep_token_id", "unk_token_id", "decoder_start_token_id",
    # mixture-of-experts training: the auxiliary loss, and noise on the router's input that
    # transformers applies only in training mode
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
}  # fmt: skip


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: ``router`` ``softmax_topk`` (softmax over every expert in
    fp32, then the top ``top_k``; Qwen3-MoE, Mixtral), renormalised over the chosen where
    ``renormalize``; the weights cast back to the model's dtype where ``cast_weights``
    (Qwen3-MoE) or kept in fp32 (Mixtral), as transformers does for each."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    cast_weights: bool
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the mixture; the rest are dense
    router: str = "softmax_topk"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None for full attention
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k, before RoPE
    moe: MoESpec | None = None
    # Gemma 3: norms scale by (1 + w) in fp32, four per layer (each sublayer's output normed
    # too), embeddings times sqrt(hidden), scores scaled by query_pre_attn_scalar**-0.5, a
    # RoPE per layer kind, and the final logits optionally soft-capped
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    layer_ropes: tuple[dict, ...] = ()  # per layer where they differ; else ``rope`` for all
    final_softcap: float | None = None

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        """How many keys a query of ``layer`` sees, itself included (transformers: a key
        at ``kv > q - window``); None: every earlier one."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def sliding_window(self) -> int | None:
        """The widest window of the sliding layers: what each request's sliding KV must
        keep (``engine/cache/sliding_windows.py``); None where no layer slides."""
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None

    def kv_group(self, layer: int) -> tuple[bool, int]:
        """Where ``layer``'s KV lives: in the sliding layers' pool (True) or the full
        layers' (False), and its index among that pool's layers."""
        sliding = self.window(layer) is not None
        return sliding, sum((self.window(i) is not None) == sliding for i in range(layer))

    @classmethod
    def from_dir(cls, model_path: str | Path) -> ModelConfig:
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model_path {model_path!s} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict, strict: bool = True) -> ModelConfig:
        """``strict``: refuse every key not honoured (loading a model); the model card reads
        a config without it, so that the front never imports transformers."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch in TEXT_MODEL_OF:
            text = TEXT_MODEL_OF[arch]
            raise ValueError(f"architecture {arch!r} is multimodal: serve its text model, {text} "
                             "(a checkpoint of the language model alone)")  # fmt: skip
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if strict:
            _refuse_unknown_fields(cfg, family)
        num_heads = cfg["num_attention_heads"]
        max_pos = cfg.get("max_position_embeddings", 2048)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope = _rope_parameters(cfg)
        qwen3, gemma = family in ("qwen3", "qwen3_moe"), family == "gemma3"
        attention_bias = family in ("llama", "qwen3", "qwen3_moe", "gemma3") and bool(
            cfg.get("attention_bias")
        )
        return cls(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            hidden_act=cfg.get("hidden_activation", "gelu_pytorch_tanh")
            if gemma
            else cfg.get("hidden_act", "silu"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),  # transformers' default per family
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=family == "llama" and bool(cfg.get("mlp_bias")),
            rope=rope,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            layer_windows=_layer_windows(cfg, family),
            qk_norm=qwen3 or gemma,
            moe=_moe_spec(cfg, family),
            norm_plus_one=gemma,
            sandwich_norms=gemma,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
            attn_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5 if gemma else None,
            layer_ropes=_gemma3_ropes(cfg) if gemma else (),
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        )

    def inv_freq(self, rope: dict | None = None) -> torch.Tensor:
        """RoPE inverse frequencies (of ``rope``, else the model's), computed exactly as
        Hugging Face does."""
        import torch

        rope = rope or self.rope
        base = rope["rope_theta"]
        dim = self.head_dim
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        kind = rope["rope_type"]
        if kind == "linear":
            inv = inv / rope["factor"]
        elif kind == "llama3":
            inv = _llama3_inv_freq(inv, rope)
        return inv

    def rope_of(self, layer: int) -> dict:
        return self.layer_ropes[layer] if self.layer_ropes else self.rope


@functools.cache
def _generic_fields() -> frozenset[str]:
    """Hugging Face's keys for every config and for generation: none reaches the forward
    pass. Built once; transformers is imported here because the engine otherwise needs it
    only for stop strings, and importing it costs seconds at start-up."""
    from transformers import GenerationConfig, PretrainedConfig

    return frozenset(PretrainedConfig().to_dict()) | frozenset(GenerationConfig().to_dict())


def _refuse_unknown_fields(cfg: dict, family: str) -> None:
    known = HONOURED[family] | NO_EFFECT | _generic_fields()
    unknown = sorted(
        k for k, v in cfg.items()
        if k not in known and not k.startswith("_") and v not in (None, False, 0, "", [], {})
    )  # fmt: skip
    if unknown:
        raise ValueError(
            f"config.json field(s) {', '.join(unknown)} are not implemented for {family} models: "
            "they would change the model's arithmetic (docs/ENGINE.md lists what is honoured)"
        )


def _gemma3_layer_types(cfg: dict) -> list[str]:
    """Gemma 3's layers: five sliding to one full by default (``sliding_window_pattern``)."""
    pattern = cfg.get("sliding_window_pattern", 6)
    return cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]


def _gemma3_ropes(cfg: dict) -> tuple[dict, ...]:
    """Gemma 3's RoPE per layer, as transformers 5 converts either era's config: the full
    layers take ``rope_theta`` (1e6 by default) and ``rope_scaling``, the sliding ones
    ``rope_local_base_freq`` (1e4); ``rope_parameters`` by layer kind where a config has it."""
    params = {kind: dict(v) for kind, v in (cfg.get("rope_parameters") or {}).items() if isinstance(v, dict)}
    full = {"rope_type": "default", **params.get("full_attention", {}), **(cfg.get("rope_scaling") or {})}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local = {"rope_type": "default", **params.get("sliding_attention", {})}
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    ropes = {}
    for kind, rope in (("full_attention", full), ("sliding_attention", local)):
        rope["rope_type"] = rope.get("rope_type") or rope.pop("type", "default")
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"{kind} rope_type {rope['rope_type']!r} is not supported; expected one of "
                             f"{SUPPORTED_ROPE_TYPES}")  # fmt: skip
        ropes[kind] = rope
    return tuple(ropes[t] for t in _gemma3_layer_types(cfg))


def _layer_windows(cfg: dict, family: str) -> tuple[int | None, ...]:
    """Each layer's sliding window, as each family's configuration class in transformers
    derives it: Mistral and Mixtral slide every layer (Mistral's window defaults to 4,096
    where the key is absent); Qwen slides only where ``use_sliding_window``, Qwen2 and Qwen3
    the layers ``layer_types`` names (by default those from ``max_window_layers`` on),
    Qwen3-MoE every layer."""
    layers = cfg["num_hidden_layers"]
    if family == "gemma3":
        window = cfg.get("sliding_window", 4096)
        return tuple(window if t == "sliding_attention" else None for t in _gemma3_layer_types(cfg))
    if family in ("mistral", "mixtral"):
        window = cfg.get("sliding_window", 4096 if family == "mistral" else None)
        return (window,) * layers
    if family not in ("qwen2", "qwen3", "qwen3_moe"):
        return (None,) * layers
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
    if family == "qwen3_moe":
        return (window,) * layers
    first = cfg.get("max_window_layers", 28)
    types = cfg.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)
    ]
    if set(types) - {"full_attention", "sliding_attention"} or len(types) != layers:
        raise ValueError(
            f"layer_types {types} are not supported: one of full_attention, sliding_attention per layer"
        )
    return tuple(window if t == "sliding_attention" else None for t in types)


def _moe_spec(cfg: dict, family: str) -> MoESpec | None:
    """The mixture, as each family's modeling code in transformers builds it."""
    if family not in ("qwen3_moe", "mixtral"):
        return None
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    layers = range(cfg["num_hidden_layers"])
    if family == "mixtral":
        return MoESpec(experts, cfg.get("num_experts_per_tok", 2), cfg["intermediate_size"], renormalize=True,
                       cast_weights=False, sparse_layers=tuple(layers))  # fmt: skip
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in layers if i not in dense and experts and (i + 1) % step == 0)
    renormalize = bool(cfg.get("norm_topk_prob"))
    return MoESpec(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], renormalize=renormalize,
                   cast_weights=True, sparse_layers=sparse)  # fmt: skip


def _rope_parameters(cfg: dict) -> dict:
    """RoPE settings as transformers 5 reads them: ``rope_scaling``, where a config has it,
    replaces ``rope_parameters`` (model cards tell users to add it for longer contexts, to
    a config that already has ``rope_parameters``); ``rope_theta`` is then the dict's own,
    else the config's top-level one, else 10,000."""
    source = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = dict(cfg.get(source) or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source} rope_type {kind!r} is not supported; expected one of "
                         f"{SUPPORTED_ROPE_TYPES}")  # fmt: skip
    params["rope_type"] = kind
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent rescaling: long wavelengths stretched, short kept."""
    import torch

    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
