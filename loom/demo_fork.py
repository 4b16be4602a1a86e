"""The fork/join scene of `make demo`: an outline expanded in parallel by child sequences.

The parent writes an outline; after each item it emits `<promise>` (here Gemma's unused
token `<unused0>`), which spawns a child sharing the parent's KV that expands that item. At
`<sync>` (`<unused1>`) the parent waits for its children, their texts are merged into it, and
it goes on. The outline's structure is forced by a logits processor; the expansions are the
model's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loom.engine.llm_engine import LLMEngine
from loom.engine.outputs import RequestOutput
from loom.engine.promise_sync import SpecialKwargs
from loom.sampling_params import SamplingParams

PROMISE, SYNC = "<unused0>", "<unused1>"
PROMPT = "Three facts about the ocean, each explained in one sentence.\n1. Waves:"
ITEMS = ["\n2. Tides:", "\n3. Coral reefs:"]
CLOSING = "\nIn short,"
CHILD_TOKENS = 14


def fork_join_kwargs() -> SpecialKwargs:
    """The special tokens the demo (and its test) configure the engine with."""
    return SpecialKwargs(
        promise_token_id=PROMISE, sync_token_id=SYNC, child_max_tokens=CHILD_TOKENS
    )


class OutlineScript:
    """Logits processor: the parent follows `plan` token by token, then writes freely; children
    (whose context ends with `<promise>`) always write freely. Nobody else emits the special
    tokens. Records the raw logits children see first, to check them against a fresh pass."""

    def __init__(self, plan: list[int], promise_id: int, sync_id: int) -> None:
        self.plan = plan
        self.special = [promise_id, sync_id]
        self.promise_id = promise_id
        self.child_first_logits: list[tuple[list[int], torch.Tensor]] = []

    def __call__(self, prompt: Sequence[int], output: Sequence[int], logits: torch.Tensor):
        """Force, mask, record."""
        is_child = prompt[-1] == self.promise_id
        if is_child and not output:
            self.child_first_logits.append((list(prompt), logits.clone()))
        if not is_child and len(output) < len(self.plan):
            forced = torch.full_like(logits, float("-inf"))
            forced[self.plan[len(output)]] = 0.0
            return forced
        logits[self.special] = float("-inf")
        return logits


def make_script(engine: LLMEngine) -> OutlineScript:
    """The outline plan in token ids: promise after every item, sync before the closing."""
    tok = engine.tokenizer
    promise, sync = tok.token_to_id(PROMISE), tok.token_to_id(SYNC)
    plan = [promise]
    for item in ITEMS:
        plan += tok.encode(item, add_special_tokens=False) + [promise]
    plan += [sync] + tok.encode(CLOSING, add_special_tokens=False)
    return OutlineScript(plan, promise, sync)


def run_fork_join(
    engine: LLMEngine, request_id: str = "outline", close: bool = True
) -> tuple[RequestOutput, OutlineScript]:
    """Run the scene to the end; the session stays open (paused) unless `close`."""
    script = make_script(engine)
    params = SamplingParams(
        temperature=0.0, max_tokens=len(script.plan) + 16, logits_processors=[script]
    )
    engine.add_request(request_id, PROMPT, params, session=True)
    final: RequestOutput | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                final = out
    assert final is not None
    if close:
        engine.close(request_id)
    return final, script


def print_tree(out: RequestOutput) -> None:
    """The parent's final text, then each child's expansion, indented."""
    print(PROMPT + out.outputs[0].text)
    print()
    for i, child in enumerate(out.children):
        text = child.outputs[0].text.strip().replace("\n", " ")
        print(f"  child {i} ({len(child.outputs[0].token_ids)} tokens, shared prefix "
              f"{len(child.prompt_token_ids)} tokens): {text}")
