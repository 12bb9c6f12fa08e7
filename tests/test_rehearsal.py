"""The device's environment rehearsed on the CPU (``kernels/rehearsal.py``): the device
script's stack step, from the unpacked bundle, in a virtual environment with the device
image's versions. Two lent sessions were lost to what this catches: with the numpy-2 fix
reverted it fails as the H200 did (both stubs crash on their first request, "unpack_from
requires a buffer of at least 1802201967 bytes"), and with the import-path fix reverted it
fails as the first H200 did (the router: "No module named 'tritonclient'")."""

from __future__ import annotations

import pytest

from kernels.rehearsal import Unavailable, check_image, image_pins, rehearse


def test_the_rehearsal_pins_the_image_and_numpy_2_for_this_python():
    assert "torch==2.11.0" in image_pins((3, 11)) and "triton==3.6.0" in image_pins((3, 11))
    assert "numpy==2.5.2" in image_pins((3, 12))  # the image's own, where its Python is ours
    assert "numpy>=2,<2.5" in image_pins((3, 11))  # numpy 2.5 needs 3.12: the newest 2.x stands in


def test_an_environment_unlike_the_image_is_named():
    image = {"numpy": "2.4.6", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0",
             "tokenizers": "0.23.2", "safetensors": "0.8.0"}  # fmt: skip
    assert check_image(image) == []
    assert check_image({**image, "numpy": "1.26.4", "tritonclient": "2.51.0", "torch": "2.13.0"}) == [
        "torch 2.13.0 (the image: 2.11.0)",
        "numpy 1.26.4 (the image: 2.5.2)",
        "tritonclient is installed (the image lacks it)",
    ]


@pytest.mark.server
def test_the_device_scripts_stack_and_tests_steps_pass_in_the_device_images_environment(tmp_path):
    """``gpu_check.sh stack tests`` with ``DEVICE=cpu``: the server and the front's packages
    from ``.device/`` unpacked as on the device, numpy 2 under them, every answer through
    gRPC and the OpenAI front the in-process engine's, and the kernels' tests passing in the
    image's Triton (its interpreter)."""
    try:
        results = rehearse(tmp_path / "out")
    except Unavailable as exc:
        pytest.skip(f"the device image's versions cannot be installed here: {exc}")
    assert results["differs_from_image"] == [] and results["unmet_requirements"] == {}
    assert results["versions"]["numpy"].startswith("2.") and results["versions"]["torch"] == "2.11.0"
    assert results["tritonserver"] == "$REHEARSAL/site/pytriton/tritonserver"
    assert (
        "flashinfer 0.5.3" in results["machine"]
    )  # carried in .device/, it imports beside the image's torch
    steps = results["steps"]
    assert [name for name, step in steps.items() if not step["ok"]] == [], results["summary"]
    for front in ("grpc", "openai"):
        assert steps[front]["identical"] and steps[front]["of"] == 8
    assert steps["load"]["requests"] == 32
    assert results["failed_steps"] == [], results[
        "summary"
    ]  # the kernels' tests under the image's Triton too
