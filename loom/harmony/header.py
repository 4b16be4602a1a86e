"""A message header's text read into its fields, by the rules of the openai-harmony
package's parser (so that Loom's parser reads every header form the package reads, and
refuses the same ones).

The header is the text between `<|start|>` (or, for the first message of an output, the
prompt's `<|start|>assistant`) and `<|message|>`, special tokens spelled out:

    assistant<|channel|>final
    assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    assistant to=functions.get_weather<|channel|>commentary json
    functions.get_weather to=assistant<|channel|>commentary

1. `<|channel|>` and the word after it (up to white space or `<`) are the channel and are
   cut out; an empty channel word makes the header invalid.
2. `<|constrain|>` gets a space before it; the rest splits on ASCII white space.
3. The first word is the role (unless the role is known: it is then dropped only when it is
   that role); an unknown first word followed by more words, or one starting `to=`, is a
   tool's name; anything else is invalid.
4. Of the words left, the last one is the recipient when it starts `to=` or is the only
   word, else the content type, with the word before it (`to=` stripped if present) the
   recipient. Any word still left makes the header invalid.
"""

from __future__ import annotations

import re

from loom.harmony.conversation import ROLES
from loom.harmony.events import Header

CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
# Unicode's White_Space (what the package's trimming and channel words stop at).
_WHITE_SPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
                         "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_ASCII_SPACE = re.compile("[\t\n\x0c\r ]+")


def _trim(text: str) -> str:
    start, end = 0, len(text)
    while start < end and text[start] in _WHITE_SPACE:
        start += 1
    while end > start and text[end - 1] in _WHITE_SPACE:
        end -= 1
    return text[start:end]


def parse_header_text(text: str, role_known: bool) -> Header | None:
    """The fields of a header's text (module docstring), or None when it is invalid.
    `role_known`: the header is the first one of an output, whose role (assistant) the
    prompt wrote."""
    channel = None
    at = text.find(CHANNEL)
    if at >= 0:
        after = text[at + len(CHANNEL):]
        stop = next((i for i, c in enumerate(after) if c in _WHITE_SPACE or c == "<"),
                    len(after))
        if stop == 0:
            return None
        channel = after[:stop]
        text = text[:at] + after[stop:]
    text = _trim(text)
    if CONSTRAIN in text:
        text = _trim(text.replace(CONSTRAIN, " " + CONSTRAIN))
    words = [w for w in _ASCII_SPACE.split(text) if w]
    role = "assistant"
    if not role_known:
        if not words:
            return None
        if words[0] in ROLES:
            role = words[0]
        elif len(words) > 1 or words[0].startswith("to="):
            role = "tool"
            words.pop(0)
        else:
            return None
    if words and words[0] == role:
        words.pop(0)
    recipient = content_type = None
    if words:
        count, last = len(words), words.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif count == 1:
            recipient = last
        else:
            content_type = last
            if words:
                raw = words.pop()
                recipient = raw[3:] if raw.startswith("to=") else raw
        if words:
            return None
    return Header(channel, recipient, content_type)
