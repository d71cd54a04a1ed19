"""Prometheus metrics: one prefix (``tserve_``), units in names, a ``model`` label everywhere.

Each app instance owns its own registry, so several apps (tests, replicas in one process)
never share or double-register series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import generate_latest

PREFIX = "tserve"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        disable_created_metrics()  # the *_created series double the scrape and no dashboard uses them
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def name(n: str) -> str:
            return f"{PREFIX}_{n}"

        self.requests = Counter(name("requests"), "HTTP requests by endpoint and status code.",
                                ["model", "endpoint", "status"], registry=r)
        self.request_duration = Histogram(name("request_duration_seconds"),
                                          "End-to-end request latency, first byte in to last byte out.",
                                          ["model", "endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(name("time_to_first_token_seconds"), "Arrival to first generated token.",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(name("inter_token_latency_seconds"), "Time between consecutive tokens of a sequence.",
                             ["model"], buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(name("queue_time_seconds"), "Arrival to admission into a KV-cache slot.",
                                    ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt (or source) tokens processed.",
                                     ["model"], registry=r)
        self.generated_tokens = Counter(name("generated_tokens"), "Tokens generated.", ["model"], registry=r)
        self.running = Gauge(name("running_requests"), "Requests holding a KV-cache slot (or in a forward pass).",
                             ["model"], registry=r)
        self.waiting = Gauge(name("waiting_requests"), "Requests queued for a slot.", ["model"], registry=r)
        self.slots_used = Gauge(name("kv_cache_slots_used"), "Sequence rows in use (the batch cap).", ["model"],
                                registry=r)
        self.slots_total = Gauge(name("kv_cache_slots"), "Sequence rows (TSERVE_MAX_BATCH).", ["model"], registry=r)
        self.kv_blocks_used = Gauge(name("kv_cache_blocks_used"), "KV-cache blocks some sequence references.",
                                    ["model"], registry=r)
        self.kv_blocks = Gauge(name("kv_cache_blocks"), "KV-cache blocks in the pool (capacity).", ["model"],
                               registry=r)
        self.kv_usage = Gauge(name("kv_cache_usage_ratio"), "Fraction of the KV-cache blocks in use.", ["model"],
                              registry=r)
        self.preemptions = Counter(name("preemptions"), "Sequences that gave their KV blocks back to let others "
                                   "go on (they resume later, same output).", ["model"], registry=r)
        self.draft_tokens = Counter(name("spec_draft_tokens"), "Speculative decoding: draft tokens fed for "
                                    "verification (prompt lookup).", ["model"], registry=r)
        self.accepted_tokens = Counter(name("spec_accepted_tokens"), "Speculative decoding: draft tokens the model "
                                       "agreed with and kept (a share of tserve_generated_tokens_total).", ["model"],
                                       registry=r)
        self.acceptance = Gauge(name("spec_acceptance_ratio"), "Speculative decoding: accepted / drafted tokens "
                                "since the model loaded.", ["model"], registry=r)
        self.batch_size = Gauge(name("batch_size"), "Sequences in the latest engine step.", ["model"], registry=r)
        self.step_batch = Histogram(name("step_batch_size"), "Sequences per engine step (forward pass).",
                                    ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.steps = Counter(name("engine_steps"), "Engine steps (each one batched forward pass or two).",
                             ["model"], registry=r)
        self.prefix_hit_tokens = Counter(name("prefix_cache_hit_tokens"),
                                         "Prompt tokens read from the prefix cache's blocks instead of computed.",
                                         ["model"], registry=r)
        self.prefix_query_tokens = Counter(name("prefix_cache_query_tokens"),
                                           "Prompt tokens looked up in the prefix cache (hit rate: hit / query).",
                                           ["model"], registry=r)
        self.prefix_blocks_used = Gauge(name("prefix_cache_blocks_used"), "KV-cache blocks named by the prefix "
                                        "cache (in use or kept for reuse).", ["model"], registry=r)
        self.decode_step = Gauge(name("decode_step_info"), "1 for the decode step each generative model runs: "
                                 "native (C++), python, python+native-attention (the native library's decode "
                                 "attention) or triton.", ["model", "step"], registry=r)
        self.grammar_compile = Histogram(name("grammar_compile_seconds"), "Compiling one grammar (JSON schema, "
                                         "regex, choice, Lark, tool call), cache misses only.", ["model"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.grammar_cache_hits = Counter(name("grammar_cache_hits"), "Constrained requests whose grammar was "
                                          "already compiled.", ["model"], registry=r)
        self.constrained_tokens = Counter(name("constrained_tokens"), "Tokens chosen under a grammar (a share of "
                                          "the generated tokens).", ["model"], registry=r)
        self.rejected = Counter(name("rejected_requests"), "Requests refused before reaching the engine's queue.",
                                ["model", "reason"], registry=r)

        self.load_seconds = Histogram(name("model_load_seconds"), "Loading one model: read, prepare, warm up "
                                      "(at start-up or on demand).", ["model"], buckets=LOAD_BUCKETS, registry=r)
        self.model_loaded = Gauge(name("model_loaded"), "1 while the model is loaded, 0 while only available.",
                                  ["model"], registry=r)
        self.model_memory = Gauge(name("model_memory_bytes"), "Bytes a loaded model holds: weights (with the "
                                  "copies serving adds) or KV caches; 0 once unloaded.", ["model", "kind"], registry=r)
        self.evictions = Counter(name("model_evictions"), "Models unloaded to load another within "
                                 "TSERVE_MEMORY_BUDGET.", ["model"], registry=r)
        self.unloads = Counter(name("model_unloads"), "Models unloaded, by reason: budget (evicted), keep_alive "
                               "(idle), request (POST /models/unload).", ["model", "reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
