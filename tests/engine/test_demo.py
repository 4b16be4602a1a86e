"""`make demo`'s madlibs scene on the real Gemma 3 270M: the story runs as one session, each
append is timed against a re-submission that reuses nothing, and the last blank's likeliest
words come from the stored logits. (The fork/join scene: tests/engine/fork_join_scene.py.)"""

from __future__ import annotations

import pytest

from loom.demo import TEMPLATE, print_table, run_madlibs

pytestmark = pytest.mark.slow


def test_madlibs_story_table_and_stored_logits(gemma_engine, capsys):
    hits_before = gemma_engine.stats.prefix_cache_hits
    recomputed_before = gemma_engine.num_recomputed_tokens
    timings, words = run_madlibs(gemma_engine)
    assert len(timings) == len(TEMPLATE) - 1
    contexts = [t.context for t in timings]
    assert contexts == sorted(contexts) and all(t.num_tokens > 0 for t in timings)
    assert all(t.live_s > 0 and t.resubmit_s > 0 for t in timings)
    # Each re-submission found the prefix cache emptied: nothing of the story was a hit.
    assert gemma_engine.stats.prefix_cache_hits == hits_before
    assert len(words.texts) == 3 and all(words.texts) and words.seconds > 0
    assert gemma_engine.num_recomputed_tokens == recomputed_before
    assert gemma_engine.kv_pool_all_free
    print_table(timings, words)
    table = capsys.readouterr().out
    assert "prefix cache\nemptied first" in table and "without computing a token" in table
