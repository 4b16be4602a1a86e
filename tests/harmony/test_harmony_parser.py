"""Loom's harmony parser on a tiny vocabulary: crafted outputs, fed a token at a time and
in odd chunks, read into the right events; malformed outputs never raise."""

from __future__ import annotations

import pytest

from loom.harmony import ContentDelta, HarmonyCodec, HarmonyEvent, Header, MessageDone
from loom.tokenizer.tokenizer import Tokenizer

SNOW = "☃"  # three bytes the tiny vocabulary spells with more than one token


def _parse(codec: HarmonyCodec, ids: list[int], chunk: int,
           start: Header | None = None) -> list[HarmonyEvent]:
    parser = codec.parser(start)
    events: list[HarmonyEvent] = []
    for at in range(0, len(ids), chunk):
        events += parser.feed(ids[at:at + chunk])
    return events + parser.finish()


def _messages(events: list[HarmonyEvent]) -> list[tuple]:
    """(channel, recipient, content_type, text, end) of each message; asserts that its
    deltas add up to its text."""
    out, text = [], ""
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            text += event.text
        else:
            assert event.text == text
            out.append((event.channel, event.recipient, event.content_type, event.text,
                        event.end))
            text = ""
    assert text == ""
    return out


def _read(codec: HarmonyCodec, tokenizer: Tokenizer, text: str, drop_last: int = 0,
          start: Header | None = None) -> list[tuple]:
    """The messages of `text`'s tokens (less the last `drop_last`), the same whether fed
    a token at a time or in chunks."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids[:len(ids) - drop_last]
    events = _parse(codec, ids, 1, start)
    for chunk in (2, 3, 5, len(ids) or 1):
        assert _parse(codec, ids, chunk, start) == events
    return _messages(events)


def test_analysis_then_final(tiny_codec, tiny_tokenizer):
    text = ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant"
            "<|channel|>final<|message|>2 + 2 = 4.<|return|>")
    assert _read(tiny_codec, tiny_tokenizer, text) == [
        ("analysis", None, None, "User asks 2+2. Easy.", "end"),
        ("final", None, None, "2 + 2 = 4.", "return")]


def test_tool_call_with_constrained_json(tiny_codec, tiny_tokenizer):
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"location":"Tokyo"}<|call|>')
    assert _read(tiny_codec, tiny_tokenizer, text)[1] == (
        "commentary", "functions.get_weather", "<|constrain|>json", '{"location":"Tokyo"}',
        "call")


@pytest.mark.parametrize(("header", "expected"), [
    (" to=functions.f<|channel|>commentary json", ("commentary", "functions.f", "json")),
    (" to=functions.f<|channel|>commentary <|constrain|>json",
     ("commentary", "functions.f", "<|constrain|>json")),
    ("<|channel|>commentary to=functions.f<|constrain|>json",
     ("commentary", "functions.f", "<|constrain|>json")),
    ("<|channel|>commentary to=functions.f", ("commentary", "functions.f", None)),
    ("<|channel|>final", ("final", None, None)),
])
def test_header_forms(header, expected, tiny_codec, tiny_tokenizer):
    text = f"<|channel|>analysis<|message|>a<|end|><|start|>assistant{header}<|message|>x<|call|>"
    assert _read(tiny_codec, tiny_tokenizer, text)[1] == (*expected, "x", "call")
    first = f"{header}<|message|>x<|call|>".lstrip()
    assert _read(tiny_codec, tiny_tokenizer, first) == [(*expected, "x", "call")]


def test_a_character_split_across_tokens_comes_whole(tiny_codec, tiny_tokenizer):
    assert len(tiny_tokenizer.encode(SNOW, add_special_tokens=False)) > 1
    ids = tiny_tokenizer.encode(f"<|channel|>final<|message|>a{SNOW}b<|return|>",
                                add_special_tokens=False)
    parser = tiny_codec.parser()
    deltas = [[e.text for e in parser.feed([t]) if isinstance(e, ContentDelta)] for t in ids]
    assert [d for d in deltas if d] == [["a"], [SNOW], ["b"]]


def test_output_cut_mid_message_and_mid_character(tiny_codec, tiny_tokenizer):
    text = f"<|channel|>analysis<|message|>Thinking{SNOW}"
    assert _read(tiny_codec, tiny_tokenizer, text) == [
        ("analysis", None, None, f"Thinking{SNOW}", None)]
    assert _read(tiny_codec, tiny_tokenizer, text, drop_last=1) == [
        ("analysis", None, None, "Thinking\ufffd", None)]


def test_text_without_structure_is_content_without_a_channel(tiny_codec, tiny_tokenizer):
    assert _read(tiny_codec, tiny_tokenizer, "Just some text.") == [
        (None, None, None, "Just some text.", None)]
    text = "<|channel|>final<|message|>a<|end|>stray text<|start|>assistant<|channel|>final" \
           "<|message|>b<|return|>"
    assert _read(tiny_codec, tiny_tokenizer, text) == [
        ("final", None, None, "a", "end"), (None, None, None, "stray text", None),
        ("final", None, None, "b", "return")]


def test_malformed_headers_are_content(tiny_codec, tiny_tokenizer):
    bad = "<|channel|>final<|message|>a<|end|><|start|>assistant what is this<|message|>b<|end|>"
    assert _read(tiny_codec, tiny_tokenizer, bad)[1] == (
        None, None, None, "<|start|>assistant what is this<|message|>b", "end")
    assert _read(tiny_codec, tiny_tokenizer, "<|channel|><|message|>x<|return|>") == [
        (None, None, None, "<|channel|><|message|>x", "return")]
    assert _read(tiny_codec, tiny_tokenizer, "<|channel|>final<|return|>") == [
        (None, None, None, "<|channel|>final", "return")]


def test_unterminated_header_at_the_end_is_content(tiny_codec, tiny_tokenizer):
    text = "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>fin"
    assert _read(tiny_codec, tiny_tokenizer, text)[1] == (
        None, None, None, "<|start|>assistant<|channel|>fin", None)


def test_end_tokens_outside_messages_are_dropped(tiny_codec, tiny_tokenizer):
    text = "<|channel|>final<|message|>a<|end|><|end|><|return|>"
    assert _read(tiny_codec, tiny_tokenizer, text) == [("final", None, None, "a", "end")]
    assert _read(tiny_codec, tiny_tokenizer, "<|return|>") == []
    assert _read(tiny_codec, tiny_tokenizer, "") == []


def test_special_tokens_inside_content_are_text(tiny_codec, tiny_tokenizer):
    text = "<|channel|>final<|message|>say <|start|> and <|channel|><|return|>"
    assert _read(tiny_codec, tiny_tokenizer, text) == [
        ("final", None, None, "say <|start|> and <|channel|>", "return")]


def test_parser_started_inside_a_forced_header(tiny_codec, tiny_tokenizer):
    start = Header("commentary", "functions.get_weather", "<|constrain|>json")
    assert _read(tiny_codec, tiny_tokenizer, '{"location":"Oslo"}<|call|>', start=start) == [
        ("commentary", "functions.get_weather", "<|constrain|>json", '{"location":"Oslo"}',
         "call")]
    assert _read(tiny_codec, tiny_tokenizer, '{"loc', start=start) == [
        ("commentary", "functions.get_weather", "<|constrain|>json", '{"loc', None)]


def test_random_tokens_never_raise(tiny_codec, tiny_tokenizer):
    import random

    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tiny_tokenizer.vocab_size + 3) for _ in range(rng.randrange(40))]
        _messages(_parse(tiny_codec, ids, rng.randrange(1, 6)))


def test_events_carry_the_header(tiny_codec, tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|channel|>commentary to=functions.f json<|message|>ab<|call|>",
                                add_special_tokens=False)
    events = _parse(tiny_codec, ids, 1)
    assert events[0] == ContentDelta("commentary", "functions.f", "json", events[0].text)
    assert events[-1] == MessageDone("commentary", "functions.f", "json", "ab", "call")
