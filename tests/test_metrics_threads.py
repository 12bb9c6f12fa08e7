"""Custom metrics updated from many threads of one model at once: the case that crashed
tritonserver when every thread called ``pb_utils`` metrics itself. Through ``Metrics``
(one publisher thread) the server survives and every update is counted."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
from server_utils import launch

pytestmark = pytest.mark.server

CONFIG = """name: "metrics_threads"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "THREADS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

MODEL = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils
from preble_backend.serving.metrics import Metrics, MetricSpec


class TritonPythonModel:
    def initialize(self, args):
        self.metrics = Metrics({"model": "metrics_threads"}, [
            MetricSpec("threads_updates_total", "counter", "updates"),
            MetricSpec("threads_value_seconds", "histogram", "values", (0.1, 1.0)),
            MetricSpec("threads_gauge", "gauge", "last value"),
        ])

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "THREADS").as_numpy()[0])
            def work(i):
                for _ in range(200):
                    self.metrics.count("threads_updates_total", 1, {"kind": "shared"})
                    self.metrics.observe("threads_value_seconds", 0.5)
                    self.metrics.gauge("threads_gauge", i)
            threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out = pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))
            request.get_response_sender().send(
                pb_utils.InferenceResponse([out]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            )

    def finalize(self):
        self.metrics.close()
"""


def test_metrics_from_sixteen_threads_at_once_are_all_counted(tmp_path):
    model = tmp_path / "repo" / "metrics_threads"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    (model / "1" / "model.py").write_text(MODEL)
    server = launch(tmp_path / "repo", tmp_path / "server.log")
    try:
        for _ in range(5):
            body = json.dumps({"THREADS": 16}).encode()
            url = f"http://127.0.0.1:{server.ports.http}/v2/models/metrics_threads/generate"
            with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as r:
                assert json.loads(r.read())["OUT"] == 16
        expected = 5 * 16 * 200
        deadline = time.monotonic() + 60
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10) as r:
                text = r.read().decode()
            # every series carries the stub's pid (see preble_backend/serving/metrics.py)
            values = {re.sub(r',pid="\d+"', "", ln.rsplit(" ", 1)[0]): float(ln.rsplit(" ", 1)[1])
                      for ln in text.splitlines() if ln.startswith("threads_")}  # fmt: skip
            counted = values.get('threads_updates_total{kind="shared",model="metrics_threads"}')
            observed = values.get('threads_value_seconds_count{model="metrics_threads"}')
            if (counted, observed) == (expected, expected) or time.monotonic() > deadline:
                break  # the publisher applies what queued behind the answers
            time.sleep(0.2)
        assert (counted, observed) == (expected, expected)
        assert values['threads_gauge{model="metrics_threads"}'] in range(16)
        assert server.process.poll() is None
    finally:
        server.stop()
