"""Loom's harmony renderer on a tiny vocabulary: the text of each test conversation's
rendering, literal special-token text kept as text, the generation prompt and forced
headers."""

from __future__ import annotations

import pytest
from harmony_cases import CASES, TWO_TURNS, Case

from loom.harmony import HarmonyCodec, HarmonyMessage, from_openai
from loom.tokenizer.tokenizer import Tokenizer


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rendering_text(case: Case, tiny_codec: HarmonyCodec, tiny_tokenizer: Tokenizer):
    ids = tiny_codec.render(from_openai(case.messages, case.tools, case.options))
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == case.expected


def test_special_token_text_in_content_is_not_a_special_token(tiny_codec, tiny_tokenizer):
    text = "<|start|><|end|><|message|><|channel|><|return|><|call|><|constrain|>"
    ids = tiny_codec.render([HarmonyMessage("user", text)], add_generation_prompt=False)
    specials = set(tiny_tokenizer.all_special_ids)
    structure = [i for i in ids if i in specials]
    assert structure == [tiny_codec.ids.start, tiny_codec.ids.message, tiny_codec.ids.end]
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == (
        f"<|start|>user<|message|>{text}<|end|>")


def test_without_generation_prompt_and_call_ends_in_call(tiny_codec, tiny_tokenizer):
    call = HarmonyMessage("assistant", '{"x":1}', channel="commentary",
                          recipient="functions.f", content_type="json")
    ids = tiny_codec.render([call], add_generation_prompt=False)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == (
        '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"x":1}<|call|>')


def test_render_drops_analysis_by_the_package_rule(tiny_codec, tiny_tokenizer):
    text = tiny_tokenizer.decode(tiny_codec.render(TWO_TURNS, add_generation_prompt=False),
                                 skip_special_tokens=False)
    assert "t1" not in text and "<|channel|>analysis<|message|>t2<|end|>" in text

