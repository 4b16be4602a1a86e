"""OpenAI chat messages mapped onto a harmony conversation, its system and developer
messages, and the two rules that drop earlier analysis messages."""

from __future__ import annotations

import pytest

from loom.errors import InvalidRequestError
from loom.harmony import HarmonyMessage, HarmonyTool, SystemOptions, from_openai
from loom.harmony.conversation import (
    drop_answered_analysis,
    drop_stale_analysis,
    system_text,
)

CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": {"b": [1, "é"]}}}]}


def test_system_text_lines():
    options = SystemOptions(reasoning_effort="high", model_identity=None,
                            knowledge_cutoff=None, conversation_start_date="2025-02-03")
    assert system_text(options, function_tools=False) == (
        "Current date: 2025-02-03\n\nReasoning: high\n\n# Valid channels: analysis, "
        "commentary, final. Channel must be included for every message.")
    bare = SystemOptions(model_identity=None, knowledge_cutoff=None)
    assert system_text(bare, function_tools=True).startswith("Reasoning: medium\n\n")
    assert system_text(bare, function_tools=True).endswith(
        "\nCalls to these tools must go to the commentary channel: 'functions'.")


def test_unknown_reasoning_effort_is_refused():
    with pytest.raises(InvalidRequestError, match="reasoning_effort") as e:
        SystemOptions(reasoning_effort="max")
    assert e.value.param == "reasoning_effort"


def test_mapping():
    messages = from_openai([
        {"role": "developer", "content": "Rule."},
        {"role": "user", "content": "q"},
        CALL,
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
        {"role": "assistant", "content": "done", "reasoning_content": "saw r"},
    ], [HarmonyTool("f", "F.", None)], SystemOptions())
    # The last message answers: its analysis goes (drop_answered_analysis).
    assert [m.role for m in messages] == ["system", "developer", "user", "assistant", "tool",
                                          "assistant"]
    assert messages[1].content.startswith("# Instructions\n\nRule.\n\n# Tools\n\n")
    assert messages[3] == HarmonyMessage("assistant", '{"b":[1,"é"]}', channel="commentary",
                                         recipient="functions.f",
                                         content_type="<|constrain|>json")
    assert messages[4] == HarmonyMessage("tool", "r", author_name="functions.f",
                                         channel="commentary", recipient="assistant")
    assert messages[5:] == [HarmonyMessage("assistant", "done", channel="final")]


def test_arguments_text_is_kept_as_given():
    call = {**CALL, "tool_calls": [{"id": "x", "type": "function",
                                    "function": {"name": "g", "arguments": '{ "a" : 1 }'}}]}
    assert from_openai([call], [], SystemOptions())[1].content == '{ "a" : 1 }'


def test_no_developer_message_without_instructions_or_tools():
    messages = from_openai([{"role": "system", "content": ""},
                            {"role": "user", "content": "hi"}], [], SystemOptions())
    assert [m.role for m in messages] == ["system", "user"]


def test_tool_result_name_from_its_name_when_no_call_matches():
    messages = from_openai([{"role": "tool", "name": "lookup", "content": "x"}], [],
                           SystemOptions())
    assert messages[-1].author_name == "functions.lookup"


def test_tool_result_that_answers_no_call_is_refused():
    with pytest.raises(InvalidRequestError, match=r"messages\[1\].*'nope'"):
        from_openai([CALL, {"role": "tool", "tool_call_id": "nope", "content": "x"}], [],
                    SystemOptions())


def test_unknown_role_is_refused_by_name():
    with pytest.raises(InvalidRequestError, match="'critic'"):
        from_openai([{"role": "critic", "content": "x"}], [], SystemOptions())
    with pytest.raises(InvalidRequestError, match="'critic'"):
        HarmonyMessage("critic", "x")
    with pytest.raises(InvalidRequestError, match="author"):
        HarmonyMessage("tool", "x")


def _m(channel: str | None, role: str = "assistant") -> HarmonyMessage:
    return HarmonyMessage(role, channel or "u", channel=channel)


def test_package_rule_drops_analysis_before_the_first_final_only_when_the_last_is_final():
    between = [_m(None, "user"), _m("analysis"), _m("final"), _m(None, "user"), _m("analysis"),
               _m("final")]
    assert [m.channel for m in drop_stale_analysis(between)] == [
        None, "final", None, "analysis", "final"]
    ongoing = [*between[:5], _m("commentary")]
    assert drop_stale_analysis(ongoing) == ongoing
    assert drop_stale_analysis([]) == []


def test_vllm_rule_drops_analysis_before_the_last_final():
    history = [_m(None, "user"), _m("analysis"), _m("final"), _m(None, "user"), _m("analysis"),
               _m("final"), _m(None, "user"), _m("analysis"), _m("commentary")]
    assert [m.channel for m in drop_answered_analysis(history)] == [
        None, "final", None, "final", None, "analysis", "commentary"]
