"""Writes a Triton model repository: the router ``preble`` and one ``preble_engine_<i>``
per GPU (or per CPU engine). ``model.py`` files are one import; the logic lives here.

The checked-in ``model_repository/`` is ``write_repository(path, cpu_engines=2)``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from preble_backend.common.settings import DEFAULT_PAGE_SIZE, check_roles, setting_doc
from preble_backend.engine.config import EngineConfig
from preble_backend.model.pypi_models import is_named, model_directory
from preble_backend.router.config import RouterConfig
from preble_backend.serving.protocol import (
    ENGINE_INPUTS,
    ENGINE_OUTPUTS,
    ROUTER_INPUTS,
    ROUTER_OUTPUTS,
    TensorSpec,
)

ENGINE_MODEL_PY = "from preble_backend.engine_server.engine_model import TritonPythonModel  # noqa: F401\n"
ROUTER_MODEL_PY = "from preble_backend.router.router_model import TritonPythonModel  # noqa: F401\n"


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


def _parameters(config, skip: tuple[str, ...] = ()) -> str:
    """Every setting of ``config`` as a parameter, each under its one-line documentation."""
    lines = []
    for key, value in asdict(config).items():
        if key in skip:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        lines.append(f"# {key}: {setting_doc(type(config), key)}")
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{text}" }} }}')
    return "\n".join(lines) + "\n"


def engine_config_pbtxt(name: str, model_path: str, gpu: int | None, **overrides) -> str:
    """One engine on ``gpu`` (None: the CPU). A tensor-parallel GPU engine spans GPUs
    ``gpu`` .. ``gpu + tensor_parallel_size - 1``: Triton's ``KIND_GPU`` would start an
    instance per GPU listed, so it is one ``KIND_MODEL`` instance that places its ranks
    itself, from its ``device`` parameter (as Triton's vLLM backend does)."""
    config = EngineConfig(model_path=model_path, **overrides)
    spans = gpu is not None and config.tensor_parallel_size > 1
    if spans:
        group, skip = "{ count: 1 kind: KIND_MODEL }", ()
        config = EngineConfig(model_path=model_path, **{**overrides, "device": f"cuda:{gpu}"})
    elif gpu is not None:
        group, skip = f"{{ count: 1 kind: KIND_GPU gpus: [ {gpu} ] }}", ("device",)
    else:  # the instance group decides the device: KIND_GPU or KIND_CPU
        group, skip = "{ count: 1 kind: KIND_CPU }", ("device",)
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        "model_transaction_policy { decoupled: true }\n"
        f"{_io(ENGINE_INPUTS, ENGINE_OUTPUTS)}instance_group [ {group} ]\n" + _parameters(config, skip=skip)
    )


def router_config_pbtxt(config: RouterConfig, instances: int = 1) -> str:
    """``instances``: router processes in this server (Triton spreads requests over them);
    each keeps its own exact tree from the engines' event logs."""
    return (
        'name: "preble"\nbackend: "python"\nmax_batch_size: 0\n'
        "model_transaction_policy { decoupled: true }\n"
        f"{_io(ROUTER_INPUTS, ROUTER_OUTPUTS)}instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
        + _parameters(config)
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
    remote_engines: list[str] | None = None,
    with_router: bool = True,
    router_overrides: dict | None = None,
    router_instances: int = 1,
    host_cores: int | None = None,
    roles: list[str] | None = None,
    **engine_overrides,
) -> Path:
    """One engine per GPU in ``gpus``, or per ``tensor_parallel_size`` consecutive GPUs
    (or ``cpu_engines`` CPU engines; ``engine_overrides``:
    ``EngineConfig`` settings) and the router over them and ``remote_engines``
    (``router_overrides``: ``RouterConfig`` settings; its page size is the engines';
    ``router_instances`` router processes).
    ``host_cores``: CPU engines that compute get disjoint cores of a host with that many
    (``cpu_cores``), as each GPU engine gets its own GPU. ``roles``: each engine's role in
    prefill/decode disaggregation (``prefill``, ``decode`` or ``both``; all ``both`` when
    not given)."""
    root = Path(path)
    if not is_named(model_path):  # a name is fetched when first loaded
        model_directory(model_path, base=root)  # what the server would refuse, refused now
    tp = engine_overrides.get("tensor_parallel_size", 1)
    if gpus and (len(gpus) % tp or any(b != a + 1 for a, b in zip(gpus, gpus[1:]))):
        raise ValueError(f"gpus={gpus} is invalid for tensor_parallel_size={tp}: expected consecutive GPU "
                         f"ids, a multiple of {tp} of them (each engine spans {tp})")  # fmt: skip
    slots: list[int | None] = list(gpus[::tp]) if gpus else [None] * cpu_engines  # each engine's first GPU
    names = [f"preble_engine_{i}" for i in range(len(slots))]
    if roles is not None:
        if len(roles) != len(names):
            raise ValueError(f"{len(roles)} engine roles for {len(names)} engines: give each engine one")
        check_roles(roles if not remote_engines else [*roles, "both"])  # remotes report their own
    computes = engine_overrides.get("compute", "model") == "model"  # an emulated engine only waits
    cores = _split_cores(host_cores, cpu_engines) if host_cores and computes and not gpus else None
    for i, (name, gpu) in enumerate(zip(names, slots)):
        overrides = {**engine_overrides, **({"cpu_cores": cores[i]} if cores else {})}
        if roles is not None and roles[i] != "both":
            overrides["role"] = roles[i]
        _write_model(root, name, engine_config_pbtxt(name, model_path, gpu, **overrides), ENGINE_MODEL_PY)
    if with_router:
        config = RouterConfig(**{
            "model_path": model_path,
            "engines": ",".join(names + list(remote_engines or [])),
            "page_size": engine_overrides.get("page_size", DEFAULT_PAGE_SIZE),
            **(router_overrides or {}),
        })  # fmt: skip
        _write_model(root, "preble", router_config_pbtxt(config, router_instances), ROUTER_MODEL_PY)
    return root


def _split_cores(host_cores: int, engines: int) -> list[str]:
    """Disjoint core ranges, as even as the count allows; refused when engines would share."""
    if engines > host_cores:
        raise ValueError(
            f"cpu_engines={engines} is invalid on {host_cores} cores: CPU engines would share cores "
            "and stop being separate instances (use fewer engines, or --compute emulated)"
        )
    per = host_cores // engines
    return [f"{i * per}-{(i + 1) * per - 1}" if per > 1 else str(i) for i in range(engines)]
