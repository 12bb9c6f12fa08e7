"""What the router sends back for one request, response by response: the outputs of
Triton's vLLM backend (``text_output``, ``finish_reason``, ``cumulative_logprob``,
``logprobs``, ``num_input_tokens``, ``num_output_tokens``) plus ours (``num_cached_tokens``,
``instance``), built from the engine's responses as they arrive. Free of Triton imports:
the router wraps each array in a tensor.

``logprobs`` is, per response, a JSON list with one object per new token, keyed by token
id: ``{"logprob", "rank", "decoded_token"}`` for the sampled token and the top
``logprobs`` alternatives (the vLLM backend's format); ``"null"`` when the request's
sampling parameters did not ask for logprobs. ``cumulative_logprob`` sums the sampled
tokens' log probabilities so far.
"""

from __future__ import annotations

import json

import numpy as np

from preble_backend.router.engines.engine_client import EngineResponse
from preble_backend.router.requests.detokenizer import IncrementalDetokenizer
from preble_backend.serving.protocol import GenerateRequest


def _strings(*values: str) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


class Answer:
    def __init__(self, req: GenerateRequest, tokenizer, num_input_tokens: int) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.num_input_tokens = num_input_tokens
        self.detok = IncrementalDetokenizer(tokenizer, req.params.stop, req.params.min_tokens)
        self.num_output = 0
        self.token_ids: list[int] = []  # every token generated so far (a migration's prompt tail)
        self.cumulative_logprob = 0.0
        self._sent_tokens = 0  # tokens reported by the responses sent so far
        self._logprobs: list[dict[int, tuple[float, int]]] = []  # since the last response

    def add(self, resp: EngineResponse) -> str:
        """Take an engine response; return the new text that is safe to stream."""
        self.num_output += len(resp.token_ids)
        self.token_ids.extend(resp.token_ids)
        if resp.logprobs:
            self._logprobs.extend(resp.logprobs)
            self.cumulative_logprob += sum(step[t][0] for step, t in zip(resp.logprobs, resp.token_ids))
        return self.detok.add(resp.token_ids, final=resp.final)

    def full_text(self) -> str:
        """The whole answer, for a non-streaming response."""
        return (self.req.prompt if self.req.prepend_input else "") + self.detok.text

    def outputs(self, text: str, resp: EngineResponse, instance: str) -> dict[str, np.ndarray]:
        """The next response's outputs: ``text`` and what the request asked to see since the
        previous response (counts and logprobs), and on the final one the totals."""
        req, out = self.req, {"text_output": _strings(text)}
        if resp.final or not self._sent_tokens:  # the engine, from the first tokens on (n's choices follow)
            out["instance"] = _strings(instance)
        if req.return_num_output_tokens:
            out["num_output_tokens"] = np.asarray([self.num_output - self._sent_tokens], dtype=np.uint32)
        if req.return_logprobs:
            out["logprobs"] = _strings(self._logprobs_json())
        if req.return_cumulative_logprob:
            out["cumulative_logprob"] = np.asarray([self.cumulative_logprob], dtype=np.float32)
        self._sent_tokens, self._logprobs = self.num_output, []
        if resp.final:
            if req.return_finish_reason:
                out["finish_reason"] = _strings(resp.finish_reason or "")
            if req.return_num_input_tokens:
                out["num_input_tokens"] = np.asarray([self.num_input_tokens], dtype=np.uint32)
            out["num_cached_tokens"] = np.asarray([resp.num_cached_tokens], dtype=np.uint32)
        return out

    def _logprobs_json(self) -> str:
        if self.req.params.logprobs is None:
            return "null"
        return json.dumps(
            [
                {
                    str(token): {"logprob": lp, "rank": rank, "decoded_token": self.tokenizer.decode([token])}
                    for token, (lp, rank) in step.items()
                }
                for step in self._logprobs
            ]
        )
