"""Preble on Triton. A model repository's ``model.py`` files are one import each of a
Triton model's entry point; repositories written before the serving layer was split into
rooms (2026-11) import them from ``preble_backend.serving``, and those names still load
the models from where they live now (``MOVED``). ``preble repo`` writes the new names."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from preble_backend.common.version import __version__ as __version__

MOVED = {
    "preble_backend.serving.router_model": "preble_backend.router.router_model",
    "preble_backend.serving.engine_model": "preble_backend.engine_server.engine_model",
}


class _MovedEntryPoints(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Asked only after every other finder failed: an old entry point's name is the
    module at its new name."""

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass  # imported whole by create_module


if not any(isinstance(finder, _MovedEntryPoints) for finder in sys.meta_path):
    sys.meta_path.append(_MovedEntryPoints())
