"""`EngineStats`: a snapshot of the engine's counters (what a metrics endpoint exports)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class EngineStats:
    """Engine-wide counters since start; token counts are tokens, not blocks.

    `prefix_cache_queries` counts prompt, fragment and recompute tokens that could have come
    from the prefix cache (all but each one's last token), `prefix_cache_hits` those that did.
    """

    num_steps: int
    num_preemptions: int
    num_recomputed_tokens: int
    num_computed_tokens: int  # positions the model computed (prompts, fragments, decodes)
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_cached_kv_blocks: int
    num_evicted_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    # KV connector (0 without one): tokens whose K/V was loaded from the store, tokens
    # computed in gaps of a match (blocks the store lacked or failed to load), tokens whose
    # load failed, and blocks saved to the store.
    kv_loaded_tokens: int = 0
    kv_gap_tokens: int = 0
    kv_load_failed_tokens: int = 0
    kv_saved_blocks: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries (0 before any query)."""
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Share of the KV pool referenced by requests (cached free blocks are not in use)."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks

    def as_dict(self) -> dict[str, Any]:
        """Every counter and derived rate by name."""
        return {
            **asdict(self),
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "kv_cache_usage": self.kv_cache_usage,
        }
