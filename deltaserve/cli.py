"""The `deltaserve` command: `generate`, `serve`, `proxy`, `make-model`, `bench cache-sim` and `bench serve`."""

from __future__ import annotations

import argparse
import logging
import sys

from deltaserve.config.engine_config import EngineConfig

_ENGINE_FLAGS: list[tuple[str, dict]] = [
    ("--model", dict(default=None, help="checkpoint directory (default: the embedded tiny model)")),
    ("--tokenizer", dict(default=None, help="tokenizer directory (default: the model's)")),
    ("--trust-remote-code", dict(action="store_true", help="let transformers run the checkpoint's own code")),
    ("--dtype", dict(default="auto", help="auto | float32 | float16 | bfloat16")),
    ("--device", dict(default=None, help="cpu | cuda | cuda:N (default: cuda when available)")),
    ("--max-num-seqs", dict(type=int, default=EngineConfig.max_num_seqs)),
    ("--max-num-batched-tokens", dict(type=int, default=EngineConfig.max_num_batched_tokens)),
    ("--max-prefill-tokens-with-decodes", dict(type=int, default=0,
                                               help="prefill tokens a step may take while it also decodes (0: up "
                                                    "to --max-num-batched-tokens): bounds TPOT under long prompts")),
    ("--block-size", dict(type=int, default=EngineConfig.block_size)),
    ("--max-model-len", dict(type=int, default=None)),
    ("--cache-memory", dict(default=None, help="bytes for KV cache + state pool, e.g. 2GiB")),
    ("--gpu-memory-utilization", dict(type=float, default=EngineConfig.gpu_memory_utilization)),
    ("--enforce-eager", dict(action="store_true")),
    ("--max-logprobs", dict(type=int, default=EngineConfig.max_logprobs,
                            help="the most logprobs a request may ask for per token")),
    ("--enable-prefix-caching", dict(action=argparse.BooleanOptionalAction, default=True,
                                     help="cache KV blocks and KDA state checkpoints across requests")),
    ("--async-scheduling", dict(action=argparse.BooleanOptionalAction, default=None,
                                help="schedule the next step while the device runs this one (default: on "
                                     "with CUDA, off on the CPU)")),
    ("--state-checkpoint-interval", dict(type=int, default=None,
                                         help="tokens between state checkpoint rungs (a multiple of block size)")),
    ("--state-checkpoint-fraction", dict(type=float, default=EngineConfig.state_checkpoint_fraction,
                                         help="share of the cache kept for KDA state checkpoints")),
    ("--tensor-parallel-size", dict(type=int, default=1, help="tensor-parallel ranks per pipeline stage")),
    ("--pipeline-parallel-size", dict(type=int, default=1, help="pipeline stages (contiguous layer ranges)")),
    ("--pp-max-inflight", dict(type=int, default=0,
                               help="batches in flight through the pipeline (0: one per stage)")),
    ("--decode-context-parallel-size", dict(type=int, default=1,
                                            help="TP ranks that split each request's MLA latents (divides -tp)")),
    ("--dcp-kv-cache-interleave-size", dict(type=int, default=1,
                                            help="consecutive tokens per DCP rank (divides the block size)")),
    ("--enable-expert-parallel", dict(action="store_true",
                                      help="each TP rank holds num_experts / -tp whole MoE experts instead of a "
                                           "slice of every expert (no effect at -tp 1)")),
    ("--kv-transfer-config", dict(default=None, metavar="JSON",
                                  help='prefill/decode disaggregation, e.g. \'{"kv_connector": "NixlConnector", '
                                       '"kv_role": "kv_producer"}\' (MooncakeConnector also; kv_role kv_consumer '
                                       'for a decode server)')),
    ("--speculative-config", dict(default=None, metavar="JSON",
                                  help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": '
                                       '3, "prompt_lookup_max": 4}\'')),
    ("--kv-offloading-size", dict(default=None, metavar="BYTES",
                                  help="offload tier in host memory, summed over the ranks, e.g. 64GiB (with "
                                       "prefix caching: KV chunks and KDA state images behind HBM)")),
    ("--kv-offloading-disk-path", dict(default=None, metavar="DIR",
                                       help="offload tier on disk in this directory (one subdirectory per rank)")),
    ("--kv-offloading-disk-size", dict(default=None, metavar="BYTES",
                                       help="bytes the disk tier may take, summed over the ranks")),
    ("--kv-offloading-remote", dict(default=None, metavar="URL",
                                    help="a Mooncake Store shared across engines, mooncake://MASTER:RPC_PORT")),
    ("--kv-offloading-chunk-size", dict(type=int, default=EngineConfig.kv_offloading_chunk_size,
                                        help="tokens per stored KV chunk (a multiple of the block size x DCP); "
                                             "checkpoints sit on this grid")),
    ("--kv-offloading-max-pending-saves", dict(type=int, default=None,
                                               help="saves in flight to the tier (default: 2 x the pipeline "
                                                    "stage count); more are skipped")),
    ("--kv-offloading-admission", dict(default="all", choices=("all", "cache_control"),
                                       help="which requests the tier saves: all, or cache_control (only those "
                                            "whose request carries cache_control: {\"type\": \"ephemeral\"})")),
    ("--distributed-executor-backend", dict(default=None,
                                            help="uniproc | mp (default: mp with more than one rank)")),
    ("--nnodes", dict(type=int, default=1, help="nodes the ranks span (each runs world size / nnodes ranks)")),
    ("--node-rank", dict(type=int, default=0,
                         help="this node (0: the head, which runs the engine and serves; others run ranks only)")),
    ("--master-addr", dict(default=None, help="the head node's address (with --nnodes > 1)")),
    ("--master-port", dict(type=int, default=None,
                           help="the head's first of four ports: torch.distributed, then steps, replies, nodes")),
    ("--numa-bind", dict(default=None, help="NUMA node of each local GPU, e.g. 0,0,1,1: binds each rank's CPUs")),
]
_SHORT_FLAGS = {"--tensor-parallel-size": "-tp", "--pipeline-parallel-size": "-pp",
                "--decode-context-parallel-size": "-dcp"}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for flag, kwargs in _ENGINE_FLAGS:
        short = _SHORT_FLAGS.get(flag)
        group.add_argument(*((short, flag) if short else (flag,)), **kwargs)


def engine_options(args: argparse.Namespace) -> dict:
    names = [flag[2:].replace("-", "_") for flag, _ in _ENGINE_FLAGS]
    return {name: getattr(args, name) for name in names if name != "model"}


def _cmd_generate(args: argparse.Namespace) -> int:
    from deltaserve import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
    )
    if args.node_rank:  # a worker node: this node's ranks only, for the head's engine
        return _run_worker_node(EngineConfig(model=args.model, seed=args.seed, **engine_options(args)))
    llm = LLM(model=args.model, seed=args.seed if args.seed is not None else 0, **engine_options(args))
    prompt: str | dict = args.prompt
    if args.prompt_token_ids:
        prompt = {"prompt_token_ids": [int(t) for t in args.prompt.replace(",", " ").split()]}
    try:
        output = llm.generate(prompt, params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    completion = output.outputs[0]
    if llm.get_tokenizer() is None:
        print(" ".join(map(str, completion.token_ids)))
    else:
        print(completion.text)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    from deltaserve.entrypoints.launcher import ServeOptions, serve

    options = ServeOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("DELTASERVE_API_KEY") or None,
        served_model_name=args.served_model_name,
        api_server_count=args.api_server_count,
        shutdown_timeout_s=args.shutdown_timeout,
        max_body_bytes=args.max_request_body_bytes,
        log_stats_interval_s=args.log_stats_interval,
        log_level=args.log_level,
        trust_request_chat_template=args.trust_request_chat_template,
        health_stuck_timeout_s=args.health_stuck_timeout,
        header_timeout_s=args.header_timeout,
        cpu_work_timeout_s=args.cpu_work_timeout,
    )
    config = EngineConfig(model=args.model, seed=args.seed, **engine_options(args))
    if config.node_rank:  # a worker node (--node-rank > 0): no HTTP, this node's ranks only
        return _run_worker_node(config)
    return serve(config, options)


def _cmd_proxy(args: argparse.Namespace) -> int:
    from deltaserve.entrypoints.proxy import ProxyOptions, run_proxy

    options = ProxyOptions(
        prefill_urls=args.prefill, decode_urls=args.decode, host=args.host, port=args.port, policy=args.policy,
        api_key=args.api_key, backend_api_key=args.backend_api_key, timeout_s=args.timeout, log_level=args.log_level,
    )
    return run_proxy(options.validate())  # a bad flag is a ValueError naming it, which main() prints


def _run_worker_node(config: EngineConfig) -> int:
    from deltaserve.executor.worker_node import run_worker_node

    return run_worker_node(config)


def _cmd_make_model(args: argparse.Namespace) -> int:
    from deltaserve.model_files.make_model import make_model

    if args.eagle3:  # a random Eagle3 head for a target of this preset
        import torch

        from deltaserve.model.eagle3 import random_eagle3_head, save_eagle3
        from deltaserve.model_files.presets import preset_config

        target = preset_config(args.preset)
        head = random_eagle3_head(target.vocab_size, target.hidden_size, target.num_hidden_layers,
                                  target.rms_norm_eps, seed=args.seed)
        save_eagle3(head, args.out, getattr(torch, args.dtype or "bfloat16"))
        print(args.out)
        return 0
    path = make_model(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve", description="Serve hybrid linear-attention LLMs.")
    parser.add_argument("--log-level", default=None, help="DEBUG | INFO | WARNING (default: INFO for serve)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the completion")
    gen.add_argument("prompt", help="the prompt text (or ids with --prompt-token-ids)")
    gen.add_argument("--prompt-token-ids", action="store_true", help="read PROMPT as space-separated ids")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(gen)
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000, help="port (0: any free port; the log says which)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or $DELTASERVE_API_KEY)")
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="the name(s) clients use in 'model' (default: the --model path, or deltaserve-tiny)")
    srv.add_argument("--api-server-count", type=int, default=1, help="HTTP front-end processes")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds open requests get to finish after SIGTERM before they are aborted")
    srv.add_argument("--max-request-body-bytes", type=int, default=32 * 2**20)
    srv.add_argument("--log-stats-interval", type=float, default=5.0,
                     help="seconds between throughput/cache log lines while busy (0: off)")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept chat templates sent in requests (chat_template); refused with a 400 otherwise")
    srv.add_argument("--health-stuck-timeout", type=float, default=60.0,
                     help="seconds the engine core may spend in one step before /health answers 503")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a connection gets to send a request's headers before it is closed")
    srv.add_argument("--cpu-work-timeout", type=float, default=10.0,
                     help="seconds tokenizing a long prompt or rendering a chat template may take (else a 400)")
    srv.add_argument("--seed", type=int, default=0)
    add_engine_arguments(srv)
    srv.set_defaults(func=_cmd_serve)

    proxy = sub.add_parser("proxy", help="a prefill/decode disaggregation proxy in front of deltaserve servers")
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers (producers)")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers (consumers)")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.add_argument("--policy", default="round_robin", help="round_robin | least_loaded (legs in flight)")
    proxy.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    proxy.add_argument("--backend-api-key", default=None,
                       help="send 'Authorization: Bearer KEY' to the backends (default: forward the client's header)")
    proxy.add_argument("--timeout", type=float, default=600.0, help="seconds a leg may wait for its backend")
    proxy.set_defaults(func=_cmd_proxy)

    make = sub.add_parser("make-model", help="write a random-weight Kimi Linear checkpoint")
    make.add_argument("--preset", required=True, help="tiny | small | kimi-linear-48b-a3b | kimi-linear-48b-a3b-8l")
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: the preset's)")
    make.add_argument("--eagle3", action="store_true",
                      help="write a random Eagle3 draft head for a target of this preset instead (speculative "
                           "decoding's method eagle3)")
    make.set_defaults(func=_cmd_make_model)

    from deltaserve.kv_transfer.topology import run_topology_command

    topo = sub.add_parser("topology", help="check a prefill -> decode disaggregation topology (no GPU): "
                                           "who reads which layers, heads and tokens, bytes and descriptors")
    topo.add_argument("--prefill", required=True, help="the producer, e.g. pp=8,tp=1")
    topo.add_argument("--decode", required=True, help="the consumer, e.g. tp=8,dcp=8")
    topo.add_argument("--model", default="random:kimi-linear-48b-a3b", help="random:<preset> or a checkpoint dir")
    topo.add_argument("--block-size", type=int, default=16, help="the producer's page, in tokens")
    topo.add_argument("--decode-block-size", type=int, default=16, help="a decode rank's local page, in tokens")
    topo.add_argument("--dcp-interleave", type=int, default=1, help="consecutive tokens per DCP rank")
    topo.add_argument("--prompt-tokens", type=int, default=131072, help="the request the costs are given for")
    topo.add_argument("--staging-chunk-pages", type=int, default=0, help="pages per MLA staging slot (0: off)")
    topo.add_argument("--staging-slots", type=int, default=16, help="MLA staging slots per producer GPU")
    topo.add_argument("--dtype", default="bfloat16", help="latent and conv dtype: bfloat16 | float16 | float32 | fp8")
    topo.add_argument("--chunked-transfer", action="store_true",
                      help="the producer runs chunked_transfer (KV sent while its prefill runs)")
    topo.set_defaults(func=run_topology_command)

    bench = sub.add_parser("bench", help="benchmarks and planning tools")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    sim = bench_sub.add_parser(
        "cache-sim", help="replay a Mooncake trace through the prefix cache (no model): hit rate vs its oracle",
        add_help=False,
    )
    sim.add_argument("options", nargs="*", help="--trace, --kv-blocks, --intervals, --max-requests, ...")
    from deltaserve.bench.serve import cli as bench_serve_cli

    bench_serve = bench_sub.add_parser(
        "serve", help="a serving benchmark (agentic sessions, Mooncake trace, random) against any OpenAI server",
    )
    bench_serve_cli.add_arguments(bench_serve)
    bench_serve.set_defaults(func=bench_serve_cli.run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "cache-sim"]:  # its options belong to the simulator's own parser
        from deltaserve.bench.cache_sim import main as cache_sim_main

        cache_sim_main(argv[2:])
        return 0
    args = parser.parse_args(argv)
    if args.log_level is None:
        args.log_level = "INFO" if args.command in ("serve", "proxy") else "WARNING"
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"deltaserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
