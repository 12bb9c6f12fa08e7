"""What the engine needs to know about a checkpoint of a supported family (Llama, Mistral,
Qwen2, Qwen3, Gemma 3, and the mixture-of-experts Qwen3-MoE, Mixtral and gpt-oss), read from
its config.json.

RoPE settings are read by ``rope.py``.

Loading is strict: every config.json field is either honoured (``HONOURED``, per family),
known to leave the forward pass unchanged (``NO_EFFECT``, plus Hugging Face's generic
config and generation keys), or off (a false, zero or empty value). Anything else would
make our arithmetic differ from the checkpoint's, so it is refused by name.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from preble_backend.model.rope import gemma3_ropes, rope_inv_freq, rope_parameters

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
    "GptOssForCausalLM": "gpt_oss",
}
# Wrappers whose text model is a supported one: named in the refusal (their vision tower and
# projector are not served here).
TEXT_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
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
    # gpt-oss: attention sinks and biases, alternating windows, YaRN, its router and
    # clamped experts; ``experts_per_token`` and ``initial_context_length`` are the
    # original release's names for num_experts_per_tok and YaRN's original length, which
    # transformers does not read
    "gpt_oss": _COMMON
    | _MOE
    | {
        "sliding_window",
        "layer_types",
        "attention_bias",
        "swiglu_alpha",
        "swiglu_limit",
        "experts_per_token",
        "initial_context_length",
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
    # gpt-oss: ``topk_softmax`` (top k of a biased router's logits, softmax over those k),
    # experts with biases, and their clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``)
    router: str = "softmax_topk"
    bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    interleaved: bool = False  # the checkpoint's gate_up_proj is [E, H, 2I], gate and up interleaved


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
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax
    norm_weight_fp32: bool = False  # gpt-oss: norms multiply in fp32, then round

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
        rope = rope_parameters(cfg)
        qwen3, gemma = family in ("qwen3", "qwen3_moe"), family == "gemma3"
        attention_bias = family in ("llama", "qwen3", "qwen3_moe", "gemma3", "gpt_oss") and bool(
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
            layer_ropes=gemma3_ropes(cfg, _gemma3_layer_types(cfg)) if gemma else (),
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            attention_sinks=family == "gpt_oss",
            norm_weight_fp32=family == "gpt_oss",
        )

    def inv_freq(self, rope: dict | None = None) -> torch.Tensor:
        """RoPE inverse frequencies (of ``rope``, else the model's), computed exactly as
        Hugging Face does."""
        return rope_inv_freq(rope or self.rope, self.head_dim, self.max_position_embeddings)

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
    if family == "gpt_oss":
        window, types = cfg.get("sliding_window", 128), cfg.get("layer_types")
        types = types or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return tuple(window if t == "sliding_attention" else None for t in types)
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
    if family not in ("qwen3_moe", "mixtral", "gpt_oss"):
        return None
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    layers = range(cfg["num_hidden_layers"])
    if family == "gpt_oss":
        return MoESpec(experts, cfg.get("num_experts_per_tok", 4), cfg["intermediate_size"],
                       renormalize=False, cast_weights=True, sparse_layers=tuple(layers),
                       router="topk_softmax", bias=True, interleaved=True,
                       swiglu_limit=cfg.get("swiglu_limit", 7.0),
                       swiglu_alpha=cfg.get("swiglu_alpha", 1.702))  # fmt: skip
    if family == "mixtral":
        return MoESpec(experts, cfg.get("num_experts_per_tok", 2), cfg["intermediate_size"], renormalize=True,
                       cast_weights=False, sparse_layers=tuple(layers))  # fmt: skip
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in layers if i not in dense and experts and (i + 1) % step == 0)
    renormalize = bool(cfg.get("norm_topk_prob"))
    return MoESpec(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], renormalize=renormalize,
                   cast_weights=True, sparse_layers=sparse)  # fmt: skip
