"""Grammar-constrained decoding: each guided request's next-token mask, from llguidance.

llguidance was chosen by measurement (``python -m preble_backend.benchmarks.guided``,
docs/BENCHMARKS.md): on a tool-arguments JSON schema at batch 32 over SmolLM2's 49k
vocabulary it filled masks in about half xgrammar 0.2.8's time; xgrammar 0.2.9 fills them
~13x faster than llguidance (2026-11-29). It takes the Lark grammars the API accepts.
Each request gets its own matcher, which follows the tokens it samples; masks are filled
for the guided rows of a batch only, so unconstrained batch-mates pay nothing.

Grammars are llguidance's: JSON schemas, regular expressions (Rust's syntax) and Lark
grammars (``structured_outputs.grammar``, as vLLM's guidance backend takes them).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from pathlib import Path

import numpy as np
import torch

from preble_backend.common.empty_language import lark_empty, schema_empty
from preble_backend.common.structured_outputs import Guide

# Whitespace between JSON tokens is fixed (``, `` and ``: ``): free whitespace lets a small
# model spend its whole budget on newlines inside an unfinished answer.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Compiling recurses with the grammar's depth. The router's check (``guided_worker.py``)
# compiles on a stack of CHECK_STACK_BYTES; engines compile on one four times larger, so
# what passed the check has room to spare here.
CHECK_STACK_BYTES = 16 << 20
COMPILE_STACK_BYTES = 64 << 20
# The probe of a compiled grammar (``probe``): tokens consumed at most, and the widest
# choice it follows exhaustively; a wider one is taken as satisfiable (undecided).
PROBE_TOKENS = 64
PROBE_WIDTH = 16
# What a client is told when a constraint allows nothing (fronts answer "allows no" 400;
# protocol.INVALID). llguidance's own error text (its parser state) goes to the log only.
ENDLESS = "what follows refers to itself with no base case, so no output is ever complete"
NO_TOKEN = "no token can continue it"
BANNED = "the tokens it allows are all banned (min_tokens, stop_token_ids)"


class ConstraintError(ValueError):
    """A structured output that allows no (further) output: the request's own fault."""


log = logging.getLogger(__name__)


class GuidedDecoding:
    """The engine's grammar side: built on the first guided request (it needs the model's
    tokenizer), then shared by every request."""

    def __init__(self, model_path: str | Path, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import llguidance  # not llguidance.torch: it torch.compiles, and inductor's import fails in
        import llguidance.hf  # a Triton stub, whose locale decodes its templates as ASCII
        from transformers import AutoTokenizer

        path = Path(model_path)
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
            raise ValueError(f"structured outputs need a tokenizer, and {path} has none")
        self.ll = llguidance
        hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        stops = {*stop_token_ids, self.tokenizer.eos_token}
        self.stop_set = frozenset(stops)
        self.stop_token_ids = torch.tensor(sorted(stops), dtype=torch.long)

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one instance per engine, for the engine's life)
    def grammar(self, guide: Guide) -> str:
        """The constraint as an llguidance grammar, checked; one llguidance refuses is a
        ``ValueError`` naming it."""
        build = self.ll.LLMatcher
        if guide.kind == "json":
            text = build.grammar_from_json_schema(guide.spec, defaults=COMPACT_JSON)
        elif guide.kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
            text = build.grammar_from_json_schema('{"type": "object"}', defaults=COMPACT_JSON)
        elif guide.kind == "regex":
            text = build.grammar_from_regex(guide.spec)
        elif guide.kind == "choice":
            text = build.grammar_from_regex("|".join(_regex_literal(s) for s in json.loads(guide.spec)))
        else:
            text = build.grammar_from_lark(guide.spec)
        error = build.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"structured output {guide.kind} cannot be compiled: {_first_line(error)}")
        why = lark_empty(guide.spec) if guide.kind == "grammar" else None
        why = schema_empty(guide.spec) if guide.kind == "json" else why
        why = why or self.probe(self.ll.LLMatcher(self.tokenizer, text))
        if why:
            raise ConstraintError(f"structured output {guide.kind} allows no output: {why}")
        return text

    def probe(self, matcher) -> str | None:
        """Why no output satisfies the compiled grammar, where a bounded search proves it:
        every narrow path from the start (at most ``PROBE_WIDTH`` tokens to choose from)
        dies within ``PROBE_TOKENS`` tokens, either on a mask that allows nothing or on a
        token after which llguidance finds the forced continuation endless. Else None."""
        budget = [PROBE_TOKENS]
        deaths: set[str] = set()

        def search(m) -> bool | None:  # True: an output completes; False: none; None: undecided
            if m.is_accepting():
                return True
            bitmask = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
            if m.is_error():
                deaths.add(NO_TOKEN)
                return False
            allowed = np.flatnonzero(np.unpackbits(bitmask, bitorder="little")[: self.vocab_size])
            allowed = [t for t in allowed.tolist() if t not in self.stop_set]
            if not allowed:
                deaths.add(NO_TOKEN)
                return False
            if len(allowed) > PROBE_WIDTH:
                return None
            outcome: bool | None = False
            for token in allowed:
                if budget[0] <= 0:
                    return None
                budget[0] -= 1
                child = m.deep_copy()
                if not child.consume_token(token) or child.is_error():
                    deaths.add(ENDLESS)
                    continue
                found = search(child)
                if found:
                    return True
                outcome = None if found is None else outcome
            return outcome

        try:
            found = search(matcher)
        except Exception:  # the probe only refuses what it proves; anything else is undecided
            log.warning("structured output probe gave up", exc_info=True)
            return None
        if found is not False:
            return None
        if deaths == {NO_TOKEN}:
            return "it matches no string"
        if deaths == {ENDLESS}:
            return ENDLESS
        return f"every way to continue it ends where {NO_TOKEN} or {ENDLESS}"

    def matcher(self, guide: Guide, prefix_ids: tuple[int, ...] = ()):
        """A fresh matcher for one request, advanced over ``prefix_ids`` (a migrated
        request's tokens so far)."""
        matcher = self.ll.LLMatcher(self.tokenizer, self.grammar(guide))
        if matcher.is_error():
            error = _first_line(matcher.get_error())
            raise ValueError(f"structured output {guide.kind} cannot be compiled: {error}")
        if prefix_ids and not matcher.consume_tokens(list(prefix_ids)):
            raise ValueError("guided_prefix_ids do not match the structured output's grammar")
        return matcher

    def matcher_on_own_stack(self, guide: Guide, prefix_ids: tuple[int, ...] = ()):
        """``matcher`` on a thread whose stack is ``COMPILE_STACK_BYTES`` (the caller's may
        be smaller: a Triton stub's threads are its own)."""
        result: dict = {}

        def run() -> None:
            try:
                result["matcher"] = self.matcher(guide, prefix_ids)
            except Exception as exc:  # raised again on the caller's thread
                result["error"] = exc

        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="preble-guided-compile")
            thread.start()
        finally:
            threading.stack_size(previous)
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["matcher"]

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, object]]) -> tuple[dict, set, dict]:
        """Each ``(row, matcher)``'s logits with the disallowed tokens at -inf; the rows
        whose answer is complete (only a stop token may follow: the request stops there,
        even where ``min_tokens`` or ``ignore_eos`` would ban the stop); and the rows whose
        grammar allows no token at all, with why (each fails alone; llguidance's own words,
        its parser's state, go to the log)."""
        bitmask = np.zeros((len(rows), (self.vocab_size + 31) // 32), dtype=np.int32)
        failed = {}
        for i, (row, matcher) in enumerate(rows):
            matcher.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, bitmask.shape[1] * 4)
            if matcher.is_error():
                log.info("structured output matcher failed: %s", matcher.get_error())
                failed[row] = NO_TOKEN
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(allowed[:, : logits.shape[-1]]).to(logits.device, torch.bool)
        for (row, _), none in zip(rows, (~allowed.any(1)).tolist()):
            if none:
                failed.setdefault(row, NO_TOKEN)
        index = torch.tensor([r for r, _ in rows], device=logits.device)
        masked = logits[index].masked_fill(~allowed, float("-inf"))
        only_stops = allowed.sum(1) == allowed[:, self.stop_token_ids.to(allowed.device)].sum(1)
        complete = {r for (r, _), done in zip(rows, only_stops.tolist()) if done} - set(failed)
        return {r: row for (r, _), row in zip(rows, masked)}, complete, failed


def constraint_message(guide: Guide, produced: int, why: str) -> str:
    tokens = f"{produced} token" + ("" if produced == 1 else "s")
    return f"structured output {guide.kind} allows no complete output after {tokens}: {why}"


def tokens_left(row: torch.Tensor, banned: list[int]) -> torch.Tensor:
    """Which tokens a guided row's mask allows and ``min_tokens`` and stops do not ban: the
    sampler may emit only these."""
    left = torch.isfinite(row)
    left[banned] = False
    return left


def _first_line(error: str) -> str:
    """A compiler's message without the parser state llguidance may append."""
    line = error.strip().split("\n", 1)[0].split("<state>", 1)[0].strip()
    return line[:300] or "rejected by the grammar compiler"


def _regex_literal(text: str) -> str:
    """``text`` as a regular expression matching exactly it."""
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/-" else ch for ch in text)
