"""Writes a Triton model repository: the router ``preble`` and one ``preble_engine_<i>``
per GPU (or per CPU engine). ``model.py`` files are one import; the logic lives here.

The checked-in ``model_repository/`` is ``write_repository(path, cpu_engines=2)``.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from preble_backend.common.settings import DEFAULT_PAGE_SIZE
from preble_backend.engine.config import EngineConfig
from preble_backend.serving.config import RouterConfig
from preble_backend.serving.protocol import (
    ENGINE_INPUTS,
    ENGINE_OUTPUTS,
    ROUTER_INPUTS,
    ROUTER_OUTPUTS,
    TensorSpec,
)
from scheduler.policies import POLICIES

ENGINE_MODEL_PY = "from preble_backend.serving.engine_model import TritonPythonModel  # noqa: F401\n"
ROUTER_MODEL_PY = "from preble_backend.serving.router_model import TritonPythonModel  # noqa: F401\n"

ENGINE_PARAMETER_NOTES = {
    "model_path": "local HF model dir; 'tiny' = the embedded model; relative = from the repository root",
    "dtype": "auto (fp32 on CPU, bf16 on GPU) | float32 | float16 | bfloat16",
    "page_size": "tokens per KV page, a power of two",
    "max_num_tokens": "KV capacity in tokens; 0 = kv_memory_fraction of free GPU memory (32768 on CPU)",
    "kv_memory_fraction": "GPU only, used when max_num_tokens is 0",
    "chunk_size": "prefill token budget per iteration (chunked prefill)",
    "max_running_requests": "cap on requests in the running batch",
    "priority_groups": "P of the priority wait queue",
    "priority_quota": "k: group g admits (g + 1) * k requests per round",
    "enable_prefix_caching": "radix prefix cache on/off",
    "attention_backend": "auto (torch on CPU, triton on GPU) | torch | triton | flashinfer",
}
ROUTER_PARAMETER_NOTES = {
    "model_path": "tokenizer directory (the engines' model); 'tiny' = the embedded model",
    "engines": "comma-separated engine model names in this server and grpc://host:port/model remotes",
    "policy": " | ".join(POLICIES),
    "cost_model": "E2's PREFILLTIME/DECODETIME fit: shipped name (tiny_cpu, mistral7b_a6000) or JSON path",
    "page_size": "the engines' KV page size: prompts are matched per page (must equal theirs)",
    "max_inflight": "requests forwarded to engines at once",
    "max_queue": "admitted requests waiting for a forwarding slot; beyond, requests get UNAVAILABLE",
    "max_input_bytes": "a larger text_input is refused before tokenization",
    "health_interval_s": "how often each engine is probed and its stub process checked",
    "health_timeout_s": "an engine that leaves a health probe unanswered this long is down",
}


def _io(inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> str:
    """The model's ``input`` and ``output`` blocks, rendered from the protocol's specs."""

    def block(kind: str, specs: tuple[TensorSpec, ...]) -> str:
        rows = []
        for spec in specs:
            dims = ", ".join(str(d) for d in spec.dims)
            optional = " optional: true" if spec.optional else ""
            rows.append(f'  {{ name: "{spec.name}" data_type: {spec.data_type} dims: [ {dims} ]{optional} }}')
        return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"

    return block("input", inputs) + block("output", outputs)


def _parameters(values: dict[str, object], notes: dict[str, str]) -> str:
    lines = []
    for key, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        lines.append(f"# {key}: {notes[key]}")
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{text}" }} }}')
    return "\n".join(lines) + "\n"


def engine_config_pbtxt(name: str, model_path: str, gpu: int | None, **overrides) -> str:
    values = asdict(EngineConfig(model_path=model_path, **overrides))
    values.pop("device")  # the instance group decides: KIND_GPU with gpus: [i] or KIND_CPU
    group = (
        f"{{ count: 1 kind: KIND_GPU gpus: [ {gpu} ] }}" if gpu is not None else "{ count: 1 kind: KIND_CPU }"
    )
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        "model_transaction_policy { decoupled: true }\n"
        f"{_io(ENGINE_INPUTS, ENGINE_OUTPUTS)}instance_group [ {group} ]\n"
        + _parameters(values, ENGINE_PARAMETER_NOTES)
    )


def router_config_pbtxt(
    model_path: str,
    engines: list[str],
    policy: str = "e2",
    cost_model: str = "tiny_cpu",
    page_size: int = DEFAULT_PAGE_SIZE,
    **overrides,
) -> str:
    config = RouterConfig(model_path, ",".join(engines), policy, cost_model, page_size, **overrides)
    return (
        'name: "preble"\nbackend: "python"\nmax_batch_size: 0\n'
        "model_transaction_policy { decoupled: true }\n"
        f"{_io(ROUTER_INPUTS, ROUTER_OUTPUTS)}instance_group [ {{ count: 1 kind: KIND_CPU }} ]\n"
        + _parameters(asdict(config), ROUTER_PARAMETER_NOTES)
    )


def _write_model(root: Path, name: str, config: str, model_py: str) -> None:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "config.pbtxt").write_text(config)
    (root / name / "1" / "model.py").write_text(model_py)


def write_repository(
    path: str | Path,
    model_path: str = "tiny",
    gpus: list[int] | None = None,
    cpu_engines: int = 2,
    policy: str = "e2",
    cost_model: str = "tiny_cpu",
    remote_engines: list[str] | None = None,
    with_router: bool = True,
    router_overrides: dict | None = None,
    **engine_overrides,
) -> Path:
    """One engine per GPU in ``gpus`` (or ``cpu_engines`` CPU engines) and the router
    (``router_overrides``: other ``RouterConfig`` settings)."""
    root = Path(path)
    slots: list[int | None] = list(gpus) if gpus else [None] * cpu_engines
    names = [f"preble_engine_{i}" for i in range(len(slots))]
    for name, gpu in zip(names, slots):
        _write_model(
            root, name, engine_config_pbtxt(name, model_path, gpu, **engine_overrides), ENGINE_MODEL_PY
        )
    if with_router:
        engines = names + list(remote_engines or [])
        page_size = engine_overrides.get("page_size", EngineConfig.page_size)
        config = router_config_pbtxt(
            model_path, engines, policy, cost_model, page_size, **(router_overrides or {})
        )
        _write_model(root, "preble", config, ROUTER_MODEL_PY)
    return root


def check_local_engines(repository: Path, names: list[str], page_size: int) -> None:
    """Fail the router's load, naming the problem, when a local engine it forwards to is
    not a decoupled model of this repository or pages its KV differently (the router
    matches prompts per page: a different size would never match a prefix)."""
    for name in names:
        config = repository / name / "config.pbtxt"
        if not config.is_file():
            raise ValueError(f"engines: model {name!r} is not in the model repository {repository}")
        text = config.read_text()
        if not re.search(r"model_transaction_policy\s*\{\s*decoupled\s*:\s*true\s*\}", text):
            raise ValueError(f"engines: model {name!r} is not decoupled (model_transaction_policy)")
        found = re.search(r'key:\s*"page_size"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
        theirs = found.group(1) if found else str(EngineConfig.page_size)
        if theirs != str(page_size):
            raise ValueError(
                f"page_size={page_size} is invalid: engine {name!r} pages its KV cache by {theirs} tokens"
            )
