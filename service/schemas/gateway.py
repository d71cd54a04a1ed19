"""What a routing gateway reads from a replica: GET /v1/loads, in the shape the SGLang model
gateway (SMG) polls from an HTTP worker (one entry per data-parallel
rank; a replica here is one rank). SMG leaves a worker whose waiting requests or KV-cache usage
pass its thresholds out of routing, and its cache-aware policy balances by these figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone

from pydantic import BaseModel, Field

from service.engines.base import EngineLoad


class RankLoad(BaseModel):
    dp_rank: int = 0
    num_running_reqs: int = Field(description="requests holding a KV-cache row (decoding or prefilling)")
    num_waiting_reqs: int = Field(description="requests queued for a row or for KV blocks")
    num_total_reqs: int = Field(description="running + waiting")
    num_used_tokens: int = Field(description="KV-cache tokens some sequence holds (blocks in use x block size)")
    max_total_num_tokens: int = Field(description="KV-cache tokens of the block pools")
    token_usage: float = Field(description="num_used_tokens / max_total_num_tokens")
    cache_hit_rate: float = Field(description="prompt tokens read from the prefix cache / looked up, since load")
    max_running_requests: int = Field(description="rows (TSERVE_MAX_BATCH per generative model)")


class WorkerLoads(BaseModel):
    timestamp: str
    dp_rank_count: int = 1
    loads: list[RankLoad]


def worker_loads(engines: Iterable[EngineLoad]) -> WorkerLoads:
    """The loaded generative models' loads summed into one rank (requests and tokens add up; the
    ratios are of the sums)."""
    engines = list(engines)
    running, waiting = sum(e.running for e in engines), sum(e.waiting for e in engines)
    used, capacity = sum(e.used_tokens for e in engines), sum(e.capacity_tokens for e in engines)
    hits, queries = sum(e.prefix_hit_tokens for e in engines), sum(e.prefix_query_tokens for e in engines)
    rank = RankLoad(num_running_reqs=running, num_waiting_reqs=waiting, num_total_reqs=running + waiting,
                    num_used_tokens=used, max_total_num_tokens=capacity,
                    token_usage=used / capacity if capacity else 0.0,
                    cache_hit_rate=hits / queries if queries else 0.0,
                    max_running_requests=sum(e.max_running for e in engines))
    return WorkerLoads(timestamp=datetime.now(timezone.utc).isoformat(), loads=[rank])
