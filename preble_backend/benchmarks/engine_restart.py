"""How long an engine is gone after its stub is killed, and where the time goes.

``preble serve`` runs with ``--engines`` CPU engines; each round SIGKILLs one engine's
stub (or with ``--kill server`` its tritonserver), round-robin, and times, from the
kill: the router marking it down
(``preble_router_engine_up`` 0), its supervisor seeing it (the log line), and the router
routing to it again (the gauge back at 1: what readiness reflects). Each restart's own
log then splits its start: tritonserver up to the model's load, and the load itself (the
stub's imports, the engine's construction). ``--burn N`` keeps N processes spinning on
the CPU meanwhile, as a loaded host would.

    python -m preble_backend.benchmarks.engine_restart --engines 2 --rounds 4 [--burn 2] [--kill server]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from preble_backend.runtime.launcher import free_ports
from preble_backend.runtime.repository import write_repository
from preble_backend.runtime.supervisor import engine_stub

LOG_TIME = re.compile(r"^[IWE](\d{4} \d\d:\d\d:\d\d\.\d+)")


def engine_up(metrics_port: int, engine: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("preble_router_engine_up{") and f'engine="{engine}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return None


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def model_load_s(log: Path) -> float | None:
    """The last start's model load in an engine server's log (the stub's imports and the
    engine's construction), from Triton's own timestamps."""
    loading = loaded = None
    for line in log.read_text(errors="replace").splitlines():
        found = LOG_TIME.match(line)
        if found and "loading: " in line:
            loading, loaded = datetime.strptime(found.group(1), "%m%d %H:%M:%S.%f"), None
        elif found and "successfully loaded" in line and loading is not None:
            loaded = datetime.strptime(found.group(1), "%m%d %H:%M:%S.%f")
    return (loaded - loading).total_seconds() if loading and loaded else None


def burn() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--burn", type=int, default=0, help="processes spinning on the CPU meanwhile")
    parser.add_argument(
        "--kill",
        choices=("stub", "server"),
        default="stub",
        help="what is SIGKILLed: the engine's stub, or its whole tritonserver",
    )
    parser.add_argument(
        "--every", type=float, default=11.0, help="seconds between an engine serving again and the next kill"
    )
    args = parser.parse_args()
    run = Path(tempfile.mkdtemp(prefix="preble-restart-"))
    repo = write_repository(run / "repo", cpu_engines=args.engines, max_num_tokens=8192)
    ports = free_ports(4)
    serve = subprocess.Popen(
        [sys.executable, "-m", "preble_backend.cli", "serve", "--model-repository", str(repo), "--http-port",
         str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--openai-port",
         str(ports[3]), "--log-file", str(run / "tritonserver.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[tuple[float, str]] = []
    for line in serve.stdout:
        if line.startswith("ready"):
            break

    def read() -> None:
        for ln in serve.stdout:
            lines.append((time.monotonic(), ln))

    threading.Thread(target=read, daemon=True).start()
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.burn)]
    for b in burners:
        b.start()
    try:
        print(f"{args.engines} CPU engines, {args.burn} CPU burners, the {args.kill} killed every "
              f"{args.every:g} s after it serves; seconds from the kill:")  # fmt: skip
        print("engine            router down  supervisor saw  serving again  model load")
        for k in range(args.rounds):
            engine = f"preble_engine_{k % args.engines}"
            kill_at = time.monotonic()
            stub = engine_stub(serve.pid, engine)
            os.kill(stub if args.kill == "stub" else parent_of(stub), signal.SIGKILL)
            down = None
            while time.monotonic() - kill_at < 300:
                up = engine_up(ports[2], engine)
                if up == 0 and down is None:
                    down = time.monotonic() - kill_at
                if down is not None and up == 1:
                    break
                time.sleep(0.05)
            back = time.monotonic() - kill_at
            saw = next((t - kill_at for t, ln in lines if t >= kill_at and f"{engine} failed" in ln), -1.0)
            load_s = model_load_s(run / f"tritonserver.{engine}.log")
            load = f"{load_s:.1f}" if load_s is not None else "?"
            down = -1.0 if down is None else down
            print(f"{engine:16s}  {down:11.2f}  {saw:14.2f}  {back:13.2f}  {load:>10s}", flush=True)
            time.sleep(args.every)
    finally:
        for b in burners:
            b.terminate()
        serve.send_signal(signal.SIGTERM)
        serve.wait(120)


if __name__ == "__main__":
    main()
