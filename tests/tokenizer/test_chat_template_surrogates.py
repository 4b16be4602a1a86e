"""Text with an unpaired UTF-16 surrogate (what JSON's lone `\\ud800` escape parses to) is
refused by the chat template with a ChatTemplateError naming where it is, not handed to a
tokenizer that fails on it with a TypeError (issue 43)."""

from __future__ import annotations

import pytest

from loom.tokenizer import ChatTemplate
from loom.tokenizer.chat_template import ChatTemplateError

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{{ extra or '' }}")


def test_a_lone_surrogate_in_content_names_the_message():
    template = ChatTemplate(TEMPLATE)
    good = {"role": "user", "content": "hi"}
    for content in ("x \ud800 y", [{"type": "text", "text": "a"},
                                    {"type": "text", "text": "\udfff"}]):
        with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.content .*surrogate"):
            template.render([good, {"role": "user", "content": content}])
    assert template.render([good]) == "user: hi\n"


def test_a_lone_surrogate_from_elsewhere_is_refused_after_rendering():
    with pytest.raises(ChatTemplateError, match=r"rendered prompt .*surrogate"):
        ChatTemplate(TEMPLATE).render([{"role": "user", "content": "hi"}], extra="\ud800")
