"""Sessions that outlive their engine: with a KV store configured, a session's state is saved
beside its KV blocks each time it pauses, and a new engine on the same store (a restart)
continues it by id, its full blocks loaded, not computed; from Python, a snapshot's bytes
restore it in another process. In w8a8 (bit-identical, as the default w4a8) the continuation
equals the one without the restart bit for bit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, settle_session

from loom import SamplingParams, StructuredOutputsParams
from loom.engine.session_snapshot import SessionSnapshot, SessionSnapshotError
from loom.errors import InvalidSessionStateError, SessionClosedError, UnknownRequestError
from loom.kv_connector import KVTransferConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
BLOCK = 4  # make_engine's block size


def files_store(path) -> KVTransferConfig:
    return KVTransferConfig("SharedStorageConnector", kv_role="kv_both",
                            kv_connector_extra_config={"shared_storage_path": str(path)})


def redis_store(server) -> KVTransferConfig:
    return KVTransferConfig("RedisConnector", kv_role="kv_both",
                            kv_connector_extra_config={"url": server.url})


def engine_on(folder, store: KVTransferConfig | None, quantization="w8a8"):
    # No prefix cache: a second engine in this process could otherwise not tell a load from
    # a local hit (and a restarted process has none).
    return make_engine(folder, quantization=quantization, enable_prefix_caching=False,
                       kv_transfer_config=store)


def build_session(engine, sid="chat"):
    """A session with a prompt, a generated segment and an appended fragment: paused."""
    engine.add_request(sid, prompt_ids(22), GREEDY, session=True)
    settle_session(engine, sid)
    engine.append(sid, prompt_ids(6, 1))
    settle_session(engine, sid)


def continue_session(engine, sid="chat"):
    """The next turn: a fragment and a segment; (its tokens, the logits it ends with)."""
    engine.append(sid, prompt_ids(3, 2), GREEDY)
    settle_session(engine, sid)
    view = engine.get_session(sid)
    return list(view.token_ids), engine.get_logits(sid).clone()


@pytest.mark.parametrize("store", ["files", "redis"])
def test_a_restarted_engine_continues_a_session_bit_identically(tiny_models, tmp_path, store,
                                                                 request):
    folder, _ = tiny_models["llama"]
    config = files_store(tmp_path) if store == "files" else \
        redis_store(request.getfixturevalue("redis_server"))
    first = engine_on(folder, config)
    build_session(first)
    saved = first.get_session("chat")
    saved_logits = first.get_logits("chat").clone()

    # A new engine on the same store: the id is known again on first use, paused, with
    # its stored logits; its full blocks come from the store.
    second = engine_on(folder, config)
    view = second.get_session("chat")
    assert view.token_ids == saved.token_ids
    assert view.num_prompt_tokens == saved.num_prompt_tokens
    assert torch.equal(second.get_logits("chat"), saved_logits)
    computed = second.stats.num_computed_tokens
    tokens, logits = continue_session(second)
    stats = second.stats
    full_blocks = (len(saved.token_ids) - 1) // BLOCK
    assert stats.kv_loaded_tokens == full_blocks * BLOCK
    # Computed: the last partial block's tokens (the store keeps full blocks), the fragment
    # and the generated tokens; nothing before.
    tail = len(saved.token_ids) - full_blocks * BLOCK
    assert stats.num_computed_tokens - computed == tail + 3 + 5
    assert second.get_session("chat").num_cached_tokens == full_blocks * BLOCK

    # The same turn without the restart: the same tokens and the same bits.
    ref_tokens, ref_logits = continue_session(first)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)

    # Closing forgets the snapshot: a third engine does not know the id.
    second.close("chat")
    third = engine_on(folder, config)
    with pytest.raises(UnknownRequestError, match="chat"):
        third.get_session("chat")
    for engine in (first, second, third):
        if engine.table.is_live("chat"):
            engine.close("chat")
        assert engine.kv_pool_all_free


def test_snapshot_bytes_restore_in_another_process(tiny_models, tmp_path):
    """No store: the other process computes the session's K/V from its tokens, and its
    continuation equals this one's (w8a8: bit for bit)."""
    folder, _ = tiny_models["gemma3"]
    engine = engine_on(folder, None)
    build_session(engine)
    path = tmp_path / "chat.session"
    path.write_bytes(engine.save_session("chat").to_bytes())
    ref_tokens, ref_logits = continue_session(engine)
    torch.save(ref_logits, tmp_path / "ref.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(tmp_path.parent)!r})
        from engine.helpers import make_engine, prompt_ids, settle_session
        from loom import SamplingParams, StructuredOutputsParams
        engine = make_engine({str(folder)!r}, quantization="w8a8", enable_prefix_caching=False)
        sid = engine.restore_session(open({str(path)!r}, "rb").read())
        engine.append(sid, prompt_ids(3, 2), SamplingParams(temperature=0.0, max_tokens=5,
                                                            ignore_eos=True))
        settle_session(engine, sid)
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        print(list(engine.get_session(sid).token_ids), torch.equal(engine.get_logits(sid), ref))
    """)
    tests_dir = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ,
                                            "PYTHONPATH": tests_dir})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"{ref_tokens} True"


def test_restore_under_another_id_and_refusals(tiny_models):
    folder, _ = tiny_models["llama"]
    engine = engine_on(folder, None, quantization=None)
    build_session(engine)
    snapshot = engine.save_session("chat")
    data = snapshot.to_bytes()
    again = SessionSnapshot.from_bytes(data)
    assert again.token_ids == snapshot.token_ids and again.params == snapshot.params
    assert torch.equal(again.logits, snapshot.logits)

    assert engine.restore_session(data, "copy") == "copy"
    settle_session(engine, "copy")
    assert engine.get_session("copy").token_ids == snapshot.token_ids
    torch.testing.assert_close(engine.get_logits("copy"), snapshot.logits, atol=1e-4, rtol=0)

    free = engine.num_free_blocks
    with pytest.raises(SessionSnapshotError, match="truncated"):
        engine.restore_session(data[:20])
    with pytest.raises(SessionSnapshotError, match="not a Loom session snapshot"):
        engine.restore_session(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(Exception, match="already in use"):
        engine.restore_session(data)  # "chat" is live
    with pytest.raises(UnknownRequestError, match="no stored session"):
        engine.restore_session("nowhere")  # no store configured
    assert engine.num_free_blocks == free

    engine.resume("chat", GREEDY)
    with pytest.raises(InvalidSessionStateError, match="generating"):
        engine.save_session("chat")
    settle_session(engine, "chat")
    engine.close("chat")
    with pytest.raises(SessionClosedError):
        engine.save_session("chat")
    engine.close("copy")
    assert engine.kv_pool_all_free


def test_a_constrained_document_and_expiry_across_a_restart(tiny_models, tmp_path):
    """A segment cut by max_tokens in the middle of a JSON document: after a restart the
    session goes on with the same constraint from where its matcher was (its consumed
    positions are restored), and the document equals one long run's. An expired session's
    snapshot is forgotten."""
    folder, _ = tiny_models["qwen2"]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99999},
                                               "b": {"type": "array", "maxItems": 6,
                                                     "items": {"enum": [1, 2, 3]}}},
              "required": ["a", "b"], "additionalProperties": False}
    constraint = StructuredOutputsParams(json=schema)
    whole = engine_on(folder, None)
    whole.add_request("w", prompt_ids(7), SamplingParams(
        temperature=0.0, max_tokens=80, structured_outputs=constraint))
    while whole.has_unfinished_requests():
        for out in whole.step():
            document = out.outputs[0]
    assert document.finish_reason == "stop"

    config = files_store(tmp_path)
    first = engine_on(folder, config)
    first.add_request("s", prompt_ids(7), session=True)
    settle_session(first, "s")
    first.resume("s", SamplingParams(temperature=0.0, max_tokens=6,
                                     structured_outputs=constraint))
    settle_session(first, "s")
    second = engine_on(folder, config)  # the restart
    second.resume("s", SamplingParams(temperature=0.0, max_tokens=80,
                                      structured_outputs=constraint))
    settle_session(second, "s")
    assert list(second.get_session("s").token_ids)[7:] == list(document.token_ids)
    second.close("s")

    third = engine_on(folder, config)
    third.add_request("t", prompt_ids(5), session=True, ttl_s=0.001)
    settle_session(third, "t")
    assert third.session_store.load("t") is not None
    time.sleep(0.01)
    third.step()  # expires it
    assert not third.table.is_live("t") and third.session_store.load("t") is None
    assert third.kv_pool_all_free


def test_the_store_never_lags_what_the_caller_was_answered(tiny_models, tmp_path):
    """The step that ends a segment saves the session (its pending token uncomputed, no
    logits), and so does an append: an engine that takes the session over from the store at
    once (its first engine lost before computing anything more) continues from exactly what
    the caller last saw, bit-identically."""
    folder, _ = tiny_models["llama"]
    config = files_store(tmp_path)
    first = engine_on(folder, config)
    first.add_request("chat", prompt_ids(22), GREEDY, session=True)
    while not any(o.finished or o.segment_finished for o in first.step()):
        pass  # the segment's last output: the caller has its tokens, nothing more ran
    answered = first.get_session("chat").token_ids
    first.append("chat", prompt_ids(4, 3))  # answered with its count, not computed yet
    answered += tuple(prompt_ids(4, 3))

    second = engine_on(folder, config)
    assert second.get_session("chat").token_ids == answered
    tokens, logits = continue_session(second)
    ref_tokens, ref_logits = continue_session(first)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)
    for engine in (first, second):
        engine.close("chat")
        assert engine.kv_pool_all_free
