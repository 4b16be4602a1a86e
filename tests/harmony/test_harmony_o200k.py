"""The harmony format on gpt-oss's real vocabulary (o200k_harmony), against the
openai-harmony package: the codec picks the package, the vocabulary file Loom writes is
o200k's, Loom's own renderer gives the package's token ids on every test conversation,
and both parsers give the same events (and the package's own parser's messages).

Needs o200k's vocabulary file (`o200k_base.tiktoken`, not shipped with the tests): at
$LOOM_O200K_VOCAB, else in Loom's cache dir under `o200k/`. The tokenizer is built from it
as a GGUF of gpt-oss carries it (byte-level tokens, merges, the `gpt-4o` split rule, the
special tokens as control tokens) through Loom's GGUF tokenizer path, once per module."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
from harmony_cases import CASES, SCHEMA_ZOO, TWO_TURNS, WEATHER, Case

from loom.cache_dir import loom_cache_dir
from loom.harmony import (
    ContentDelta,
    HarmonyCodec,
    HarmonyEvent,
    HarmonyMessage,
    Header,
    MessageDone,
    from_openai,
)
from loom.harmony.conversation import developer_text
from loom.harmony.package import ENCODINGS_BASE_VAR, PackageReader, load_encoding
from loom.harmony.vocab import O200K_SHA256, VOCAB_FILE
from loom.tokenizer.gguf_tokenizer import byte_alphabet, derive_merges, tokenizer_from_gguf_metadata
from loom.tokenizer.tokenizer import Tokenizer

VOCAB = Path(os.environ.get("LOOM_O200K_VOCAB") or loom_cache_dir("o200k") / VOCAB_FILE)
pytestmark = pytest.mark.skipif(
    not VOCAB.is_file(), reason=f"o200k's vocabulary file is not at {VOCAB} (set "
    "LOOM_O200K_VOCAB to an o200k_base.tiktoken)")
openai_harmony = pytest.importorskip("openai_harmony")

# o200k_harmony's named special tokens; every other id from 199998 on is <|reserved_ID|>.
_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
          200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>",
          200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}


@pytest.fixture(scope="module")
def o200k_tokenizer() -> Tokenizer:
    """A Loom tokenizer of o200k_harmony's 201088 ids, built as from a gpt-oss GGUF."""
    alphabet = byte_alphabet()
    tokens = []
    for line in VOCAB.read_bytes().splitlines():
        data, rank = line.split()
        assert int(rank) == len(tokens)
        tokens.append("".join(alphabet[b] for b in base64.b64decode(data)))
    merges = derive_merges(dict(zip(tokens, range(len(tokens)), strict=True)),
                           {t: -float(i) for i, t in enumerate(tokens)})
    specials = [_NAMED.get(i, f"<|reserved_{i}|>") for i in range(len(tokens), 201088)]
    backend, config = tokenizer_from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens + specials,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.token_type": [1] * len(tokens) + [3] * len(specials)})
    return Tokenizer(backend, config)


@pytest.fixture(scope="module")
def codecs(o200k_tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Any]:
    """The package's codec and Loom's own, with the cache dir they wrote to and the
    TIKTOKEN_ENCODINGS_BASE value set before (and, the test checks, after) loading."""
    cache = tmp_path_factory.mktemp("loom-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOM_CACHE_DIR", str(cache))
        mp.setenv(ENCODINGS_BASE_VAR, "/elsewhere")
        package = HarmonyCodec.for_tokenizer(o200k_tokenizer)
        after = os.environ.get(ENCODINGS_BASE_VAR)
    own = HarmonyCodec.for_tokenizer(o200k_tokenizer, use_package=False)
    encoding = load_encoding(str(cache / "harmony"))
    return {"package": package, "own": own, "cache": cache, "env_after": after,
            "encoding": encoding}


def test_codec_picks_the_package_and_restores_the_environment(codecs):
    assert codecs["package"].backend == "openai-harmony"
    assert codecs["package"].fallback_reason is None
    assert codecs["own"].backend == "loom"
    assert codecs["env_after"] == "/elsewhere"
    assert codecs["package"].stop_token_ids == (200002, 200012)


def test_written_vocabulary_file_is_o200k(codecs):
    written = (codecs["cache"] / "harmony" / VOCAB_FILE).read_bytes()
    assert hashlib.sha256(written).hexdigest() == O200K_SHA256
    assert written == VOCAB.read_bytes()


def _package_reference(case: Case) -> list[Any]:
    """The conversation as the package itself builds its opening messages (SystemContent,
    DeveloperContent with its tools), the rest as `from_openai` maps them."""
    h = openai_harmony
    options = case.options
    system = h.SystemContent.new().with_reasoning_effort(
        h.ReasoningEffort[options.reasoning_effort.upper()])
    if options.conversation_start_date:
        system = system.with_conversation_start_date(options.conversation_start_date)
    out = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    instructions = [m["content"] for m in case.messages
                    if m["role"] in ("system", "developer") and m["content"]]
    developer = h.DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions("\n\n".join(instructions))
    if case.tools:
        developer = developer.with_function_tools([
            h.ToolDescription.new(t.name, t.description, t.parameters) for t in case.tools])
    if instructions or case.tools:
        out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    rest = [m for m in from_openai(case.messages, case.tools, case.options)
            if m.role not in ("system", "developer")]
    return out + _package_messages(rest)


def _package_messages(messages: list[HarmonyMessage]) -> list[Any]:
    h = openai_harmony
    return [h.Message(author=h.Author(role=h.Role(m.role), name=m.author_name),
                      content=[h.TextContent(text=m.content)], channel=m.channel,
                      recipient=m.recipient, content_type=m.content_type) for m in messages]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_own_renderer_gives_the_package_ids(case: Case, codecs):
    encoding = codecs["encoding"]
    expected = encoding.render_conversation_for_completion(
        openai_harmony.Conversation.from_messages(_package_reference(case)),
        openai_harmony.Role.ASSISTANT)
    messages = from_openai(case.messages, case.tools, case.options)
    assert codecs["own"].render(messages) == expected
    assert codecs["package"].render(messages) == expected
    assert encoding.decode_utf8(expected) == case.expected


def test_tools_text_equals_the_packages(codecs):
    h = openai_harmony
    tools = [*SCHEMA_ZOO, WEATHER]
    developer = h.DeveloperContent.new().with_instructions("Be exact.").with_function_tools(
        [h.ToolDescription.new(t.name, t.description, t.parameters) for t in tools])
    expected = codecs["encoding"].render(h.Message.from_role_and_content(h.Role.DEVELOPER,
                                                                         developer))
    ours = HarmonyMessage("developer", developer_text("Be exact.", tools))
    for codec in (codecs["own"], codecs["package"]):
        assert codec.render([ours], add_generation_prompt=False) == expected


_RAW = TWO_TURNS
_ONGOING = [*_RAW[:5], HarmonyMessage("assistant", "{}", channel="commentary",
                                      recipient="functions.f", content_type="json")]


@pytest.mark.parametrize("messages", [_RAW, _RAW[:3], _ONGOING, _RAW[:2]],
                         ids=["between_finals", "one_turn", "ongoing_call", "no_final"])
@pytest.mark.parametrize("prompt", [True, False])
def test_dropping_rule_equals_the_packages(messages, prompt, codecs):
    conversation = openai_harmony.Conversation.from_messages(_package_messages(messages))
    encoding = codecs["encoding"]
    expected = (encoding.render_conversation_for_completion(
        conversation, openai_harmony.Role.ASSISTANT) if prompt
        else encoding.render_conversation(conversation))
    for codec in (codecs["own"], codecs["package"]):
        assert codec.render(messages, add_generation_prompt=prompt) == expected


OUTPUTS = {
    "analysis_then_final": "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
                           "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4 🌦️<|return|>",
    "tool_call": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                 "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                 '{"location":"東京"}<|call|>',
    "recipient_first": "<|channel|>analysis<|message|>x<|end|><|start|>assistant "
                       "to=functions.get_weather<|channel|>commentary json<|message|>{}<|call|>",
    "constrain_glued": "<|channel|>commentary to=functions.ping<|constrain|>json<|message|>"
                       "{}<|call|>",
    "preamble": "<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>"
                "commentary<|message|>**Plan**: ping twice.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.ping <|constrain|>json<|message|>{}<|call|>",
    "truncated": "<|channel|>analysis<|message|>Weather 🌦️",  # cut inside the emoji
    "empty_final": "<|channel|>final<|message|><|return|>",
}
MALFORMED = {
    "garbage_first": "Hello there<|end|>more<|start|>assistant<|channel|>final<|message|>ok"
                     "<|return|>",
    "bad_header": "<|channel|>analysis<|message|>a<|end|><|start|>assistant what is this"
                  "<|message|>text<|end|>",
    "empty_channel": "<|channel|><|message|>x<|return|>",
    "cut_in_header": "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>fin",
    "end_in_header": "<|channel|>final<|end|><|start|>assistant<|channel|>final<|message|>y",
    "no_header": "<|message|>hi<|return|>",
    "empty_later_header": "<|channel|>final<|message|>a<|end|><|start|><|message|>b<|end|>",
    "unknown_role": "<|channel|>final<|message|>a<|end|><|start|>robot<|message|>b<|end|>",
    "tool_author": "<|channel|>final<|message|>a<|end|><|start|>functions.x to=assistant"
                   "<|channel|>commentary<|message|>r<|end|>",
    "start_in_first_header": "<|start|>assistant<|channel|>final<|message|>a<|return|>",
    "invalid_utf8_header": "<|start|>assistant<|channel|>final \udcff<|message|>a<|end|>",
}


def _parse(codec: HarmonyCodec, ids: list[int], chunk: int) -> list[HarmonyEvent]:
    parser = codec.parser()
    events: list[HarmonyEvent] = []
    for at in range(0, len(ids), chunk):
        events += parser.feed(ids[at:at + chunk])
    return events + parser.finish()


def _ids(codecs, text: str) -> list[int]:
    """`text`'s tokens; the truncated output's lose the emoji's last two tokens, so that
    it ends inside the emoji's bytes."""
    if "\udcff" in text:  # token 255 stands for the lone byte 0xAD: not UTF-8
        before, after = text.split("\udcff")
        encode = codecs["encoding"].encode
        return [*encode(before, allowed_special="all"), 255, *encode(after, allowed_special="all")]
    ids = codecs["encoding"].encode(text, allowed_special="all")
    if text == OUTPUTS["truncated"]:
        ids = ids[:-2]
        assert PackageReader(codecs["encoding"]).token_bytes(ids[-1]) == b" \xf0\x9f\x8c"
    return ids


@pytest.mark.parametrize("name", sorted(OUTPUTS) + sorted(MALFORMED))
def test_both_parsers_give_the_same_events(name, codecs):
    ids = _ids(codecs, OUTPUTS.get(name) or MALFORMED[name])
    expected = _parse(codecs["package"], ids, 1)
    for chunk in (1, 3, 7, len(ids)):
        assert _parse(codecs["own"], ids, chunk) == expected
        assert _parse(codecs["package"], ids, chunk) == expected


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_events_match_the_packages_own_parser(name, codecs):
    """Per token, the same content deltas as the package's StreamableParser, and at the
    end the same messages."""
    ids = _ids(codecs, OUTPUTS[name])
    reference = openai_harmony.StreamableParser(codecs["encoding"], openai_harmony.Role.ASSISTANT)
    parser = codecs["own"].parser()
    done: list[MessageDone] = []
    for token in ids:
        events = parser.feed([token])
        reference.process(token)
        deltas = [e.text for e in events if isinstance(e, ContentDelta)]
        assert "".join(deltas) == (reference.last_content_delta or "")
        done += [e for e in events if isinstance(e, MessageDone)]
    done += [e for e in parser.finish() if isinstance(e, MessageDone)]
    reference.process_eos()
    assert [(d.channel, d.recipient, d.content_type, d.text) for d in done] == [
        (m.channel, m.recipient, m.content_type, m.content[0].text)
        for m in reference.messages]


def test_truncated_output_ends_in_a_replacement_character(codecs):
    events = _parse(codecs["package"], _ids(codecs, OUTPUTS["truncated"]), 1)
    assert events[-1] == MessageDone("analysis", None, None, "Weather \ufffd", None)


def test_forced_header_start(codecs):
    for codec in (codecs["own"], codecs["package"]):
        parser = codec.parser(Header("commentary", "functions.ping", "<|constrain|>json"))
        events = parser.feed(_ids(codecs, '{"n": 1}<|call|>'))
        assert events[-1] == MessageDone("commentary", "functions.ping", "<|constrain|>json",
                                         '{"n": 1}', "call")
