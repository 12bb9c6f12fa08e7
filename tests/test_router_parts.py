"""Router pieces that need no server: incremental detokenization, stop strings, the
simplest policies, the engines parameter."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from preble_backend.common.sampling_params import SamplingParams
from preble_backend.router.config import RouterConfig
from preble_backend.router.engines.discovery import Discovery
from preble_backend.router.engines.engine_client import LocalEngine, RemoteEngine, make_engine_client
from preble_backend.router.engines.loopback import grpc_url_from_args
from preble_backend.router.requests.detokenizer import IncrementalDetokenizer
from preble_backend.runtime.repository import write_repository
from scheduler.policies import make_policy
from scheduler.policy import InstanceLoad, RoutingRequest

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


def test_a_stop_string_before_min_tokens_is_not_where_the_text_is_cut(tokenizer):
    """The text is cut at the occurrence that stopped generation: with ``min_tokens`` past
    the first occurrence, the second one."""
    text = "The cat sat. The dog ran. The end."
    ids = tokenizer(text).input_ids
    first_done = next(k for k in range(1, len(ids) + 1) if "." in tokenizer.decode(ids[:k]))
    detok = IncrementalDetokenizer(tokenizer, stop=(".",), min_tokens=first_done + 1)
    streamed = "".join(detok.add([t]) for t in ids) + detok.add([], final=True)
    assert streamed == "The cat sat. The dog ran" and detok.stopped
    early = IncrementalDetokenizer(tokenizer, stop=(".",), min_tokens=first_done)
    assert "".join(early.add([t]) for t in ids) + early.add([], final=True) == "The cat sat"


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


def test_policies_refuse_unknown_options():
    """A misspelt tunable is an error naming it and the policy's real ones; cluster facts
    go only to the policies that take them."""
    with pytest.raises(ValueError, match=r"policy e2 takes no option\(s\) th_bla; its options: .*th_bal"):
        make_policy("e2", 2, th_bla=2.0)
    with pytest.raises(ValueError, match="policy round_robin takes no option"):
        make_policy("round_robin", 2, page_size=16)
    with pytest.raises(ValueError, match="unknown cluster fact"):
        make_policy("round_robin", 2, {"pages": 16})
    assert make_policy("round_robin", 2, {"page_size": 16, "cost_model": "tiny_cpu"}).name == "round_robin"
    assert make_policy("kv_cost", 2, {"page_size": 32}).block_size == 32


def test_engines_parameter():
    asked = []
    here = lambda: asked.append(1) or "127.0.0.1:9001"  # noqa: E731
    local = make_engine_client("preble_engine_0", here)
    remote = make_engine_client("grpc://10.0.0.2:8001/preble_engine_3", here)
    assert isinstance(local, LocalEngine) and (local.name, local.url) == ("preble_engine_0", "127.0.0.1:9001")
    assert isinstance(remote, RemoteEngine)
    assert (remote.url, remote.model) == ("10.0.0.2:8001", "preble_engine_3")
    assert make_engine_client("h1=grpc://10.0.0.3:8001/e", here).name == "h1"
    assert len(asked) == 1  # this server's endpoint is looked up only for a local engine
    for bad, message in (("grpc://host/model", "grpc://host:port/model"), ("http://h:1/m", "only grpc://")):
        with pytest.raises(ValueError, match=message):
            make_engine_client(bad, here)
        with pytest.raises(ValueError, match=message):
            Discovery(f"preble_engine_0, {bad}")  # refused at load, with the static list
    with pytest.raises(ValueError, match="expected engine names or grpc:// URLs, engines_dns or engine"):
        RouterConfig.from_strings({"engines": " , "})
    assert RouterConfig.from_strings({"engines": "", "engines_dns": "e.svc:8001/preble_engine_0"})


@pytest.mark.parametrize(
    "args, url",
    [
        ([], "127.0.0.1:8001"),
        (["--model-repository=/r", "--grpc-port=9001"], "127.0.0.1:9001"),
        (["--grpc-port", "9002", "--http-port", "9000"], "127.0.0.1:9002"),
        (["--grpc-address=10.1.2.3", "--grpc-port=7"], "10.1.2.3:7"),
        (["--grpc-address", "::", "--grpc-port=7"], "[::1]:7"),
        (["--grpc-address=fe80::1"], "[fe80::1]:8001"),
    ],
)
def test_the_router_finds_its_servers_grpc_endpoint_on_the_command_line(args, url):
    assert grpc_url_from_args(args) == url


def test_a_server_without_grpc_is_named():
    with pytest.raises(ValueError, match="--allow-grpc=false.*server_grpc_url"):
        grpc_url_from_args(["--allow-grpc=false"])


def test_checked_in_repository_is_the_writers(tmp_path):
    """The tensor specs and settings are declared once (protocol, configs) and rendered by
    the repository writer: the checked-in repository is exactly its output."""
    written = write_repository(tmp_path / "repo", cpu_engines=2, host_cores=2)
    checked_in = Path(__file__).resolve().parent.parent / "model_repository"
    # (a server that ran on it left __pycache__ behind: not part of the repository)
    files = sorted(p.relative_to(checked_in) for p in checked_in.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)  # fmt: skip
    assert files == sorted(p.relative_to(written) for p in written.rglob("*") if p.is_file())
    for name in files:
        assert (written / name).read_text() == (checked_in / name).read_text(), name


def test_router_config_names_each_bad_parameter():
    config = RouterConfig.from_strings({"policy": "kv_cost", "page_size": "32", "health_timeout_s": "2.5"})
    assert (config.policy, config.page_size, config.health_timeout_s) == ("kv_cost", 32, 2.5)
    for values, message in (
        ({"polcy": "e2"}, "unknown router parameter.*polcy"),
        ({"policy": "e3"}, "policy='e3' is invalid: expected one of e2, round_robin"),
        ({"max_queue": "many"}, "max_queue='many' is invalid: expected an integer"),
        ({"max_inflight": "0"}, "max_inflight=0 is invalid"),
        ({"health_interval_s": "0"}, "health_interval_s=0.0 is invalid"),
        ({"tpot_slo_ms": "-5"}, "tpot_slo_ms=-5.0 is invalid: expected a number >= 0"),
        ({"tpot_slo_ms": "nan"}, "tpot_slo_ms=nan is invalid"),
        ({"ttft_slo_ms": "-1"}, "ttft_slo_ms=-1.0 is invalid: expected a number >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            RouterConfig.from_strings(values)


def test_sampling_parameters_may_come_as_strings_as_the_vllm_backend_takes_them():
    """Triton's vLLM backend converts string values (its sample client and genai-perf send
    them); so do we, and refuse what is not exactly a value of the key's type."""
    params = SamplingParams.from_json(
        '{"temperature": "0.1", "top_p": "0.95", "max_tokens": "100", "min_tokens": " 2 ",'
        ' "ignore_eos": "true", "presence_penalty": "-0.5", "logprobs": "3", "stop_token_ids": ["7"]}'
    )
    assert (params.temperature, params.top_p, params.max_tokens, params.min_tokens) == (0.1, 0.95, 100, 2)
    assert params.ignore_eos is True and params.presence_penalty == -0.5 and params.logprobs == 3
    assert params.stop_token_ids == (7,)
    assert SamplingParams.from_dict({"ignore_eos": "False"}).ignore_eos is False
    for raw, message in (({"max_tokens": "1.5"}, "max_tokens must be an integer"),
                         ({"temperature": "warm"}, "temperature must be a number"),
                         ({"temperature": "nan"}, "temperature must be a finite number"),
                         ({"ignore_eos": "maybe"}, "ignore_eos must be a boolean")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            SamplingParams.from_dict(raw)


def test_cpu_engines_get_disjoint_cores_and_oversubscription_is_refused(tmp_path):
    def cores(repo):
        configs = sorted(repo.glob("preble_engine_*/config.pbtxt"))
        pattern = r'key: "cpu_cores" value: \{ string_value: "([^"]*)"'
        return [re.search(pattern, config.read_text()).group(1) for config in configs]

    assert cores(write_repository(tmp_path / "a", cpu_engines=2, host_cores=4)) == ["0-1", "2-3"]
    assert cores(write_repository(tmp_path / "b", cpu_engines=3, host_cores=8)) == ["0-1", "2-3", "4-5"]
    assert cores(write_repository(tmp_path / "c", cpu_engines=2)) == ["", ""]  # not pinned
    emulated = write_repository(tmp_path / "d", cpu_engines=6, host_cores=2, compute="emulated")
    assert cores(emulated) == [""] * 6  # an emulated engine waits: no cores of its own
    with pytest.raises(ValueError, match="cpu_engines=3 is invalid on 2 cores: CPU engines would share"):
        write_repository(tmp_path / "e", cpu_engines=3, host_cores=2)


def test_a_server_listens_on_loopback_and_restricts_admin_apis_unless_told(tmp_path, monkeypatch):
    from preble_backend.runtime.access import Access

    args = Access(admin_key="adm").server_args()
    assert args[:3] == ["--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"]
    admin = "model-repository,logging,trace,shared-memory:authorization=Bearer adm"
    assert args[3:] == [f"--http-restricted-api={admin}", f"--grpc-restricted-protocol={admin}"]
    keyed = Access(host="0.0.0.0", api_key="k", admin_key="adm", http_host="127.0.0.1").server_args()
    assert keyed[:2] == ["--http-address=127.0.0.1", "--grpc-address=0.0.0.0"]
    client = "inference,metadata,model-config,statistics:authorization=Bearer k"
    rules = [
        f"--{kind}={rule}"
        for rule in (admin, client)
        for kind in ("http-restricted-api", "grpc-restricted-protocol")
    ]
    assert keyed[3:] == rules
    with pytest.raises(ValueError, match="must differ from the API key"):
        Access(api_key="same", admin_key="same").server_args()


def test_bench_finds_the_admin_key_serve_left_for_its_port(tmp_path, monkeypatch):
    from preble_backend.cli.commands import _admin_key, _bench_key
    from preble_backend.cli.options import build_parser
    from preble_backend.runtime.access import write_admin_key

    monkeypatch.setenv("PREBLE_CACHE", str(tmp_path))
    monkeypatch.delenv("PREBLE_API_KEY", raising=False)
    monkeypatch.delenv("PREBLE_ADMIN_KEY", raising=False)
    assert write_admin_key(8123, "k1").stat().st_mode & 0o777 == 0o600

    def keys(*argv: str):
        args = build_parser().parse_args(["bench", *argv])
        return _bench_key(args), _admin_key(args)

    assert keys("--url", "127.0.0.1:8123") == (None, "k1")  # the admin key never goes on requests
    assert keys("--url", "127.0.0.1:8124") == (None, None)
    assert keys("--url", "127.0.0.1:8123", "--api-key", "given") == ("given", "k1")
    assert keys("--url", "127.0.0.1:8123", "--admin-key", "adm") == (None, "adm")
    monkeypatch.setenv("PREBLE_API_KEY", "env")
    monkeypatch.setenv("PREBLE_ADMIN_KEY", "env-admin")
    assert keys("--url", "127.0.0.1:8123") == ("env", "env-admin")


def test_every_generated_key_can_be_passed_on_a_command_line():
    """A key starting with "-" reads as an option (1 URL-safe key in 64 did): the class
    of keys serve prints and the bench's tests pass as ``--admin-key KEY``."""
    from preble_backend.cli.options import build_parser
    from preble_backend.runtime.access import new_key

    parser = build_parser()
    for key in (new_key() for _ in range(1000)):
        assert parser.parse_args(["bench", "--admin-key", key, "--api-key", key]).admin_key == key


def _output(tokens, finished=False, logprobs=None):
    from preble_backend.engine.scheduling.request import RequestOutput

    return RequestOutput("r", tokens, finished, "length" if finished else None, 7, 0, 0, logprobs=logprobs)


def test_outputs_waiting_for_the_response_thread_go_as_one():
    """Every token due (interval 0 ms): an idle request is queued per token; tokens that
    arrive while it waits for the response thread join its response, logprobs in order."""
    from preble_backend.engine_server.coalescer import Coalescer

    held = Coalescer(stream_interval=16, stream_interval_ms=0)
    assert held.add(_output([5], logprobs=[{5: (-0.1, 1)}]))
    assert not held.add(_output([6], logprobs=[{6: (-0.2, 1)}]))  # already queued: joins it
    out, report = held.take("r")
    assert out.token_ids == [5, 6] and out.logprobs == [{5: (-0.1, 1)}, {6: (-0.2, 1)}]
    assert report is None and not out.finished
    assert held.add(_output([7]))  # sent: the next token is queued again
    assert not held.add(_output([8], finished=True), report="final report")
    out, report = held.take("r")
    assert out.token_ids == [7, 8] and out.finished and report == "final report"


def test_stream_interval_holds_tokens_after_the_first_until_due():
    from preble_backend.engine_server.coalescer import Coalescer

    held = Coalescer(stream_interval=3, stream_interval_ms=60_000)
    assert held.add(_output([1]))  # the first token goes at once
    assert held.take("r")[0].token_ids == [1]
    assert [held.add(_output([t])) for t in (2, 3, 4)] == [False, False, True]
    assert held.take("r")[0].token_ids == [2, 3, 4]
    assert not held.add(_output([5]))
    assert held.add(_output([6], finished=True))  # the last goes at once
    out, _ = held.take("r")
    assert out.token_ids == [5, 6] and out.finished and out.finish_reason == "length"


def test_a_response_per_interval_and_held_tokens_are_swept_when_overdue():
    import time

    from preble_backend.engine_server.coalescer import Coalescer

    held = Coalescer(stream_interval=16, stream_interval_ms=30)
    assert held.add(_output([1]))
    held.take("r")
    assert not held.add(_output([2]))  # under 30 ms since the last response: held
    assert held.overdue() == []
    time.sleep(0.035)
    assert held.overdue() == ["r"]  # a stalled stream's tokens go anyway
    assert held.overdue() == []  # queued once
    assert held.take("r")[0].token_ids == [2]
    time.sleep(0.035)
    assert held.add(_output([3]))  # a slow engine: every token arrives due


def test_each_policy_name_leads_to_the_class_of_that_name():
    from scheduler.policies import POLICIES, policy_class

    assert {name: policy_class(name).name for name in POLICIES} == {name: name for name in POLICIES}


def test_quarantine_refuses_the_same_request_until_its_time_is_up():
    from preble_backend.router.requests.quarantine import Quarantine

    now = [100.0]
    q = Quarantine(ttl_s=60.0, clock=lambda: now[0])
    assert q.refusal("prompt", '{"max_tokens": 4}') is None
    q.add("prompt", '{"max_tokens": 4}')
    assert "refused for 60 s more" in q.refusal("prompt", '{"max_tokens": 4}')
    assert q.refusal("prompt", '{"max_tokens": 5}') is None  # other parameters: another request
    assert q.refusal("prompt!", '{"max_tokens": 4}') is None
    now[0] += 45
    assert "refused for 15 s more" in q.refusal("prompt", '{"max_tokens": 4}')
    now[0] += 15
    assert q.refusal("prompt", '{"max_tokens": 4}') is None
    q.add("a", "{}")  # an expired entry is dropped when another is added
    assert list(q.until) == [Quarantine.fingerprint("a", "{}")]


def test_an_admin_request_needs_the_admin_key_before_anything_else():
    from preble_backend.router.cluster.admin import AdminRefused, parse_admin
    from preble_backend.serving.protocol import BadRequest

    good = {"preble_admin": "configure", "preble_policy": "round_robin", "preble_admin_key": "adm"}
    assert parse_admin(good, "adm").policy == "round_robin"
    for params, key in (({**good, "preble_admin_key": "guess"}, "adm"), ({**good, "preble_admin": "nope",
                         "preble_admin_key": "x"}, "adm"), (good, None)):  # fmt: skip
        with pytest.raises(AdminRefused, match="admin control needs the admin key"):
            parse_admin(params, key)  # a wrong op is not even named to a caller without the key
    with pytest.raises(BadRequest, match="preble_admin='nope' is invalid"):
        parse_admin({**good, "preble_admin": "nope"}, "adm")
    with pytest.raises(BadRequest, match="preble_policy='e3' is invalid"):
        parse_admin({**good, "preble_policy": "e3"}, "adm")
    assert parse_admin({"preble_admin": "status", "preble_admin_key": "adm"}, "adm").policy is None


def test_metrics_federation_merges_families_and_labels_each_engine():
    from preble_backend.frontend.metrics_federation import merge

    router = ('# HELP nv_cpu_utilization CPU\n# TYPE nv_cpu_utilization gauge\nnv_cpu_utilization 0.5\n'
              '# HELP preble_router_engines engines\n# TYPE preble_router_engines gauge\n'
              'preble_router_engines{model="preble"} 2\n')  # fmt: skip
    engine = (
        "# HELP nv_cpu_utilization CPU\n# TYPE nv_cpu_utilization gauge\nnv_cpu_utilization 0.25\n"
        '# HELP lat seconds\n# TYPE lat histogram\nlat_bucket{le="1"} 3\nlat_sum 1.5\nlat_count 3\n'
    )
    text = merge([(None, router), ("preble_engine_0", engine), ("preble_engine_1", engine)])
    lines = text.splitlines()
    assert lines.count("# TYPE nv_cpu_utilization gauge") == 1 and lines.count("# TYPE lat histogram") == 1
    at = lines.index("# TYPE nv_cpu_utilization gauge")
    assert lines[at + 1 : at + 4] == ["nv_cpu_utilization 0.5",
                                      'nv_cpu_utilization{engine="preble_engine_0"} 0.25',
                                      'nv_cpu_utilization{engine="preble_engine_1"} 0.25']  # fmt: skip
    at = lines.index("# TYPE lat histogram")
    assert lines[at + 1 : at + 4] == ['lat_bucket{engine="preble_engine_0",le="1"} 3',
                                      'lat_sum{engine="preble_engine_0"} 1.5',
                                      'lat_count{engine="preble_engine_0"} 3']  # fmt: skip
    assert 'preble_router_engines{model="preble"} 2' in lines  # the router's own, unlabelled


def test_fresh_ports_never_repeat_and_lie_below_the_kernel_s_own():
    """A server given a port another one was given refuses to start, or, worse, answers the
    other's probes (a full run hit both: HTTP and gRPC on one port; then one engine's
    readiness probe reached another engine's gRPC); and a port in the kernel's ephemeral
    range can be taken before the server binds it (a TP engine's gloo pairs took one).
    Ports from one call, and from every call of one process, are distinct, none is one the
    caller said to avoid, and none is a port the kernel numbers itself."""
    from preble_backend.runtime.launcher import ephemeral_port_range, free_ports

    low, _ = ephemeral_port_range()
    seen: set[int] = set()
    for _ in range(100):
        avoid = free_ports(2)
        ports = free_ports(6, avoid)
        assert len(set(ports)) == 6 and all(0 < p < low for p in ports + avoid)
        assert not seen & set(ports + avoid) and not set(avoid) & set(ports)
        seen |= set(ports + avoid)
