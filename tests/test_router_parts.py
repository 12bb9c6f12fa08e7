"""Router pieces that need no server: incremental detokenization, stop strings, the
simplest policies, the engines parameter."""

from __future__ import annotations

import pytest

from preble_backend.engine.sampling import SamplingParams
from preble_backend.serving.detokenizer import IncrementalDetokenizer
from preble_backend.serving.engine_client import LocalEngine, RemoteEngine, make_engine_clients
from scheduler.policy import InstanceLoad, RoutingRequest, make_policy

TEXT = "Prefix caché: 日本語のテキスト, emoji 🙂 and ASCII."


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_streamed_text_never_splits_a_character(tokenizer):
    ids = tokenizer(TEXT).input_ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # the hard case is present
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids] + [detok.add([], final=True)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    ids = tokenizer(TEXT).input_ids
    detok = IncrementalDetokenizer(tokenizer, stop=("テキスト",))
    streamed = "".join(detok.add([t]) for t in ids) + detok.add([], final=True)
    assert streamed == TEXT[: TEXT.index("テキスト")]
    assert detok.stopped


def request(i: int = 0) -> RoutingRequest:
    return RoutingRequest(str(i), [1, 2, 3], SamplingParams())


def test_round_robin_cycles():
    policy = make_policy("round_robin", 3)
    loads = [InstanceLoad() for _ in range(3)]
    assert [policy.select(request(i), loads).instance for i in range(5)] == [0, 1, 2, 0, 1]


def test_least_load_picks_fewest_in_flight_then_rotates_ties():
    policy = make_policy("least_load", 3)
    loads = [InstanceLoad(in_flight=2), InstanceLoad(in_flight=0), InstanceLoad(in_flight=1)]
    assert policy.select(request(), loads).instance == 1
    idle = [InstanceLoad() for _ in range(3)]
    assert [policy.select(request(i), idle).instance for i in range(3)] == [2, 0, 1]
    # Equal in-flight counts: the engine-reported queue breaks the tie.
    loads = [
        InstanceLoad(1, {"waiting": 4}),
        InstanceLoad(1, {"running": 1}),
        InstanceLoad(1, {"waiting": 3}),
    ]
    assert policy.select(request(), loads).instance == 1


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="policy='e3' is invalid"):
        make_policy("e3", 2)


def test_engines_parameter():
    local, remote = make_engine_clients("preble_engine_0, grpc://10.0.0.2:8001/preble_engine_3")
    assert isinstance(local, LocalEngine) and local.name == "preble_engine_0"
    assert isinstance(remote, RemoteEngine) and (remote.url, remote.model) == (
        "10.0.0.2:8001",
        "preble_engine_3",
    )
    for bad, message in (("", "at least one engine"), ("grpc://host/model", "grpc://host:port/model"),
                         ("http://h:1/m", "only grpc://")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            make_engine_clients(bad)
