"""`deltaserve bench serve`: its flags, and the run from flags to table, JSON and charts.

Examples:
  deltaserve bench serve --workload random --concurrency 1,8,32 --num-requests 200
  deltaserve bench serve --workload agentic --concurrency 8,32,64 --duration 300 --num-gpus 8 --out r.json --plot plots/
  deltaserve bench serve --workload trace --trace mooncake.jsonl --trace-time-scale 0.5 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence

from deltaserve.bench.serve.agentic import AgenticConfig
from deltaserve.bench.serve.config import REQUESTS_PER_SLOT, WORKLOADS, BenchConfig
from deltaserve.bench.serve.workloads import TRACE_REPLAY_MODES, RandomConfig, TraceConfig

EXIT_INTERRUPTED = 130  # as a shell reports a command ended by Ctrl-C


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,8,32") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one value, e.g. 1,8,32")
    return values


def _range(cast: type) -> object:
    def parse(text: str) -> tuple:
        lo, sep, hi = text.partition(":")
        try:
            return (cast(lo), cast(hi)) if sep else (cast(lo), cast(lo))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not N or LO:HI") from None

    parse.__name__ = f"{cast.__name__} range"
    return parse


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"min_tokens\": 16}'")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `deltaserve bench serve` (shared by `deltaserve.cli` and `main`)."""
    b = BenchConfig()
    a = AgenticConfig()
    r = RandomConfig()
    run = parser.add_argument_group("run")
    run.add_argument("--base-url", default=b.base_url,
                     help="the server's root URL (a trailing /v1 is fine)")
    run.add_argument("--endpoint", default=b.endpoint, help="the completions route (prompts go as token ids)")
    run.add_argument("--model", default=None, help="the model name to send (default: the first in /v1/models)")
    run.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (or $OPENAI_API_KEY)")
    run.add_argument("--workload", choices=WORKLOADS, default="random")
    run.add_argument("--concurrency", type=_int_list, default=[1, 8, 32, 64],
                     help="comma-separated levels: requests (agentic: sessions) in flight (default 1,8,32,64)")
    run.add_argument("--num-requests", type=int, default=None,
                     help=f"requests per level (default: {REQUESTS_PER_SLOT} x concurrency, unless --duration)")
    run.add_argument("--duration", type=float, default=None, help="seconds per level: no request is sent after it")
    run.add_argument("--num-gpus", type=int, default=b.num_gpus,
                     help="GPUs behind the server, for the per-GPU throughput")
    run.add_argument("--seed", type=int, default=b.seed, help="fixes every length drawn (so the token totals)")
    run.add_argument("--salt", type=int, default=None,
                     help="fixes the token ids too (default: a fresh salt per run, so a rerun is not served from "
                          "the cache the last one left; the JSON records it)")
    run.add_argument("--out", default=None, help="write the results here (JSON)")
    run.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here (needs matplotlib)")
    run.add_argument("--save-requests", action="store_true", help="also put every request's timings in the JSON")
    run.add_argument("--vocab-size", type=int, default=None,
                     help="prompt ids are drawn from [0, N) (default: the server's, which deltaserve reports; "
                          "required for other servers)")
    run.add_argument("--max-model-len", type=int, default=None,
                     help="the context limit the client plans for (default: the server's, from /v1/models)")
    run.add_argument("--request-timeout", type=float, default=b.request_timeout_s,
                     help="seconds without a byte before a request fails")
    run.add_argument("--temperature", type=float, default=b.temperature, help="0 is greedy (vLLM bench's default)")
    run.add_argument("--no-return-token-ids", dest="return_token_ids", action="store_false",
                     help="do not send vLLM's return_token_ids (for servers that refuse it)")
    run.add_argument("--extra-body", type=_json_object, default={}, help="JSON fields added to every request")
    run.add_argument("--oracle-block-size", type=int, default=b.oracle_block_size,
                     help="block size of the infinite-cache oracle (default 16, deltaserve's and vLLM's)")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    rnd = parser.add_argument_group("random workload")
    rnd.add_argument("--random-input-len", type=int, default=r.input_len)
    rnd.add_argument("--random-output-len", type=int, default=r.output_len)
    rnd.add_argument("--random-range-ratio", type=float, default=r.range_ratio,
                     help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    rnd.add_argument("--random-prefix-len", type=int, default=r.prefix_len, help="a shared prefix before each prompt")

    trc = parser.add_argument_group("trace workload (Mooncake format)")
    trc.add_argument("--trace", default=None, metavar="FILE", help="one JSON object a line: timestamp (ms), "
                     "input_length, output_length, hash_ids (512-token blocks)")
    trc.add_argument("--trace-replay", choices=TRACE_REPLAY_MODES, default="timestamps",
                     help="send at the trace's timestamps (at most --concurrency in flight), or at fixed concurrency")
    trc.add_argument("--trace-time-scale", type=float, default=1.0,
                     help="multiplies the gaps: 0.5 replays twice as fast")
    trc.add_argument("--trace-max-output-len", type=int, default=None, help="cap each record's output_length")

    agt = parser.add_argument_group("agentic workload (lengths in tokens; ranges as N or LO:HI)")
    agt.add_argument("--agentic-system-len", type=int, default=a.system_prompt_len, help="shared system prompt")
    agt.add_argument("--agentic-tools-len", type=int, default=a.tool_definitions_len, help="shared tool definitions")
    agt.add_argument("--agentic-user-len", type=int, default=a.user_prompt_len, help="the first user message")
    agt.add_argument("--agentic-tool-result-len", type=_range(int), default=a.tool_result_len,
                     help="each turn's tool result (default %(default)s)")
    agt.add_argument("--agentic-answer-len", type=_range(int), default=a.answer_len,
                     help="each turn's output (default %(default)s)")
    agt.add_argument("--agentic-target-context", type=int, default=a.target_context_len,
                     help="a session ends before its context passes this (capped by the server's max_model_len)")
    agt.add_argument("--agentic-think-time", type=_range(float), default=a.think_time_s,
                     help="seconds between a session's turns (default 0)")
    agt.add_argument("--agentic-cache-bust", action=argparse.BooleanOptionalAction, default=a.cache_bust,
                     help="start each session with a unique prefix, so its first turn is a cold prefill")
    agt.add_argument("--agentic-cache-bust-len", type=int, default=a.cache_bust_len)
    agt.add_argument("--agentic-cache-control", action=argparse.BooleanOptionalAction, default=a.cache_control,
                     help="send cache_control: {\"type\": \"ephemeral\"} on every turn but a session's known last "
                          "(deltaserve's --kv-offloading-admission cache_control keeps only those in its tier)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of parsed flags (ValueError naming the flag when a value cannot be served)."""
    trace = None
    if args.trace is not None:
        trace = TraceConfig(args.trace, args.trace_replay, args.trace_time_scale, args.trace_max_output_len)
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None, workload=args.workload,
        concurrency=args.concurrency, num_requests=args.num_requests, duration_s=args.duration,
        num_gpus=args.num_gpus, seed=args.seed, salt=args.salt, out=args.out, plot_dir=args.plot,
        save_requests=args.save_requests,
        vocab_size=args.vocab_size, max_model_len=args.max_model_len, request_timeout_s=args.request_timeout,
        temperature=args.temperature, return_token_ids=args.return_token_ids, extra_body=args.extra_body,
        oracle_block_size=args.oracle_block_size, progress=args.progress,
        random=RandomConfig(args.random_input_len, args.random_output_len, args.random_range_ratio,
                            args.random_prefix_len),
        trace=trace,
        agentic=AgenticConfig(
            args.agentic_system_len, args.agentic_tools_len, args.agentic_user_len, args.agentic_tool_result_len,
            args.agentic_answer_len, args.agentic_target_context, args.agentic_think_time, args.agentic_cache_bust,
            args.agentic_cache_bust_len, args.agentic_cache_control,
        ),
    )


def run(config: BenchConfig) -> int:
    """Run, print the table (and errors), write the JSON and charts; 0, or 130 after Ctrl-C."""
    from deltaserve.bench.serve import report
    from deltaserve.bench.serve.sweep import run_sweep

    if config.plot_dir:
        from deltaserve.bench.serve.plots import require_matplotlib

        require_matplotlib()  # before the run, not after it
    document = asyncio.run(run_sweep(config, observer=report.ProgressBar(config.progress)))
    if config.out:
        report.write_json(document, config.out)
    print(report.format_table(document["levels"]))
    errors = report.format_errors(document["levels"])
    if errors:
        print("errors:\n" + errors)
    if config.out:
        print(f"wrote {config.out}")
    if config.plot_dir and document["levels"]:
        from deltaserve.bench.serve.plots import write_plots

        for path in write_plots(document, config.plot_dir):
            print(f"wrote {path}")
    if document["interrupted"]:
        print("interrupted: the results hold what was measured until Ctrl-C", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def run_from_args(args: argparse.Namespace) -> int:
    try:
        return run(config_from_args(args))
    except (ValueError, OSError) as e:
        print(f"deltaserve bench serve: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m deltaserve.bench.serve` (the same as `deltaserve bench serve`)."""
    parser = argparse.ArgumentParser(prog="deltaserve bench serve", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
