"""The router's check of a structured output before admission: compiled in a worker
process (``engine/outputs/guided_worker.py``) with a time limit, so that a constraint which is
slow to compile holds only its own request, and one that crashes the compiler crashes no
engine. Answers are remembered (the engines compile the same text the same way), so a
schema that a client sends again costs nothing.

Workers start on the first guided request (each imports the tokenizer, a second or two)
and are reused; a worker that ran past the limit or died is replaced.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections import OrderedDict
from pathlib import Path

from preble_backend.common.structured_outputs import Guide
from preble_backend.serving.protocol import BadRequest

START_TIMEOUT_S = 120.0
REMEMBERED = 512


class GuideCheck:
    def __init__(self, model_path: str, vocab_size: int, timeout_s: float, workers: int = 2) -> None:
        self.model_path, self.vocab_size, self.timeout_s = model_path, vocab_size, timeout_s
        self.idle: list[asyncio.subprocess.Process] = []
        self.slots: asyncio.Semaphore | None = None  # made on the loop that uses it
        self.workers = workers
        self.answers: OrderedDict[Guide, str | None] = OrderedDict()  # guide -> refusal (None: fine)

    async def check(self, guide: Guide) -> None:
        """Return if ``guide`` compiles within the limit; else ``BadRequest`` naming why."""
        if guide in self.answers:
            self.answers.move_to_end(guide)
        else:
            if self.slots is None:
                self.slots = asyncio.Semaphore(self.workers)
            async with self.slots:
                self.answers[guide] = await self._compile(guide)
            while len(self.answers) > REMEMBERED:
                self.answers.popitem(last=False)
        refusal = self.answers[guide]
        if refusal is not None:
            raise BadRequest(refusal)

    async def _compile(self, guide: Guide) -> str | None:
        worker = self.idle.pop() if self.idle else await self._start()
        worker.stdin.write(json.dumps([guide.kind, guide.spec]).encode() + b"\n")
        try:
            await worker.stdin.drain()
            line = await asyncio.wait_for(worker.stdout.readline(), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            worker.kill()
            await worker.wait()
            return (f"structured output {guide.kind} took more than {self.timeout_s:g} s to compile "
                    "(guided_compile_timeout_s): too complex")  # fmt: skip
        except (ConnectionError, OSError):
            line = b""
        if not line:
            code = await worker.wait()
            return f"structured output {guide.kind} crashed the grammar compiler (exit {code}): refused"
        self.idle.append(worker)
        return json.loads(line).get("error")

    async def _start(self) -> asyncio.subprocess.Process:
        python = sys.executable  # in a Triton stub, the stub: then PATH's python3 (its venv's first)
        if not Path(python).name.startswith("python"):
            python = shutil.which("python3") or python
        worker = await asyncio.create_subprocess_exec(
            python, "-m", "preble_backend.engine.outputs.guided_worker",
            self.model_path, str(self.vocab_size),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            cwd=str(Path(__file__).resolve().parents[3]),
        )  # fmt: skip
        try:
            ready = await asyncio.wait_for(worker.stdout.readline(), START_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            ready = b""
        if not ready:
            worker.kill()
            raise RuntimeError("the grammar checker did not start")
        return worker

    async def close(self) -> None:
        """End the idle workers (on the loop that started them)."""
        workers, self.idle = self.idle, []
        for worker in workers:
            if worker.returncode is None:
                worker.kill()
            await worker.wait()


def vocab_size(model_dir, tokenizer) -> int:
    """The model's vocabulary (its logits' width), else the tokenizer's."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return len(tokenizer)
