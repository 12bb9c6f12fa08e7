"""A grammar compiler in a process of its own: the router's check of a structured output
before any engine compiles it (``router/requests/guide_check.py``).

It compiles exactly as an engine does (``GuidedDecoding.matcher``), one constraint per
line of JSON on stdin (``[kind, spec]``), and answers a line per constraint (``{}`` or
``{"error": ...}``). A constraint that crashes it (llguidance overflowed its stack on
20,000 chained Lark rules) or runs past the router's time limit ends this process, not an
engine; the router refuses the request and starts another worker.

The compile runs on a thread whose stack is ``CHECK_STACK_BYTES``; engines compile on one
of ``engine.guided.COMPILE_STACK_BYTES``, four times larger, so a constraint that passes
here cannot exhaust an engine's stack.

    python -m preble_backend.engine.outputs.guided_worker MODEL_DIR VOCAB_SIZE
"""

from __future__ import annotations

import json
import sys
import threading

from preble_backend.common.structured_outputs import Guide
from preble_backend.engine.outputs.guided import CHECK_STACK_BYTES, GuidedDecoding


def compile_once(guided: GuidedDecoding, kind: str, spec: str, answer: dict) -> None:
    try:
        guided.matcher(Guide(kind, spec))
    except ValueError as exc:
        answer["error"] = str(exc)


def main(model_path: str, vocab_size: int) -> None:
    guided = GuidedDecoding(model_path, vocab_size, ())
    threading.stack_size(CHECK_STACK_BYTES)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        kind, spec = json.loads(line)
        answer: dict = {}
        thread = threading.Thread(target=compile_once, args=(guided, kind, spec, answer))
        thread.start()
        thread.join()
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
