"""Incremental detokenization that never splits a multi-byte character, and stop strings.

Byte-level BPE tokens can end inside a UTF-8 character; decoding such a prefix yields
U+FFFD. Text is therefore released only when the decoded tail does not end in U+FFFD,
and it is decoded over a short window of earlier tokens (as vLLM does) so that tokenizers
which merge spaces across token boundaries still produce the right characters.

Stop strings follow vLLM: an occurrence counts only if it ends after the text of the
first ``min_tokens - 1`` tokens (the engine checks from the ``min_tokens``-th token on, and
only what each token adds), and the text is cut where the occurrence that stopped the
engine begins.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self._floor: int | None = 0 if min_tokens <= 1 else None  # where a counted occurrence may end
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text has been released
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all text decoded so far
        self._sent = 0  # characters of ``text`` handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the new text that is safe to send (none after a stop string)."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        if self._floor is None and len(self.ids) >= self.min_tokens - 1:
            self._floor = len(self._decode(self.ids[: self.min_tokens - 1]).rstrip("\ufffd"))
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped and self._floor is not None:
            found = (self.text.find(s, max(0, self._floor - len(s) + 1)) for s in self.stop)
            cut = min((i for i in found if i >= 0), default=-1)
            if cut >= 0:
                self.text, self.stopped = self.text[:cut], True
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._hold)
        out, self._sent = self.text[self._sent : end], end
        return out
