"""`deltaserve bench serve`: a serving benchmark against any OpenAI-compatible server.

Modules by job: `workloads` (random, trace) and `agentic` make requests as plain data, with
`trace_mapper` and `tokens` for their token ids; `client` sends one streamed request and records its
timestamps; `runner` runs one concurrency level; `metrics` turns records into numbers; `sweep` runs
every level; `report` and `plots` write the table, JSON and charts; `cli` holds the flags.
"""
