"""Invalid values in a model's ``config.pbtxt`` fail that model's load with a reason that
names the key, in Triton's repository index, while the models configured well load."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
from server_utils import launch, repository_index, write_test_repository

from preble_backend.serving.pbtxt import set_config_parameter

pytestmark = pytest.mark.server


def _set(model: Path, key: str, value: str) -> None:
    config = model / "config.pbtxt"
    config.write_text(set_config_parameter(config.read_text(), key, value))


def test_invalid_config_values_fail_the_load_naming_the_key(tmp_path):
    repo = write_test_repository(tmp_path / "bad", cpu_engines=1)
    _set(repo / "preble_engine_0", "chunk_size", "0")
    for key, value in (("page_size", "12"), ("attention_backend", "cuda_magic")):
        model = repo / f"bad_{key}"
        shutil.copytree(repo / "preble_engine_0", model)
        config = model / "config.pbtxt"
        config.write_text(re.sub(r'^name: "[^"]*"', f'name: "bad_{key}"', config.read_text()))
        _set(model, "chunk_size", "512")
        _set(model, key, value)
    _set(repo / "preble", "policy", "nope")
    srv = launch(repo, tmp_path / "bad.log", ready=False, extra_args=["--exit-on-error=false"])
    try:
        index: dict = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            len(index) == 4 and all(m.get("state") in ("READY", "UNAVAILABLE") for m in index.values())
        ):
            time.sleep(0.5)
            try:
                index = {m["name"]: m for m in repository_index(srv)}
            except OSError:
                pass
        reasons = {name: m.get("reason", "") for name, m in index.items()}
        assert "chunk_size=0 is invalid" in reasons["preble_engine_0"]
        assert "page_size=12 is invalid" in reasons["bad_page_size"]
        assert "power of two" in reasons["bad_page_size"]
        assert "attention_backend='cuda_magic' is invalid" in reasons["bad_attention_backend"]
        assert "policy='nope' is invalid" in reasons["preble"]
    finally:
        srv.stop()
