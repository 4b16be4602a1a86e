"""Structured output: grammars compiled once, a matcher per sequence, masks per step.

llguidance (a maintained grammar library, no dependencies) turns a constraint (JSON schema,
JSON object, regex, Lark grammar, choice) into a grammar and, per sequence, a matcher that
knows which tokens may come next. Measured on Gemma 3's 262,144-token vocabulary (see
`benchmarks/bench_structured.py` and docs/performance.md), it and xgrammar cost the same per
token; llguidance compiles a schema in about a millisecond, reads Loom's tokenizer as it is
and needs neither transformers nor triton, so it is the one used.

Invariants: a sequence's matcher has consumed exactly the tokens its current segment
generated (drafts are consumed only to compute their rows' masks, then rolled back; a
caller's appended fragment and a hook's appended tokens are never consumed). A row's mask
allows exactly the tokens the matcher accepts next, so a sampled token is never forbidden.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from loom.errors import InvalidRequestError, MissingDependencyError
from loom.kernels.cpu_ops import apply_token_bitmask, use_cpu_kernels
from loom.sampling_params import StructuredOutputsParams
from loom.tokenizer import Tokenizer

logger = logging.getLogger("loom")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as error:  # pragma: no cover - a dependency of the package
        raise MissingDependencyError(
            "structured output needs llguidance: pip install llguidance") from error
    return llguidance


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, key: str) -> None:
        self._matcher = matcher
        self.key = key  # the constraint it follows (StructuredOutputsParams.key)
        # Positions (in the sequence's tokens) of the tokens consumed, in order, and the
        # tokens: a cut of the sequence rolls back exactly the consumed tokens it drops.
        self.positions: list[int] = []
        self.tokens: list[int] = []

    @property
    def num_consumed(self) -> int:
        """Tokens consumed so far."""
        return len(self.positions)

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (a forked child's)."""
        twin = GrammarMatcher(self._matcher.deep_copy(), self.key)
        twin.positions = list(self.positions)
        twin.tokens = list(self.tokens)
        return twin

    def accepts(self, token_id: int) -> bool:
        """Whether the grammar allows `token_id` next (nothing changes)."""
        return self._matcher.validate_tokens([token_id]) == 1

    def consume(self, token_id: int, position: int) -> bool:
        """Advance past `token_id`, the sequence's token at `position`; False (and an error
        state) when it was forbidden."""
        ok = self._matcher.consume_token(token_id)
        if ok:
            self.positions.append(position)
            self.tokens.append(token_id)
        return ok

    def continues(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens ends where this document stands: nothing
        consumed yet, or its last consumed token is the sequence's last (no fragment was
        appended after it), so a new segment under the same constraint may go on with it."""
        return not self.positions or self.positions[-1] == num_tokens - 1

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` consumed tokens."""
        num_tokens = min(num_tokens, self.num_consumed)
        if not num_tokens:
            return
        del self.positions[-num_tokens:]
        del self.tokens[-num_tokens:]
        if self._matcher.is_stopped():
            # Past its end the library's rollback does not land where it started (llguidance
            # 1.9.1 lands tokens off): start over and consume the kept tokens again.
            self._matcher.reset()
            for token in self.tokens:
                self._matcher.consume_token(token)
        else:
            self._matcher.rollback(num_tokens)

    def cut(self, num_tokens: int) -> None:
        """The sequence keeps only its first `num_tokens` tokens: forget those consumed past
        that."""
        dropped = 0
        while dropped < len(self.positions) and self.positions[-1 - dropped] >= num_tokens:
            dropped += 1
        self.rollback(dropped)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (only the end of the output)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher failed, or None."""
        return self._matcher.get_error() if self._matcher.is_error() else None

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed-next bitmask (int32 words, bit i of word w: token 32w + i)."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


class StructuredOutputs:
    """Compiles constraints (cached by their text) and makes matchers; owns the grammar
    library's view of the tokenizer, built on first use (about 2 s for 262k tokens)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._grammars: dict[str, str] = {}
        self._executor: Any = None
        self._prefetcher: ThreadPoolExecutor | None = None

    def _lltok(self) -> Any:
        if self._ll_tokenizer is None:
            llg = _llguidance()
            self._ll_tokenizer = llg.LLTokenizer(
                self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                eos_token=sorted(self.tokenizer.eos_token_ids))
        return self._ll_tokenizer

    def compile(self, owner: str, params: StructuredOutputsParams) -> str:
        """The grammar of a constraint; an `InvalidRequestError` naming the problem when the
        schema, regex or grammar is invalid."""
        key = params.key
        grammar = self._grammars.get(key)
        if grammar is not None:
            return grammar
        llg = _llguidance()
        try:
            grammar = _grammar_text(llg, params)
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(
                f"request {owner!r}: invalid structured_outputs: {error}") from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self._lltok())
        if is_error:
            detail = "; ".join(messages) or "the grammar library refused it"
            raise InvalidRequestError(
                f"request {owner!r}: invalid structured_outputs ({_kind(params)}): {detail}")
        if len(self._grammars) > 256:
            self._grammars.clear()
        self._grammars[key] = grammar
        return grammar

    def matcher(self, owner: str, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of the constraint's language."""
        llg = _llguidance()
        matcher = llg.LLMatcher(self._lltok(), self.compile(owner, params), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"request {owner!r}: invalid structured_outputs: {matcher.get_error()}")
        return GrammarMatcher(matcher, params.key)

    def compute_masks(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """The allowed-next bitmasks [len(matchers), ceil(V / 32)] int32 of the matchers in
        their current states; several are computed in parallel on the library's threads."""
        words = (self.vocab_size + 31) // 32
        bits = torch.full((len(matchers), words), -1, dtype=torch.int32)
        if len(matchers) == 1:
            matchers[0].fill_mask(bits[0])
        elif matchers:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(m._matcher, i) for i, m in enumerate(matchers)], bits.data_ptr(),
                words * 4, len(matchers))
        return bits

    def start_masks(self, matchers: Sequence[GrammarMatcher]) -> Future[torch.Tensor]:
        """`compute_masks` on a background thread (the library releases the GIL): started
        before a step's forward, its masks are ready when the logits are. The matchers must
        not change until the result is taken."""
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="loom-grammar")
        return self._prefetcher.submit(self.compute_masks, list(matchers))

    def apply_masks(self, logits: torch.Tensor, masks: Sequence[tuple[int, GrammarMatcher]],
                    ready: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Mask, in place, the rows in `masks` (row index, matcher in the state for that row)
        to what the grammar accepts next; returns `logits`. `ready`: masks already computed,
        by matcher id. Rows a step computes for a session's stored logits are overwritten by
        the next step's unconstrained row before anything reads them (a segment's end
        computes the pending token)."""
        ready = ready or {}
        todo = [m for _, m in masks if id(m) not in ready]
        computed = dict(zip((id(m) for m in todo), self.compute_masks(todo), strict=True))
        bits = torch.stack([ready[id(m)] if id(m) in ready else computed[id(m)]
                            for _, m in masks])
        rows = torch.tensor([r for r, _ in masks], dtype=torch.int64)
        if use_cpu_kernels(logits) and logits.is_contiguous():
            apply_token_bitmask(logits, rows, bits)
            return logits
        allowed = _BIT_TABLE[bits.view(torch.uint8).view(len(masks), -1).long()]
        forbidden = ~allowed.view(len(masks), -1)[:, : logits.shape[1]].to(logits.device)
        index = rows.to(logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
        return logits


# Bit b of byte value v, for unpacking masks without the CPU kernels (little-endian words).
_BIT_TABLE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.bool)


def _kind(params: StructuredOutputsParams) -> str:
    for name in ("json", "regex", "grammar", "choice"):
        if getattr(params, name) is not None:
            return name
    return "json_object"


def _grammar_text(llg: Any, params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (raises ValueError / TypeError when bad)."""
    options = {"whitespace_flexible": params.whitespace_flexible}
    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not JSON: {error}") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be an object")
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    if params.regex is not None:
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if params.grammar is not None:
        return llg.LLMatcher.grammar_from_lark(params.grammar)
    assert params.choice is not None
    alternatives = " | ".join(json.dumps(c) for c in params.choice)
    return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
