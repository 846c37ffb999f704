"""Benchmarks and planning tools: `cache_sim` replays a trace through the scheduler and caches with no
model; `serve` benchmarks any OpenAI-compatible server (`deltaserve bench serve`)."""
