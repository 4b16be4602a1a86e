"""Chat templates: found in GGUF metadata / HF folders / an override, rendered, tokenized once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_reference import build_tiny_tokenizer

from loom.engine.input_processor import InputProcessor
from loom.errors import InvalidRequestError, PromptTooLongError
from loom.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer, load_tokenizer
from loom.tokenizer.packaged_templates import GEMMA3_TEMPLATE, packaged_template_file

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]},
    {"role": "user", "content": "And of Italy?"},
]
GEMMA_EXPECTED = (
    "<bos><start_of_turn>user\nYou are a terse assistant.\n\n"
    "What is the capital of France?<end_of_turn>\n"
    "<start_of_turn>model\nParis.<end_of_turn>\n"
    "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
    "<start_of_turn>model\n"
)
SIMPLE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


# ---------------------------------------------------------------- the real Gemma 3 270M


GEMMA_TEMPLATE = packaged_template_file(GEMMA3_TEMPLATE)


@pytest.fixture(scope="module")
def gemma_template(gemma_path: Path) -> ChatTemplate:
    """The packaged Gemma 3 GGUF carries no template: Loom's (loom/tokenizer/templates) with
    the GGUF's BOS/EOS, without an override; the same as passing that file."""
    template = ChatTemplate.from_model(gemma_path, gemma_path)
    assert template is not None and template.origin.startswith(str(GEMMA_TEMPLATE))
    assert template.template == GEMMA_TEMPLATE.read_text(encoding="utf-8")
    override = ChatTemplate.from_model(gemma_path, gemma_path, GEMMA_TEMPLATE)
    assert override is not None and override.origin == str(GEMMA_TEMPLATE)
    assert override.template == template.template
    assert (override.bos_token, override.eos_token) == (template.bos_token, template.eos_token)
    return template


@pytest.fixture(scope="module")
def gemma_loom_tokenizer(gemma_path: Path) -> Tokenizer:
    """Loom's tokenizer of the GGUF (the engine's, from the shared on-disk cache)."""
    return load_tokenizer(gemma_path)


@pytest.mark.slow
def test_gemma_gguf_turn_format(gemma_template: ChatTemplate) -> None:
    assert (gemma_template.bos_token, gemma_template.eos_token) == ("<bos>", "<eos>")
    assert gemma_template.render(CONVERSATION) == GEMMA_EXPECTED
    no_prompt = gemma_template.render(CONVERSATION, add_generation_prompt=False)
    assert no_prompt == GEMMA_EXPECTED.removesuffix("<start_of_turn>model\n")


@pytest.mark.slow
def test_gemma_render_ids_one_bos(
    gemma_template: ChatTemplate, gemma_loom_tokenizer: Tokenizer
) -> None:
    tok = gemma_loom_tokenizer
    ids = gemma_template.render_ids(tok, CONVERSATION)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-3:] == tok.encode("<start_of_turn>model\n", add_special_tokens=False)
    # What a naive encode would do: the template's "<bos>" plus the tokenizer's own.
    naive = tok.encode(gemma_template.render(CONVERSATION), add_special_tokens=True)
    assert naive[:2] == [tok.bos_token_id, tok.bos_token_id]
    assert naive[1:] == ids


@pytest.mark.slow
def test_gemma_matches_transformers(
    gemma_template: ChatTemplate, gemma_loom_tokenizer: Tokenizer, gemma_hf_tokenizer
) -> None:
    hf = gemma_hf_tokenizer
    for prompt in (True, False):
        text = hf.apply_chat_template(
            CONVERSATION, chat_template=gemma_template.template, tokenize=False,
            add_generation_prompt=prompt,
        )
        assert gemma_template.render(CONVERSATION, add_generation_prompt=prompt) == text
        hf_ids = hf.apply_chat_template(
            CONVERSATION, chat_template=gemma_template.template, tokenize=True,
            add_generation_prompt=prompt, return_dict=True,
        )["input_ids"]
        loom_ids = gemma_template.render_ids(
            gemma_loom_tokenizer, CONVERSATION, add_generation_prompt=prompt
        )
        assert loom_ids == hf_ids


# ---------------------------------------------------------------- finding a template


def _hf_folder(folder: Path, **tokenizer_config: object) -> Path:
    """The tiny test tokenizer in `folder`, its tokenizer_config.json extended."""
    build_tiny_tokenizer(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, **tokenizer_config}))
    return folder


def test_hf_tokenizer_config_template(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "m", chat_template=SIMPLE)
    template = ChatTemplate.from_model(folder, folder)
    assert template is not None and template.template == SIMPLE
    assert (template.bos_token, template.eos_token) == ("<bos>", "<eos>")
    assert template.render([{"role": "user", "content": "hi"}]) == (
        "<bos>[user] hi<eos>\n[assistant] "
    )


def test_hf_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "m", chat_template=SIMPLE)
    (folder / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}")
    template = ChatTemplate.from_model(folder, folder)
    assert template is not None
    assert template.render([{"role": "user", "content": "hi"}]) == "JINJA hi"


def test_tokenizer_path_separate_from_model(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    tokenizer = _hf_folder(tmp_path / "tok", chat_template=SIMPLE)
    template = ChatTemplate.from_model(model, tokenizer)
    assert template is not None and template.template == SIMPLE


def test_override_file_wins(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "m", chat_template=SIMPLE)
    override = tmp_path / "mine.jinja"
    override.write_text("{{ bos_token }}MINE {{ messages[-1].content }}")
    for given in (override, str(override)):
        template = ChatTemplate.from_model(folder, folder, override=given)
        assert template is not None and template.origin == str(override)
        # The override still gets the model's BOS string.
        assert template.render([{"role": "user", "content": "x"}]) == "<bos>MINE x"
    with pytest.raises(ChatTemplateError, match="does not exist"):
        ChatTemplate.from_model(folder, folder, override=tmp_path / "missing.jinja")
    inline = "INLINE {{ messages[0].content }}" * 200  # too long a name to be a path
    template = ChatTemplate.from_model(folder, folder, override=inline)
    assert template is not None and template.render([{"role": "user", "content": "y"}])[:8] == (
        "INLINE y"
    )


def test_no_template_returns_none(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "m")
    assert ChatTemplate.from_model(folder, folder) is None
    assert "pass --chat-template FILE" in str(ChatTemplateError.missing("tiny"))


# ---------------------------------------------------------------- Loom's packaged templates


TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]


def _gemma3_like_folder(folder: Path, model_type: str = "gemma3_text",
                        turn_tokens_in: str | None = "tokenizer_config.json",
                        **tokenizer_config: object) -> Path:
    """A HF folder with a config of `model_type` and the tiny tokenizer, with Gemma's turn
    tokens listed as added tokens in `turn_tokens_in` (None: nowhere)."""
    _hf_folder(folder, **tokenizer_config)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    if turn_tokens_in == "tokenizer_config.json":
        config = json.loads((folder / turn_tokens_in).read_text())
        config["added_tokens_decoder"] = {
            str(600 + i): {"content": t, "special": True} for i, t in enumerate(TURN_TOKENS)}
        (folder / turn_tokens_in).write_text(json.dumps(config))
    elif turn_tokens_in == "tokenizer.json":
        vocab = json.loads((folder / turn_tokens_in).read_text())
        vocab["added_tokens"] += [{"id": 600 + i, "content": t, "special": True}
                                  for i, t in enumerate(TURN_TOKENS)]
        (folder / turn_tokens_in).write_text(json.dumps(vocab))
    return folder


@pytest.mark.parametrize("where", ["tokenizer_config.json", "tokenizer.json"])
@pytest.mark.parametrize("model_type", ["gemma3", "gemma3_text"])
def test_gemma3_without_a_template_gets_the_packaged_one(
    tmp_path: Path, where: str, model_type: str
) -> None:
    folder = _gemma3_like_folder(tmp_path / "m", model_type, where)
    template = ChatTemplate.from_model(folder, folder)
    assert template is not None and template.origin.startswith(str(GEMMA_TEMPLATE))
    assert (template.bos_token, template.eos_token) == ("<bos>", "<eos>")
    assert template.render(CONVERSATION) == GEMMA_EXPECTED


def test_the_packaged_template_needs_gemma3_and_its_turn_tokens(tmp_path: Path) -> None:
    # A Gemma 3 body whose tokenizer lacks the turn tokens (the tests' tiny models).
    no_tokens = _gemma3_like_folder(tmp_path / "a", turn_tokens_in=None)
    assert ChatTemplate.from_model(no_tokens, no_tokens) is None
    # Another architecture with tokens of those names.
    llama = _gemma3_like_folder(tmp_path / "b", model_type="llama")
    assert ChatTemplate.from_model(llama, llama) is None


def test_the_models_own_template_and_the_override_come_first(tmp_path: Path) -> None:
    own = _gemma3_like_folder(tmp_path / "a", chat_template=SIMPLE)
    template = ChatTemplate.from_model(own, own)
    assert template is not None and template.template == SIMPLE
    plain = _gemma3_like_folder(tmp_path / "b")
    template = ChatTemplate.from_model(plain, plain, SIMPLE)
    assert template is not None and template.template == SIMPLE


# ---------------------------------------------------------------- rendering and tokenizing


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("not a dict", r"messages\[1\] must be an object"),
        ({"role": "robot", "content": "x"}, r"messages\[1\] has role 'robot'"),
        ({"content": "x"}, r"messages\[1\] has role None"),
        ({"role": "user", "content": 42}, r"messages\[1\]\.content must be a string"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            r"messages\[1\]\.content\[0\] has type 'image_url'",
        ),
        ({"role": "user", "content": [{"type": "text"}]}, r"messages\[1\]\.content\[0\] needs"),
    ],
)
def test_bad_message_names_index(bad: object, match: str) -> None:
    template = ChatTemplate(SIMPLE)
    with pytest.raises(ChatTemplateError, match=match):
        template.render([{"role": "user", "content": "ok"}, bad])  # type: ignore[list-item]


def test_empty_messages_rejected() -> None:
    with pytest.raises(ChatTemplateError, match="non-empty"):
        ChatTemplate(SIMPLE).render([])


def test_content_parts_flattened_and_extras_passed() -> None:
    template = ChatTemplate("{{ messages[0].content }}|{{ messages[0].name }}|{{ tools | tojson }}")
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "é"}]
    out = template.render([{"role": "developer", "content": parts, "name": "n"}], tools=["t"])
    assert out == 'aé|n|["t"]'


def test_raise_exception_becomes_chat_template_error() -> None:
    template = ChatTemplate("{{ raise_exception('no system messages, please') }}")
    with pytest.raises(ChatTemplateError, match="no system messages, please"):
        template.render([{"role": "system", "content": "x"}])


def test_template_errors_are_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error on line 1"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        ChatTemplate("{{ messages[0].content.missing.deeper }}").render(
            [{"role": "user", "content": "x"}]
        )
    with pytest.raises(ChatTemplateError, match="chat template failed"):  # the sandbox
        ChatTemplate("{{ messages.__class__.__base__ }}").render([{"role": "user", "content": "x"}])


def test_template_helpers() -> None:
    template = ChatTemplate(
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}"
        "{% endif %}{% generation %}{% set ns.n = ns.n + 1 %}{% endgeneration %}{% endfor %}"
        "{{ ns.n }} {{ dict(a=1) }} {{ strftime_now('%Y') | length }}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert template.render(messages) == "1 {'a': 1} 4"


@pytest.mark.parametrize("writes_bos", [True, False])
def test_render_ids_one_bos_tiny(tmp_path: Path, writes_bos: bool) -> None:
    build_tiny_tokenizer(tmp_path / "m")
    tok = load_tokenizer(tmp_path / "m")
    assert tok.add_bos_token and tok.bos_token_id is not None
    text = SIMPLE if writes_bos else SIMPLE.removeprefix("{{ bos_token }}")
    template = ChatTemplate(text, bos_token="<bos>", eos_token="<eos>")
    ids = template.render_ids(tok, [{"role": "user", "content": "Once upon a time"}])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == "<bos>[user] Once upon a time<eos>\n[assistant] "


def test_render_ids_no_bos_when_tokenizer_adds_none(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "m", add_bos_token=False)
    tok = load_tokenizer(folder)
    template = ChatTemplate(SIMPLE.removeprefix("{{ bos_token }}"), bos_token="<bos>")
    ids = template.render_ids(tok, [{"role": "user", "content": "hi"}])
    assert tok.bos_token_id not in ids


# ---------------------------------------------------------------- the engine's input processor


def test_input_processor_encodes_chat_as_the_server_does(tmp_path: Path) -> None:
    """`InputProcessor.encode_chat`: the same ids as `render_ids`, checked as a prompt."""
    build_tiny_tokenizer(tmp_path / "m")
    tok = load_tokenizer(tmp_path / "m")
    messages = [{"role": "user", "content": "Once upon a time"}]
    inputs = InputProcessor(tok, tok.vocab_size, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        inputs.encode_chat("r", messages)
    template = ChatTemplate(SIMPLE, bos_token="<bos>", eos_token="<eos>")
    inputs.chat_template = template
    ids = template.render_ids(tok, messages)
    assert inputs.encode_chat("r", messages) == ids == inputs.render_chat("r", messages)
    assert inputs.encode_chat("r", messages, add_generation_prompt=False) == (
        template.render_ids(tok, messages, add_generation_prompt=False)
    )
    with pytest.raises(ChatTemplateError, match="has role 'robot'"):
        inputs.encode_chat("r", [{"role": "robot", "content": "x"}])
    short = InputProcessor(tok, tok.vocab_size, max_model_len=len(ids) - 1, chat_template=template)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        short.encode_chat("r", messages)
    assert short.render_chat("r", messages) == ids  # unchecked: the server bounds it later
    narrow = InputProcessor(tok, max(ids), max_model_len=256, chat_template=template)
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        narrow.encode_chat("r", messages)
