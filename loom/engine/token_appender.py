"""`TokenAppender`: sample a step's logits rows and append the tokens to their sequences.

Every sampled token goes through the same path (hooks, detokenizer, stop checks), whether
it came from a plain decode, a session's `resume` from stored logits or a verified
speculative draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch

from loom.core.request import RequestStatus
from loom.core.scheduler_output import ScheduledChunk
from loom.engine.hooks import HookContext, SequenceHook
from loom.engine.sequence import SequenceState
from loom.engine.sequence_table import SequenceTable
from loom.engine.speculation import Speculator, kept_tokens
from loom.engine.stop_conditions import check_stop
from loom.engine.structured_output import GrammarMatcher
from loom.sample import Sampler, SamplerOutput, SamplingRow, is_greedy
from loom.sample.draw import skip_uniforms
from loom.sampling_params import SamplingParams


class TokenAppender:
    """Turns logits rows into tokens on their sequences (through the sequence table)."""

    def __init__(
        self,
        table: SequenceTable,
        eos_token_ids: set[int],
        hooks: Sequence[SequenceHook] = (),
        hook_context: HookContext | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.table = table
        self.scheduler = table.scheduler
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids
        self.hooks = list(hooks)
        self.hook_context = hook_context or HookContext(table)
        self.speculator = speculator
        self.max_model_len = table.max_model_len
        # Whether `start_masks` computes masks during the forward. Off on a CPU: the forward
        # already uses every core there, and a grammar thread beside it made a 16-row
        # constrained step 1.2x slower than computing the masks after it (bench_structured);
        # on a GPU the host is idle while the model runs.
        self.early_masks = False
        # Masks started before the step's forward (see `start_masks`): the future and the
        # matchers it covers.
        self._early_masks: tuple[Future[torch.Tensor], list[GrammarMatcher]] | None = None
        # Groups whose hook raised (group id -> why) since the last `take_hook_failures`.
        self.hook_failures: dict[str, str] = {}

    def run_hooks_finished(self, seq_id: str) -> None:
        """Tell the hooks a sequence finished; a hook that raises fails only its request."""
        seq = self.table.get(seq_id)
        try:
            for hook in self.hooks:
                hook.on_finished(self.hook_context, seq_id)
        except Exception as error:
            if seq is not None:
                self._hook_failed(seq, error)

    def _hook_failed(self, seq: SequenceState, error: Exception) -> None:
        self.hook_failures.setdefault(
            seq.group_id,
            f"a hook of request {seq.group_id!r} raised {type(error).__name__}: {error}",
        )

    def take_hook_failures(self) -> dict[str, str]:
        """Groups whose hook raised since the last take (group id -> why)."""
        failures, self.hook_failures = self.hook_failures, {}
        return failures

    def sample_and_append(
        self,
        seqs: list[SequenceState],
        logits: torch.Tensor,
        drafts: list[list[int]] | None = None,
    ) -> dict[str, str]:
        """Sample each sequence's next token(s) and advance it; returns the groups whose
        logits processor raised (group id -> why). Those sequences take no token: a session's
        segment ends (it stays paused, its logits kept for `resample` or another `resume`),
        any other request is for the caller to fail.

        Sequence i owns 1 + len(drafts[i]) consecutive logits rows: the row after its last
        token, then one after each draft (speculative decoding, see `engine/speculation.py`).
        """
        drafts = drafts or [[] for _ in seqs]
        rows: list[SamplingRow] = []
        for seq, draft in zip(seqs, drafts, strict=True):
            # Copying the prompt costs O(context): only for the rows that read it.
            prompt = seq.prompt_token_ids if _reads_prompt(seq.params) else []
            for i in range(len(draft) + 1):
                history = seq.segment_token_ids + draft[:i] if i else seq.segment_token_ids
                rows.append(
                    SamplingRow(seq.params, prompt, history, seq.generator, self.eos_token_ids)
                )
        logits = self._constrain(seqs, drafts, logits)
        # A drafted sequence's generator draws once per row; rewound to the kept rows below.
        saved = [
            s.generator.get_state() if d and s.generator is not None and not is_greedy(s.params)
            else None
            for s, d in zip(seqs, drafts, strict=True)
        ]
        result = self.sampler(logits, rows)
        failed: dict[str, str] = {}
        first_row = 0
        for seq, draft, state in zip(seqs, drafts, saved, strict=True):
            num_rows = len(draft) + 1
            error = next((result.row_errors[r] for r in range(first_row, first_row + num_rows)
                          if r in result.row_errors), None)
            if error is not None:
                failed.setdefault(seq.group_id, f"a logits processor of request "
                                  f"{seq.group_id!r} raised {type(error).__name__}: {error}")
                if seq.is_session:
                    self._pause_failed_segment(seq, len(draft), logits[first_row])
                first_row += num_rows
                continue
            tokens = kept_tokens(result.token_ids[first_row : first_row + num_rows], draft)
            used = self._advance(seq, tokens, len(draft), logits, result, first_row)
            if draft and self.speculator is not None:
                self.speculator.observe(seq, len(draft), len(tokens) - 1)
            if state is not None and used < num_rows:
                seq.generator.set_state(state)
                skip_uniforms(seq.generator, used)
            if draft and seq.request_id in self.scheduler.requests:
                # Blocks that only held rejected drafts go back to the pool.
                self.table.drop_drafts(seq)
            first_row += num_rows
        for group, why in self.take_hook_failures().items():
            failed.setdefault(group, why)
        return failed

    def start_masks(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Before a step's forward: start computing the masks of the constrained sequences
        that will sample from it without drafts (their matchers do not move until then), so
        the grammar works while the model does."""
        structured = self.table.structured
        if structured is None or not self.early_masks:
            return
        matchers = []
        for chunk in chunks:
            seq = self.table.get(chunk.request_id)
            if (chunk.needs_logits and not chunk.num_draft_tokens and seq is not None
                    and seq.generating and seq.grammar is not None):
                matchers.append(seq.grammar)
        if matchers:
            self._early_masks = (structured.start_masks(matchers), matchers)

    def drop_early_masks(self) -> None:
        """Forget masks started for a step that did not run (its forward raised)."""
        if self._early_masks is not None:
            self._early_masks[0].result()  # the matchers must not be in use when we go on
            self._early_masks = None

    def _take_early_masks(self) -> dict[int, torch.Tensor]:
        if self._early_masks is None:
            return {}
        future, matchers = self._early_masks
        self._early_masks = None
        bits = future.result()
        return {id(m): bits[i] for i, m in enumerate(matchers)}

    def _constrain(self, seqs: list[SequenceState], drafts: list[list[int]],
                   logits: torch.Tensor) -> torch.Tensor:
        """Mask, in place, the rows of constrained sequences to what their grammar accepts
        next (with the masks started during the forward, where there are any). Row i of a
        drafted sequence follows its first i drafts: they are consumed to compute its mask
        and rolled back after; rows after a draft the grammar forbids keep no mask
        (verification never keeps them: the row before cannot sample that draft)."""
        structured = self.table.structured
        ready = self._take_early_masks()
        if structured is None or not any(seq.grammar is not None for seq in seqs):
            return logits
        masks = []
        first_row = 0
        for seq, draft in zip(seqs, drafts, strict=True):
            grammar = seq.grammar
            if grammar is not None:
                masks.append((first_row, grammar))
                consumed = 0
                position = seq.request.num_tokens - len(draft)
                for i, token in enumerate(draft):
                    # A refused consume would leave the matcher in an error state: ask first.
                    if not grammar.accepts(token) or not grammar.consume(token, position + i):
                        break
                    consumed += 1
                    masks.append((first_row + i + 1, grammar.copy()))
                grammar.rollback(consumed)
            first_row += len(draft) + 1
        return structured.apply_masks(logits, masks, ready)

    def _pause_failed_segment(
        self, seq: SequenceState, num_drafts: int, logits_row: torch.Tensor
    ) -> None:
        """End a session's segment whose logits processor raised: its drafts are dropped, it
        takes no token and stays paused with `logits_row` (for `resample` or a `resume`)."""
        if num_drafts:
            self.table.drop_drafts(seq, num_drafts)
        self.table.end_segment(seq, RequestStatus.FINISHED_ERROR)
        # Every token is computed (the step that produced these logits did it).
        self.table.pause(seq, logits_row)

    def _advance(
        self,
        seq: SequenceState,
        tokens: list[int],
        num_drafts: int,
        logits: torch.Tensor,
        result: SamplerOutput,
        first_row: int,
    ) -> int:
        """Append sampled tokens one by one (hooks, detokenizer, stop checks) until the
        segment stops or the sequence blocks; returns how many were taken.

        While token j is handled the request reads exactly as if plain decoding had just
        sampled it: `... p t0 .. t(j-1) | tj` with tj uncomputed; t0 .. t(j-1) equal the
        drafts d1 .. dj, whose K/V this step already wrote.
        """
        request = seq.request
        first = request.num_tokens - num_drafts  # tokens up to p, the one before the drafts
        if num_drafts:
            request.truncate(first)
        for j, token_id in enumerate(tokens):
            if j:
                request.advance_frontier(first + j)
            request.append_tokens([token_id])
            if seq.is_session:
                seq.last_logits = logits[first_row + j].clone()
            # The grammar follows the token before hooks run: a child forked now copies it.
            grammar_done = self._follow_grammar(seq, token_id, first + j)
            hook_error = None
            try:
                for hook in self.hooks:
                    hook.on_token(self.hook_context, seq.request_id, token_id)
            except Exception as error:  # a user's hook: only its request fails
                hook_error = error
            top = result.top_logprobs[first_row + j]
            seq.add_generated(token_id, result.logprobs[first_row + j], dict(top) if top else None)
            if hook_error is not None:
                self._hook_failed(seq, hook_error)
                self.table.end_segment(seq, RequestStatus.FINISHED_ERROR)
                return j + 1
            if seq.finish_requested:
                self.table.end_segment(seq, RequestStatus.FINISHED_STOPPED, token_id)
                return j + 1
            stop = check_stop(seq, token_id, self.eos_token_ids, self.max_model_len)
            if stop is None and grammar_done:  # the document is complete: nothing may follow
                stop = RequestStatus.FINISHED_STOPPED, None
            if stop is not None:
                self.table.end_segment(seq, *stop)
                return j + 1
            if seq.blocked and not request.is_finished:
                self.table.block(seq)
                return j + 1
            if request.is_finished:
                return j + 1
        return len(tokens)


    def _follow_grammar(self, seq: SequenceState, token_id: int, position: int) -> bool:
        """Advance a constrained sequence's matcher past its new token; True when the
        grammar is then complete."""
        grammar = seq.grammar
        if grammar is None:
            return False
        if not grammar.consume(token_id, position):
            # Cannot happen (the token was sampled under the grammar's mask); if the library
            # disagrees, the constraint stops here rather than emit more unchecked tokens.
            return True
        return grammar.is_finished


def _reads_prompt(params: SamplingParams) -> bool:
    """True when sampling looks at the prompt: repetition penalty or logits processors."""
    return params.repetition_penalty != 1.0 or bool(params.logits_processors)
