"""Structured output in the engine: every constrained output is in the constraint's language
(random schemas, random logits), whatever path its tokens took: speculative drafts, a
session's rewind, a forked child, a session that constrains one segment and not the next.
Bad constraints are refused before anything is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom import SamplingParams, StructuredOutputsParams
from loom.engine.hooks import SequenceHook
from loom.errors import InvalidRequestError

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99999},
                                           "b": {"type": "array", "items": {"enum": [1, 2, 3]},
                                                 "maxItems": 6}},
          "required": ["a", "b"], "additionalProperties": False}


def _leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.just({"type": "integer", "minimum": 0, "maximum": 999}),
        st.just({"type": "boolean"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda vals: {"enum": vals},
                  st.lists(st.sampled_from(["red", "green", "blue", 1, 2, None]),
                           min_size=1, max_size=3, unique=True)),
    )


def _schema() -> st.SearchStrategy[dict]:
    def obj(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        props = st.dictionaries(st.sampled_from(["a", "b", "name", "n"]), children,
                                min_size=1, max_size=3)
        return props.map(lambda p: {"type": "object", "properties": p, "required": sorted(p),
                                    "additionalProperties": False})

    def arr(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        return children.map(lambda c: {"type": "array", "items": c, "maxItems": 3})

    return st.recursive(_leaf(), lambda c: st.one_of(obj(c), arr(c)), max_leaves=5).map(
        lambda s: s if s.get("type") == "object" else {
            "type": "object", "properties": {"v": s}, "required": ["v"],
            "additionalProperties": False})


def _complete(engine, rid, ids, params):
    engine.add_request(rid, ids, params)
    return run_to_completion(engine)[rid].outputs


@pytest.fixture(scope="module")
def engine(tiny_models):
    folder, _ = tiny_models["qwen2"]
    return make_engine(folder, num_kv_blocks=512)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schema(), seed=st.integers(0, 2**16), temperature=st.sampled_from([0.0, 1.0, 2.0]))
def test_random_schemas_under_random_logits_always_validate(engine, schema, seed, temperature):
    """Random weights give random logits; every finished output parses and validates, and a
    token the grammar forbids is never sampled (the output would not parse)."""
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=200, n=2,
                            structured_outputs=StructuredOutputsParams(json=schema))
    outs = _complete(engine, "r", prompt_ids(5, offset=seed % 7), params)
    for out in outs:
        if out.finish_reason == "length":
            continue  # cut by max_tokens: a prefix of a valid document
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)

    assert engine.kv_pool_all_free


@pytest.mark.parametrize("seed", range(4))
def test_documents_complete_under_random_logits(engine, seed):
    """The property above is not vacuous: with room enough, documents end as whole ones."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, n=2,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    for out in _complete(engine, "r", prompt_ids(5, offset=seed), params):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(regex=r"[a-c]{2,5}-\d{2}"),
    StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(grammar='start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/\n'),
])
def test_regex_choice_object_and_grammar(engine, constraint):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=60, n=3,
                            structured_outputs=constraint)
    for out in _complete(engine, "r", prompt_ids(6), params):
        if constraint.regex:
            assert re.fullmatch(constraint.regex, out.text), out.text
        elif constraint.choice:
            assert out.text in constraint.choice
        elif constraint.json_object:
            if out.finish_reason == "stop":
                assert isinstance(json.loads(out.text), dict)
        else:
            assert re.fullmatch(r"\((\d{1,2})(,\d{1,2})*\)", out.text), out.text


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculative_drafts_do_not_change_constrained_output(tiny_models, temperature):
    folder, _ = tiny_models["qwen2"]
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=80, n=2,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    plain = _complete(make_engine(folder), "r", prompt_ids(8), params)
    spec_engine = make_engine(folder, speculative_config=SPEC)
    drafted = _complete(spec_engine, "r", prompt_ids(8), params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert spec_engine.speculator.num_drafted > 0  # drafts were proposed and checked


def test_rewind_rolls_the_matcher_back(tiny_models):
    """A constrained segment cut by max_tokens, rewound by two tokens and resumed with the
    same constraint goes on from the rolled-back state: greedy, it equals one long run."""
    folder, _ = tiny_models["qwen2"]
    constraint = StructuredOutputsParams(json=SCHEMA)
    whole = _complete(make_engine(folder), "r", prompt_ids(7),
                      SamplingParams(temperature=0.0, max_tokens=80,
                                     structured_outputs=constraint))[0]
    assert whole.finish_reason == "stop"
    engine = make_engine(folder)
    engine.add_request("s", prompt_ids(7), session=True)
    run_to_completion(engine)
    engine.resume("s", SamplingParams(temperature=0.0, max_tokens=6,
                                      structured_outputs=constraint))
    run_to_completion(engine)
    engine.rewind("s", 2)
    engine.resume("s", SamplingParams(temperature=0.0, max_tokens=80,
                                      structured_outputs=constraint))
    run_to_completion(engine)
    tokens = list(engine.get_session("s").token_ids)[7:]
    assert tokens == whole.token_ids
    engine.close("s")
    assert engine.kv_pool_all_free


def test_a_session_constrains_one_segment_and_not_the_next(tiny_models):
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder)
    engine.add_request("s", prompt_ids(5), session=True)
    run_to_completion(engine)
    engine.resume("s", SamplingParams(temperature=1.0, seed=2, max_tokens=40,
                                      structured_outputs=StructuredOutputsParams(
                                          regex=r"[0-9]{4}")))
    first = run_to_completion(engine)["s"].outputs[0]
    assert re.fullmatch(r"[0-9]{4}", first.text[-4:]) and first.finish_reason == "stop"
    engine.append("s", " and then")  # a caller's fragment: never checked
    engine.resume("s", SamplingParams(temperature=1.0, seed=2, max_tokens=12, ignore_eos=True))
    second = run_to_completion(engine)["s"].outputs[0]
    assert second.finish_reason == "length"  # unconstrained: it ran to max_tokens
    engine.close("s")


class ForkAt(SequenceHook):
    """Forks the root sequence after its 3rd token (the child continues the document)."""

    def __init__(self) -> None:
        self.count = 0

    def on_token(self, ctx, seq_id, token_id):
        if ctx.parent(seq_id) is None:
            self.count += 1
            if self.count == 3:
                assert ctx.spawn_child(seq_id) is not None


def test_a_forked_child_inherits_the_parents_grammar_state(tiny_models):
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder, hooks=[ForkAt()])
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=80,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    engine.add_request("r", prompt_ids(6), params)
    out = run_to_completion(engine)["r"]
    assert out.children, "the hook forked a child"
    parent_text = out.outputs[0].text
    child = out.children[0].outputs[0]
    # The child's prompt is the parent's context at the fork: 3 generated tokens.
    shared = engine.tokenizer.decode(out.children[0].prompt_token_ids[6:])
    for text, reason in ((parent_text, out.outputs[0].finish_reason),
                         (shared + child.text, child.finish_reason)):
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert engine.kv_pool_all_free


@pytest.mark.parametrize("bad", [
    StructuredOutputsParams(json="{not json"),
    StructuredOutputsParams(json={"type": "no-such-type"}),
    StructuredOutputsParams(regex="(unclosed"),
    StructuredOutputsParams(grammar="start: missing_rule\n"),
])
def test_bad_constraints_are_refused_before_anything_is_queued(engine, bad):
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        engine.add_request("bad", prompt_ids(4), SamplingParams(structured_outputs=bad))
    assert not engine.has_unfinished_requests() and not engine.is_live("bad")
    assert engine.kv_pool_all_free
    engine.add_request("s", prompt_ids(4), session=True)
    run_to_completion(engine)
    with pytest.raises(InvalidRequestError):
        engine.resume("s", SamplingParams(structured_outputs=bad))
    assert not engine.get_session("s").generating
    engine.close("s")


def test_structured_outputs_needs_exactly_one_constraint():
    with pytest.raises(Exception, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")


def test_masks_computed_during_the_forward_equal_masks_computed_after(tiny_models):
    """The GPU path starts a step's masks before its forward (off on a CPU, where it is
    slower): forced on here, outputs are the same, drafts included."""
    folder, _ = tiny_models["qwen2"]
    params = SamplingParams(temperature=0.9, seed=4, max_tokens=80, n=3,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    after = _complete(make_engine(folder), "r", prompt_ids(8), params)
    for spec in (None, SPEC):
        engine = make_engine(folder, speculative_config=spec)
        assert not engine.core.appender.early_masks  # a CPU engine computes them after
        engine.core.appender.early_masks = True
        during = _complete(engine, "r", prompt_ids(8), params)
        assert [o.token_ids for o in during] == [o.token_ids for o in after]


def test_a_finished_document_cut_back_goes_on_from_the_cut(tiny_models):
    """A constrained segment that completed its document (its end consumed), rewound into
    the document and resumed under the same constraint, goes on from the cut: the kept
    tokens and the new ones form one valid document. (llguidance's own rollback past a
    consumed end lands a few tokens off; the matcher replays the kept tokens instead.)"""
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder)
    engine.add_request("s", prompt_ids(5), session=True)
    run_to_completion(engine)
    digits = StructuredOutputsParams(regex=r"[0-9]{6}")
    engine.resume("s", SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                                      structured_outputs=digits))
    first = run_to_completion(engine)["s"].outputs[0]
    assert first.finish_reason == "stop"
    generated = len(engine.get_session("s").token_ids) - 5
    engine.rewind("s", 2)
    engine.resume("s", SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                                      structured_outputs=digits))
    run_to_completion(engine)
    tokens = list(engine.get_session("s").token_ids)[5:]
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert len(tokens) >= generated - 2 and re.fullmatch(r"[0-9]{6}", text), text
    engine.close("s")
    assert engine.kv_pool_all_free


def test_a_fragment_after_an_unfinished_document_starts_a_new_one(tiny_models):
    """A segment cut by max_tokens mid-document, then a caller's fragment, then the same
    constraint: the new segment is a whole document of its own (the old one cannot go on
    past text it never saw)."""
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder)
    engine.add_request("s", prompt_ids(5), session=True)
    run_to_completion(engine)
    digits = StructuredOutputsParams(regex=r"[0-9]{6}")
    engine.resume("s", SamplingParams(temperature=1.0, seed=4, max_tokens=2,
                                      structured_outputs=digits))
    assert run_to_completion(engine)["s"].outputs[0].finish_reason == "length"
    engine.append("s", " next:")
    before = len(engine.get_session("s").token_ids)
    engine.resume("s", SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                                      structured_outputs=digits))
    run_to_completion(engine)
    text = engine.tokenizer.decode(list(engine.get_session("s").token_ids)[before:],
                                   skip_special_tokens=True)
    assert re.fullmatch(r"[0-9]{6}", text), text
    engine.close("s")
    assert engine.kv_pool_all_free


def test_rolling_back_past_a_documents_end_lands_where_the_kept_tokens_do(engine):
    """A matcher that consumed its document's end (the end-of-sequence token a finished
    segment samples), rolled back by two tokens, allows what a fresh matcher that consumed
    only the kept tokens allows (llguidance 1.9.1's own rollback from there does not)."""
    structured = engine.structured
    digits = StructuredOutputsParams(regex=r"[0-9]{6}")
    ids = engine.tokenizer.encode("123456", add_special_tokens=False)
    done = structured.matcher("done", digits)
    for position, token in enumerate(ids):
        assert done.consume(token, position)
    assert done.consume(engine.config.eos_token_ids[0], len(ids)) and done.is_finished
    done.rollback(2)
    kept = structured.matcher("kept", digits)
    for position, token in enumerate(ids[:-1]):
        kept.consume(token, position)
    assert not done.is_finished and done.positions == kept.positions
    assert torch.equal(structured.compute_masks([done]), structured.compute_masks([kept]))
