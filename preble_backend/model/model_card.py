"""What model is served, in one line: its name, parameter count (and, for a mixture of
experts, the parameters one token runs through), dtype, context, architecture and KV bytes
per token, read from the directory without loading a weight (safetensors headers,
``config.json``), for ``preble serve``'s banner, ``preble repo`` and the OpenAI front's
``/v1/models``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from preble_backend.common.version import __version__
from preble_backend.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from preble_backend.model.pypi_models import is_named
from preble_backend.model.safetensors_slices import read_header


@dataclass(frozen=True)
class ModelCard:
    name: str  # a preble model name (tiny, smollm2) or the directory's name
    path: str
    parameters: int
    dtype: str  # as the engines run it
    max_model_len: int
    architecture: str = "LlamaForCausalLM"
    active_parameters: int = 0  # per token: all but the experts it is not routed to
    kv_bytes_per_token: int = 0  # every layer's K and V, at ``dtype``, as the engine holds them
    sliding_layers: str = ""  # e.g. "5 of 6 layers slide over 512 tokens"
    signature: str = ""  # its shape (``shape_signature``): what a shipped cost-model fit names
    expert_parameters: int = 0  # of ``parameters``, the experts'
    num_experts: int = 0
    experts_per_token: int = 0

    def cost_facts(self, device: str, tensor_parallel: int = 1, cores: int = 0) -> dict:
        """What E2 needs to price this engine before it has timed a pass: the model's shape
        and size and the device class (``device_class``), for a shipped fit that matches
        or a first-principles estimate (``scheduler/cost_priors.py``)."""
        item = 4 if self.dtype == "float32" else 2
        return {"model": self.signature, "device": device, "tensor_parallel": tensor_parallel,
                "cores": cores, "dtype_bytes": item, "parameters": self.parameters,
                "active_parameters": self.active_parameters or self.parameters,
                "expert_parameters": self.expert_parameters, "num_experts": self.num_experts,
                "experts_per_token": self.experts_per_token,
                "kv_bytes_per_token": self.kv_bytes_per_token}  # fmt: skip

    @property
    def served_by(self) -> str:
        return f"preble {__version__}"

    def line(self) -> str:
        size = f"{_count(self.parameters)} parameters"
        if self.active_parameters and self.active_parameters < self.parameters:
            size += f" ({_count(self.active_parameters)} active per token)"
        context = f"context {self.max_model_len} tokens"
        shape = f"{self.architecture}, KV {self.kv_bytes_per_token / 1024:.1f} KiB per token"
        shape += f", {self.sliding_layers}" if self.sliding_layers else ""
        note = ""
        if self.name == "tiny":
            note = "; random weights, random text: for a trained model, preble repo DIR --model-path smollm2"
        where = f"({self.path}); {self.served_by}"
        return f"{self.name}: {size}, {self.dtype}, {context}, {shape} {where}{note}"


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def model_card(model_path: str, resolved: str | Path, dtype: str = "auto", device: str = "cpu") -> ModelCard:
    """``model_path`` as the repository names it; ``resolved``: its directory."""
    directory = Path(resolved)
    config = json.loads((directory / "config.json").read_text())
    if dtype == "auto":  # as the engine resolves it
        dtype = "float32" if device == "cpu" else "bfloat16"
    name = (model_path or "tiny") if is_named(model_path) else directory.name
    cfg = ModelConfig.from_dict(config, strict=False)
    total, experts = count_parameters(directory)
    active = total - (experts - experts * cfg.moe.top_k // cfg.moe.num_experts if cfg.moe else 0)
    item = 4 if dtype == "float32" else 2
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item
    windows = [w for w in cfg.layer_windows if w is not None]
    sliding = f"{len(windows)} of {cfg.num_layers} layers slide over {min(windows)} tokens" if windows else ""
    arch = (config.get("architectures") or ["LlamaForCausalLM"])[0]
    moe = (cfg.moe.num_experts, cfg.moe.top_k) if cfg.moe else (0, 0)
    return ModelCard(name, str(directory), total, dtype, cfg.max_context, arch, active, kv, sliding,
                     shape_signature(cfg), experts, *moe)  # fmt: skip


def shape_signature(cfg: ModelConfig) -> str:
    """A checkpoint's shape in one line, e.g. ``llama L32 H4096 A32/8x128 I14336 V32000``:
    two checkpoints that share it cost the same per pass, whatever their names."""
    family = SUPPORTED_ARCHITECTURES.get(cfg.architecture, cfg.architecture)
    sig = (f"{family} L{cfg.num_layers} H{cfg.hidden_size} A{cfg.num_heads}/{cfg.num_kv_heads}"
           f"x{cfg.head_dim} I{cfg.intermediate_size} V{cfg.vocab_size}")  # fmt: skip
    if cfg.moe:
        sig += f" E{cfg.moe.num_experts}k{cfg.moe.top_k}i{cfg.moe.intermediate_size}"
    return sig


def device_class(name: str) -> str:
    """``cpu``, or a GPU by its class as NVML or torch names it ("NVIDIA H100 80GB HBM3" is
    ``H100``): the device a shipped fit was measured or modelled on."""
    if name == "cpu" or name.startswith("cpu"):
        return "cpu"
    for token in re.split(r"[\s_-]+", name.upper()):
        if re.fullmatch(r"(?:[ABHL]\d{2,3}S?|B\d{3}|GB\d{3}|RTX\d{4}|A\d{4}|L4)", token):
            return token
    return name


def weight_files(path: Path) -> list[str]:
    """The safetensors files transformers reads: the index's shards, else
    ``model.safetensors``, else the directory's one ``*.safetensors`` file. Other files
    beside them (an adapter, a copy) are not weights of this model."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if len(files) > 1:
        raise ValueError(f"model_path {path} has {len(files)} .safetensors files ({', '.join(files)}) and no "
                         "model.safetensors.index.json saying which are the model's")  # fmt: skip
    if not files:
        raise FileNotFoundError(f"model_path {path} has no .safetensors weights")
    return files


def count_parameters(directory: Path) -> tuple[int, int]:
    """Elements of every tensor in the checkpoint's safetensors files, from their headers,
    and of those among them that belong to experts (a mixture's ``experts`` tensors)."""
    total = experts = 0
    for name in weight_files(directory):
        _, header = read_header(directory / name)
        for key, entry in header.items():
            if key != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
                experts += count if ".experts." in key else 0
    return total, experts
