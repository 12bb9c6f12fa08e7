"""Grammar-constrained decoding: each guided request's next-token mask, from xgrammar.

xgrammar was chosen by measurement (``python -m preble_backend.engine.bench_guided``,
docs/BENCHMARKS.md): at batch 32 on SmolLM2's 49k vocabulary it fills masks about twice as
fast as llguidance. Grammars compile once per distinct constraint (xgrammar's compiler
caches them); each request gets its own matcher, which follows the tokens it samples.
Masks are filled for the guided rows of a batch only, so unconstrained batch-mates pay
nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from preble_backend.common.structured_outputs import Guide


class GuidedDecoding:
    """The engine's grammar compiler: built on the first guided request (it needs the
    model's tokenizer), then shared by every request."""

    def __init__(self, model_path: str | Path, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        path = Path(model_path)
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
            raise ValueError(f"structured outputs need a tokenizer, and {path} has none")
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))  # fmt: skip
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.vocab_size = vocab_size
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long)

    def compile(self, guide: Guide):
        """The compiled grammar; a constraint xgrammar refuses is a ``ValueError`` naming it."""
        c = self.compiler
        try:
            # Whitespace between JSON tokens is fixed (``, `` and ``: ``): free whitespace lets a
            # small model spend its whole budget on newlines inside an unfinished answer.
            if guide.kind == "json":
                return c.compile_json_schema(guide.spec, any_whitespace=False)
            if guide.kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if guide.kind == "regex":
                return c.compile_regex(guide.spec)
            if guide.kind == "choice":
                return c.compile_regex("|".join(_regex_literal(s) for s in json.loads(guide.spec)))
            return c.compile_grammar(guide.spec)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the parser's message
            raise ValueError(f"structured output {guide.kind} cannot be compiled: {exc}") from None

    def matcher(self, guide: Guide, prefix_ids: tuple[int, ...] = ()):
        """A fresh matcher for one request, advanced over ``prefix_ids`` (a migrated
        request's tokens so far)."""
        matcher = self.xgr.GrammarMatcher(self.compile(guide))
        for token in prefix_ids:
            if not matcher.accept_token(token):
                raise ValueError("guided_prefix_ids do not match the structured output's grammar")
        return matcher

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, object]]) -> tuple[dict, set]:
        """Each ``(row, matcher)``'s logits with the disallowed tokens at -inf, and the
        rows whose answer is complete: only a stop token may follow (the request stops
        there, even where ``min_tokens`` or ``ignore_eos`` would ban the stop)."""
        bitmask = self.xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, (_, matcher) in enumerate(rows):
            matcher.fill_next_token_bitmask(bitmask, i)
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(allowed[:, : logits.shape[-1]]).to(logits.device, torch.bool)
        index = torch.tensor([r for r, _ in rows], device=logits.device)
        masked = logits[index].masked_fill(~allowed, float("-inf"))
        only_stops = allowed.sum(1) == allowed[:, self.stop_token_ids.to(allowed.device)].sum(1)
        complete = {r for (r, _), done in zip(rows, only_stops.tolist()) if done}
        return {r: row for (r, _), row in zip(rows, masked)}, complete


def _regex_literal(text: str) -> str:
    """``text`` as a regular expression matching exactly it."""
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/-" else ch for ch in text)
