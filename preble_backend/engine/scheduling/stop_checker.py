"""When a request stops: EOS, stop token ids, stop strings, max_tokens, the context limit.

Stop strings are matched on detokenized text, so the engine needs the model directory's
tokenizer for them; it is loaded only when a request first asks for stop strings.
"""

from __future__ import annotations

import json
from pathlib import Path

from preble_backend.engine.scheduling.request import Request


class StopChecker:
    def __init__(self, model_path: str | Path, eos_token_ids: tuple[int, ...]) -> None:
        self.model_path = Path(model_path)
        self.eos_token_ids = tuple(eos_token_ids) + _generation_eos(self.model_path)
        self._tokenizer = None

    def require_tokenizer(self):
        if self._tokenizer is None:
            if (
                not (self.model_path / "tokenizer.json").is_file()
                and not (self.model_path / "tokenizer.model").is_file()
            ):
                raise ValueError(f"stop strings need a tokenizer, and {self.model_path} has none")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        return self._tokenizer

    def banned(self, req: Request) -> list[int]:
        """Token ids that may not be sampled yet (``min_tokens`` not reached)."""
        p = req.params
        if len(req.output_ids) >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))

    def finish_reason(self, req: Request, max_context: int) -> str | None:
        p = req.params
        token = req.output_ids[-1]
        if len(req.output_ids) >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                return "stop"
            if p.stop and self._hits_stop_string(req):
                return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= max_context:
            return "length"
        return None

    def _hits_stop_string(self, req: Request) -> bool:
        """vLLM's rule: a stop string counts where it ends in the text the newest token
        added, so one completed before ``min_tokens`` never stops the request later (the
        next occurrence does). Only the tail an occurrence can lie in is decoded (every
        token carries at least one byte, a character at most four)."""
        stop = req.params.stop
        window = req.output_ids[-(4 * max(len(s) for s in stop) + 4) :]
        tokenizer = self.require_tokenizer()
        text = tokenizer.decode(window, skip_special_tokens=True)
        before = len(tokenizer.decode(window[:-1], skip_special_tokens=True).rstrip("\ufffd"))
        return any(text.find(s, max(0, before - len(s) + 1)) >= 0 for s in stop)


def _generation_eos(model_path: Path) -> tuple[int, ...]:
    path = model_path / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
