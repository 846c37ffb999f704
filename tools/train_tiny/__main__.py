"""`python -m tools.train_tiny {prepare,train,eagle3,evaluate,install,shapes} ...` (see README.md)."""

from __future__ import annotations

import argparse
import json
import sys


def _prepare(ns: argparse.Namespace) -> None:
    from tools.train_tiny.prepare import prepare

    meta = prepare(ns.out, root=ns.root, vocab_size=ns.vocab_size, held_out_per_10k=ns.held_out_per_10k,
                   manifest_path=ns.manifest, max_files=ns.max_files)
    print(json.dumps(meta, indent=2))


def _shapes(ns: argparse.Namespace) -> None:
    from tools.train_tiny.models import SHAPES, parameter_count, shape_config

    for name in SHAPES:
        c = parameter_count(shape_config(name, ns.vocab_size, 0, 1, 2))
        print(f"{name}: total {c.total:,} active {c.active:,}")


def main(argv: list[str] | None = None) -> None:
    from tools.train_tiny.cli_args import add_dataclass_args, dataclass_from_args
    from tools.train_tiny.corpus import DEFAULT_HELD_OUT_PER_10K
    from tools.train_tiny.evaluate import EvalArgs, evaluate
    from tools.train_tiny.install import InstallArgs, install
    from tools.train_tiny.prepare import DEFAULT_VOCAB_SIZE
    from tools.train_tiny.train import TrainArgs, train
    from tools.train_tiny.train_eagle3 import Eagle3Args, train_eagle3

    parser = argparse.ArgumentParser(prog="python -m tools.train_tiny", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="list the stdlib corpus, train the tokenizer, write train/val .bin")
    p.add_argument("--out", required=True, help="the data directory to write (carry it to the GPU)")
    p.add_argument("--root", default=None, help="stdlib directory (default: this interpreter's)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--held-out-per-10k", type=int, default=DEFAULT_HELD_OUT_PER_10K)
    p.add_argument("--manifest", default=None, help="also copy corpus_files.txt/.json here")
    p.add_argument("--max-files", type=int, default=None, help="first n files per split (micro runs)")
    p.set_defaults(run=_prepare)
    p = sub.add_parser("train", help="train the target or the draft LM (resumable)")
    add_dataclass_args(p, TrainArgs)
    p.set_defaults(run=lambda ns: train(dataclass_from_args(TrainArgs, ns)))
    p = sub.add_parser("eagle3", help="train the Eagle3 head on a frozen exported target (resumable)")
    add_dataclass_args(p, Eagle3Args)
    p.set_defaults(run=lambda ns: train_eagle3(dataclass_from_args(Eagle3Args, ns)))
    p = sub.add_parser("evaluate", help="held-out loss, bits per byte, baselines, completions -> JSON")
    add_dataclass_args(p, EvalArgs)
    p.set_defaults(run=lambda ns: evaluate(dataclass_from_args(EvalArgs, ns)))
    p = sub.add_parser("install", help="copy the exports into deltaserve's package and compute reference.json")
    add_dataclass_args(p, InstallArgs)
    p.set_defaults(run=lambda ns: install(dataclass_from_args(InstallArgs, ns)))
    p = sub.add_parser("shapes", help="parameter counts of the model shapes")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.set_defaults(run=_shapes)
    ns = parser.parse_args(argv)
    ns.run(ns)


if __name__ == "__main__":
    main(sys.argv[1:])
