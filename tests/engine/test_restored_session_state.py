"""A restored session reports its true state (issue 43): right after a restart (or a restore
from bytes) a session saved paused is PAUSED, as the same session is without the restart,
with its stored logits ready; its K/V comes back when an operation next wakes it, and its
continuation is the one without the restart. A snapshot without logits is computing them
(WAITING, then PAUSED)."""

from __future__ import annotations

import dataclasses

import torch
from engine.helpers import make_engine, prompt_ids, settle_session

from loom import SamplingParams
from loom.kv_connector import KVTransferConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def engine_on(folder, tmp_path):
    store = KVTransferConfig("SharedStorageConnector", kv_role="kv_both",
                             kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    return make_engine(folder, quantization="w8a8", enable_prefix_caching=False,
                       kv_transfer_config=store)


def continue_session(engine, sid: str) -> tuple[list[int], torch.Tensor]:
    engine.append(sid, prompt_ids(3, 2), GREEDY)
    settle_session(engine, sid)
    return list(engine.get_session(sid).token_ids), engine.get_logits(sid).clone()


def test_a_restored_session_is_paused_as_without_the_restart(tiny_models, tmp_path) -> None:
    folder, _ = tiny_models["llama"]
    first = engine_on(folder, tmp_path)
    first.add_request("chat", prompt_ids(22), GREEDY, session=True)
    settle_session(first, "chat")
    first.append("chat", prompt_ids(6, 1))
    settle_session(first, "chat")
    saved = first.get_session("chat")
    assert saved.status == "PAUSED"

    second = engine_on(folder, tmp_path)  # the restart: the first call names the session
    view = second.get_session("chat")
    assert view.status == "PAUSED" and not view.generating and view.has_logits
    assert view.token_ids == saved.token_ids
    assert not second.has_unfinished_requests()  # nothing runs until it is used
    assert torch.equal(second.get_logits("chat"), first.get_logits("chat"))
    assert [s.token_id for s in second.resample("chat", n=2)] == \
        [s.token_id for s in first.resample("chat", n=2)]

    tokens, logits = continue_session(second, "chat")
    assert second.stats.kv_loaded_tokens > 0  # its full blocks came from the store
    ref_tokens, ref_logits = continue_session(first, "chat")
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)
    for engine in (first, second):
        engine.close("chat")
        assert engine.kv_pool_all_free


def test_a_restore_from_bytes_is_paused_and_one_without_logits_computes(tiny_models) -> None:
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder)
    engine.add_request("s", prompt_ids(9), session=True)
    settle_session(engine, "s")
    snapshot = engine.save_session("s")

    assert engine.restore_session(snapshot.to_bytes(), "copy") == "copy"
    assert engine.get_session("copy").status == "PAUSED"
    assert torch.equal(engine.get_logits("copy"), engine.get_logits("s"))
    engine.resume("copy", GREEDY)  # its first token from the stored logits, then computes
    settle_session(engine, "copy")
    assert len(engine.get_session("copy").token_ids) == 9 + 5

    bare = dataclasses.replace(snapshot, logits=None)  # e.g. saved for another vocabulary
    engine.restore_session(bare, "bare")
    assert engine.get_session("bare").status == "WAITING"  # computing its last logits
    settle_session(engine, "bare")
    assert engine.get_session("bare").status == "PAUSED"
    torch.testing.assert_close(engine.get_logits("bare"), engine.get_logits("s"))
    for sid in ("s", "copy", "bare"):
        engine.close(sid)
    assert engine.kv_pool_all_free
