"""Latency and throughput against load, one line per server or setting."""

from __future__ import annotations

from pathlib import Path

PANELS = (("output_tok_s", None, "output tokens/s"), ("ttft_s", "p50", "TTFT p50 (s)"),
          ("ttft_s", "p99", "TTFT p99 (s)"), ("itl_s", "p50", "ITL p50 (s)"), ("itl_s", "p99", "ITL p99 (s)"),
          ("e2e_s", "p99", "end-to-end p99 (s)"))


def plot_sweeps(series: dict[str, list[dict]], path: str | Path, title: str = "") -> None:
    """`series` maps a name to its sweep (the `levels` of a result file), each level with `load` and figures."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(2, 3, figsize=(14, 8))
    for axis, (metric, stat, label) in zip(axes.flat, PANELS, strict=True):
        for name, levels in series.items():
            xs = [level["load"] for level in levels]
            ys = [level[metric] if stat is None else level[metric][stat] for level in levels]
            axis.plot(xs, ys, marker="o", label=name)
        axis.set_xlabel(levels[0]["load_kind"] if series else "load")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes.flat[0].legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
