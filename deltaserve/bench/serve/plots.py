"""PNG charts of a results document against concurrency (matplotlib, imported only here: the `bench` extra).

  - ttft.png: TTFT median, P90 and P99;
  - throughput_per_gpu.png: output and total tokens/s per GPU;
  - hit_rate.png: prefix-cache hit rate from usage and from /metrics beside the oracle's;
  - summary.png: the three side by side.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from deltaserve.bench.serve.report import lookup


def require_matplotlib() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; ValueError saying what to install without it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'deltaserve[bench]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(levels: Sequence[dict], *path: str) -> list[float | None]:
    return [lookup(level, path) for level in levels]


@dataclass(frozen=True)
class Chart:
    """One chart: its file name, title, y label and lines (label, values per level)."""

    name: str
    title: str
    ylabel: str
    lines: list[tuple[str, list[float | None]]]
    percent: bool = False


# a marker and dash per line, so lines that coincide (a hit rate at its oracle) stay visible
_STYLES = ({"marker": "o", "linestyle": "-"}, {"marker": "x", "linestyle": "--", "markersize": 9},
           {"marker": "s", "linestyle": ":", "markerfacecolor": "none", "markersize": 9})


def _draw(ax: Any, chart: Chart, concurrency: list[int]) -> None:
    for (label, values), style in zip(chart.lines, _STYLES, strict=False):
        points = [(c, v) for c, v in zip(concurrency, values, strict=True) if v is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, [100 * y for y in ys] if chart.percent else ys, label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrency, [str(c) for c in concurrency])
    ax.minorticks_off()
    ax.set_xlabel("concurrency")
    ax.set_ylabel(chart.ylabel)
    ax.set_title(chart.title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if chart.percent:
        ax.set_ylim(0, 100)
    else:
        ax.set_ylim(bottom=0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def charts(document: dict) -> list[Chart]:
    """The charts of a results document."""
    levels = document["levels"]
    block = document["config"]["oracle_block_size"]
    return [
        Chart("ttft.png", "Time to first token", "TTFT (ms)",
              [(name, _series(levels, "ttft_ms", key)) for name, key in (("median", "median"), ("P90", "p90"),
                                                                         ("P99", "p99"))]),
        Chart("throughput_per_gpu.png", "Throughput per GPU", "tokens/s per GPU",
              [("output", _series(levels, "output_tokens_per_s_per_gpu")),
               ("total (input + output)", _series(levels, "total_tokens_per_s_per_gpu"))]),
        Chart("hit_rate.png", "Prefix-cache hit rate", "% of prompt tokens",
              [("server usage (cached_tokens)", _series(levels, "prefix_cache", "usage_hit_rate")),
               ("server /metrics", _series(levels, "prefix_cache", "metrics_hit_rate")),
               (f"oracle (infinite cache, {block}-token blocks)", _series(levels, "prefix_cache", "oracle_hit_rate"))],
              percent=True),
    ]


def write_plots(document: dict, out_dir: str) -> list[str]:
    """Write each chart of `document` (a results document) into out_dir, and all three side by side
    in summary.png; returns their paths."""
    plt = require_matplotlib()
    os.makedirs(out_dir, exist_ok=True)
    concurrency = [level["concurrency"] for level in document["levels"]]
    config = document["config"]
    subtitle = f"{config['workload']} workload, {config['model']}, {config['num_gpus']} GPU(s)"
    paths = []
    document_charts = charts(document)
    for chart in document_charts:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        _draw(ax, replace(chart, title=f"{chart.title}\n{subtitle}"), concurrency)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, chart.name))
        fig.savefig(paths[-1])
        plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), dpi=100)
    for ax, chart in zip(axes, document_charts, strict=True):
        _draw(ax, chart, concurrency)
    fig.suptitle(subtitle, fontsize=11)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "summary.png"))
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths
