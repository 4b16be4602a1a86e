"""The fork/join scene of `make demo`: an outline whose items child sequences expand in
parallel, on the instruction-tuned model through its chat template.

The user asks for three facts; the assistant's answer starts as an outline. After each item
the parent emits `<promise>`, which spawns a child sharing the parent's KV; the child is
given the item's opening words ("Waves are") and finishes the sentence itself. At `<sync>`
the parent waits for its children, their sentences are merged into it (one per line), and it
writes a closing sentence. A logits processor forces the outline, the special tokens and the
openings; the sentences and the closing are the model's own.

`<promise>` and `<sync>` are two of SmolLM2's special tokens that a chat never uses
(`<issue_start>`, `<issue_closed>`). To the model a special token right after an item reads
as the item's end (left alone, a child starts the next item: "2. Oceans:"); the forced
opening puts it back on its item. The scene runs on any model with a chat template whose
engine was built with `special_kwargs` naming two such tokens (the tests run it on Gemma 3
too, with its unused tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from loom.engine.llm_engine import LLMEngine
from loom.engine.outputs import RequestOutput
from loom.engine.promise_sync import SpecialKwargs
from loom.errors import LoomError
from loom.loader.resolve import SMOLLM2_135M_INSTRUCT_ALIAS
from loom.sampling_params import SamplingParams
from loom.tokenizer import ChatTemplate

MODEL = SMOLLM2_135M_INSTRUCT_ALIAS
PROMISE, SYNC = "<issue_start>", "<issue_closed>"
QUESTION = "Three facts about the ocean, each explained in one sentence."
ITEMS = ["Waves", "Tides", "Coral reefs"]
CLOSING = "\nIn short,"
CHILD_TOKENS = 32
CLOSING_TOKENS = 24


def fork_join_kwargs(promise: str = PROMISE, sync: str = SYNC) -> SpecialKwargs:
    """The special tokens the demo (and its tests) configure the engine with."""
    return SpecialKwargs(promise_token_id=promise, sync_token_id=sync,
                         child_max_tokens=CHILD_TOKENS)


def opening(item: str) -> str:
    """The words a child's sentence starts with."""
    return f"{item} are"


class OutlineScript:
    """Logits processor: the parent follows `plan` token by token, then writes freely; child k
    (whose context ends with its `<promise>`, the (k+1)-th) follows `openings[k]`, then writes
    one line: after a token holding a newline it ends (`eos_id`). Nobody else emits the
    special tokens. Records the raw logits children see first, to check them against a fresh
    pass."""

    def __init__(
        self,
        plan: list[int],
        openings: list[list[int]],
        promise_id: int,
        sync_id: int,
        eos_id: int,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.plan = plan
        self.openings = openings
        self.promise_id = promise_id
        self.sync_id = sync_id
        self.eos_id = eos_id
        self.decode = decode
        self.child_first_logits: list[tuple[list[int], torch.Tensor]] = []

    def __call__(
        self, prompt: Sequence[int], output: Sequence[int], logits: torch.Tensor
    ) -> torch.Tensor:
        """Force, mask, record."""
        if prompt[-1] == self.promise_id:  # a child
            if not output:
                self.child_first_logits.append((list(prompt), logits.clone()))
            words = self.openings[list(prompt).count(self.promise_id) - 1]
            if len(output) < len(words):
                return _only(words[len(output)], logits)
            if len(output) > len(words) and "\n" in self.decode([output[-1]]):
                return _only(self.eos_id, logits)  # its line ended: so does the child
        elif len(output) < len(self.plan):
            return _only(self.plan[len(output)], logits)
        logits[[self.promise_id, self.sync_id]] = float("-inf")
        return logits


def _only(token_id: int, logits: torch.Tensor) -> torch.Tensor:
    """Logits that allow `token_id` alone."""
    forced = torch.full_like(logits, float("-inf"))
    forced[token_id] = 0.0
    return forced


def _token_id(engine: LLMEngine, token: int | str | None) -> int:
    token_id = engine.tokenizer.token_to_id(token) if isinstance(token, str) else token
    if token_id is None:
        raise LoomError(f"the fork/join scene needs special token {token!r} in the vocabulary")
    return token_id


def make_script(engine: LLMEngine) -> OutlineScript:
    """The plan in token ids: the items with `<promise>` after each, `<sync>`, the closing."""
    special = engine.config.special_kwargs
    if special is None:
        raise LoomError("the fork/join scene needs an engine built with special_kwargs")
    promise = _token_id(engine, special.promise_token_id)
    sync = _token_id(engine, special.sync_token_id)
    encode = engine.tokenizer.encode
    plan: list[int] = []
    for i, item in enumerate(ITEMS):
        plan += encode(("\n" if i else "") + f"{i + 1}. {item}", add_special_tokens=False)
        plan.append(promise)
    plan += encode("\n\n", add_special_tokens=False) + [sync]
    plan += encode(CLOSING, add_special_tokens=False)
    openings = [encode(opening(item), add_special_tokens=False) for item in ITEMS]
    eos = min(engine.eos_token_ids)
    return OutlineScript(plan, openings, promise, sync, eos, engine.tokenizer.decode)


def question_ids(engine: LLMEngine) -> list[int]:
    """The user's question through the model's chat template, the assistant's turn open."""
    config = engine.config
    template = ChatTemplate.from_model(config.model_path, config.tokenizer_path)
    if template is None:
        raise LoomError(f"the fork/join scene needs a chat template; {config.model_path} has "
                        "none")
    return template.render_ids(engine.tokenizer, [{"role": "user", "content": QUESTION}])


def run_fork_join(
    engine: LLMEngine, request_id: str = "outline", close: bool = True
) -> tuple[RequestOutput, OutlineScript]:
    """Run the scene to the end; the session stays open (paused) unless `close`."""
    script = make_script(engine)
    params = SamplingParams(
        temperature=0.0, max_tokens=len(script.plan) + CLOSING_TOKENS,
        logits_processors=[script],
    )
    engine.add_request(request_id, question_ids(engine), params, session=True)
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
    """The question, the assistant's final text, then each child's sentence, indented."""
    print(f"user: {QUESTION}\nassistant:\n{out.outputs[0].text.strip()}\n")
    for i, child in enumerate(out.children):
        text = child.outputs[0].text.strip().replace("\n", " ")
        print(f"  child {i} ({len(child.outputs[0].token_ids)} tokens, shared prefix "
              f"{len(child.prompt_token_ids)} tokens): {text}")
