"""What model is served, in one line: its name, parameter count, dtype and context, read
from the directory without loading a weight (safetensors headers, ``config.json``), for
``preble serve``'s banner and the OpenAI front's ``/v1/models``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from preble_backend.common.version import __version__
from preble_backend.model.pypi_models import is_named
from preble_backend.model.safetensors_slices import read_header


@dataclass(frozen=True)
class ModelCard:
    name: str  # a preble model name (tiny, smollm2) or the directory's name
    path: str
    parameters: int
    dtype: str  # as the engines run it
    max_model_len: int

    @property
    def served_by(self) -> str:
        return f"preble {__version__}"

    def line(self) -> str:
        size = f"{self.parameters / 1e9:.1f}B" if self.parameters >= 1e9 else f"{self.parameters / 1e6:.1f}M"
        context = f"context {self.max_model_len} tokens"
        note = ""
        if self.name == "tiny":
            note = "; random weights, random text: for a trained model, preble repo DIR --model-path smollm2"
        where = f"({self.path}); {self.served_by}"
        return f"{self.name}: {size} parameters, {self.dtype}, {context} {where}{note}"


def model_card(model_path: str, resolved: str | Path, dtype: str = "auto", device: str = "cpu") -> ModelCard:
    """``model_path`` as the repository names it; ``resolved``: its directory."""
    directory = Path(resolved)
    config = json.loads((directory / "config.json").read_text())
    if dtype == "auto":  # as the engine resolves it
        dtype = "float32" if device == "cpu" else "bfloat16"
    name = (model_path or "tiny") if is_named(model_path) else directory.name
    return ModelCard(name, str(directory), count_parameters(directory), dtype,
                     int(config.get("max_position_embeddings", 0)))  # fmt: skip


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


def count_parameters(directory: Path) -> int:
    """Elements of every tensor in the checkpoint's safetensors files, from their headers."""
    total = 0
    for name in weight_files(directory):
        _, header = read_header(directory / name)
        for key, entry in header.items():
            if key != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total
