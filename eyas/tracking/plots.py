"""PNG figures for MLflow: TTT curves per step, accepted-length histograms, per-position acceptance.

Pure functions from the numbers the stages already hold to ``matplotlib.figure.Figure`` objects
(no pyplot: no global state, no display, the process's backend untouched; each figure gets its
own Agg canvas). Log one with
``tracker.log_figure(fig, "name.png")`` (eyas.tracking.runs) or save it with :func:`save_png`.

- :func:`ttt_curves_figure`: ``TrainResult.curve`` rows (``step``, ``split`` in
  {train, val}, ``loss``, ``loss_k``, ``acc_k``, ...) -> loss and acc_k per TTT step k.
- :func:`accept_len_figure`: an eval-accept-len metrics dict (``metrics/eval_<drafter>.json``:
  ``{bench: {accepted_histogram, per_position_accept_rate, accept_len, ...}, "ngram": {bench:
  {...}}}``) -> one row per benchmark: the histogram of accepted draft tokens per verify step
  beside the mean (gpt-fast's ``accept_counts``), and the per-position acceptance rate, each with
  the n-gram floor next to the drafter; with ``accept_len_by_chain_length`` (eyas/eval/oracle.py)
  a third panel: acceptance length against chain length 1..k.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

_STEP_KEY = re.compile(r"^(loss|acc|full_acc|cond_acc)_(\d+)$")


def _new_figure(**kw) -> Figure:
    fig = Figure(dpi=100, layout="constrained", **kw)
    FigureCanvasAgg(fig)  # render with Agg whatever backend pyplot may use elsewhere
    return fig


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if _finite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _ttt_steps(rows: list[dict], prefix: str) -> list[int]:
    ks = {int(m.group(2)) for r in rows for k in r if (m := _STEP_KEY.match(k)) and m.group(1) == prefix}
    return sorted(ks)


def ttt_curves_figure(curve: list[dict], title: str | None = None) -> Figure:
    """Loss and accuracy per TTT step k against the optimizer step.

    Left: train ``loss`` (the weighted TTT loss) and val ``loss_k``. Right: val ``acc_k``
    (solid, markers) and train ``acc_k`` (faint). Non-finite values (NaN for a step with no
    eligible tokens) are skipped. An empty curve gives a figure that says so.
    """
    train = [r for r in curve if r.get("split") == "train"]
    val = [r for r in curve if r.get("split") == "val"]
    fig = _new_figure(figsize=(10, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]

    xs, ys = _series(train, "loss")
    if xs:
        ax_loss.plot(xs, ys, color="0.6", lw=1, label="train loss (weighted)")
    for k in _ttt_steps(val, "loss"):
        xs, ys = _series(val, f"loss_{k}")
        ax_loss.plot(xs, ys, marker="o", ms=3, color=colors[k % len(colors)], label=f"val loss_{k}")
    ax_loss.set(xlabel="optimizer step", ylabel="loss", title="TTT loss")

    for k in _ttt_steps(train, "acc"):
        xs, ys = _series(train, f"acc_{k}")
        ax_acc.plot(xs, ys, lw=0.8, alpha=0.35, color=colors[k % len(colors)])
    for k in _ttt_steps(val, "acc"):
        xs, ys = _series(val, f"acc_{k}")
        ax_acc.plot(xs, ys, marker="o", ms=3, color=colors[k % len(colors)], label=f"val acc_{k}")
    ax_acc.set(xlabel="optimizer step", ylabel="top-1 accuracy", ylim=(0, 1),
               title="TTT accuracy (faint: train)")

    for ax in (ax_loss, ax_acc):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def _benchmarks(metrics: dict) -> list[str]:
    return [b for b, v in metrics.items()
            if b != "ngram" and isinstance(v, dict) and "accepted_histogram" in v]


def accept_len_figure(metrics: dict, title: str | None = None) -> Figure:
    """Per benchmark: the accepted-length histogram and the per-position acceptance rate.

    ``accepted_histogram[j]`` counts verify steps with exactly ``j`` draft tokens accepted; it
    is plotted as a fraction of steps so the drafter and the n-gram floor (``metrics["ngram"]``,
    when present) share an axis. The legend carries ``accept_len`` (which counts the bonus
    token). ``per_position_accept_rate[i]`` is the fraction of steps whose draft token ``i+1``
    was accepted. When any benchmark has ``accept_len_by_chain_length`` ({"1": .., "k": ..}), a
    third column plots it against the chain length j, one line per series.
    """
    benches = _benchmarks(metrics)
    ngram = metrics.get("ngram") if isinstance(metrics.get("ngram"), dict) else {}
    rows = max(len(benches), 1)
    by_j = any("accept_len_by_chain_length" in metrics[b] for b in benches)
    fig = _new_figure(figsize=(15 if by_j else 10, 3.2 * rows))
    axes = fig.subplots(rows, 3 if by_j else 2, squeeze=False)
    if not benches:
        for ax in axes[0]:
            ax.text(0.5, 0.5, "no benchmarks", ha="center", va="center", transform=ax.transAxes)
    for (ax_h, ax_p, *ax_j), bench in zip(axes, benches):
        series = [("drafter", metrics[bench])]
        if isinstance(ngram.get(bench), dict) and "accepted_histogram" in ngram[bench]:
            series.append(("n-gram", ngram[bench]))
        width = 0.8 / len(series)
        for i, (label, m) in enumerate(series):
            hist = [float(c) for c in m["accepted_histogram"]]
            total = sum(hist) or 1.0
            al = m.get("accept_len")
            lab = f"{label} (accept_len {al:.2f})" if _finite(al) else label
            off = (i - (len(series) - 1) / 2) * width
            ax_h.bar([j + off for j in range(len(hist))], [c / total for c in hist], width, label=lab)
            rate = [float(r) for r in m.get("per_position_accept_rate", [])]
            ax_p.bar([j + 1 + off for j in range(len(rate))], rate, width, label=label)
            pts = [(int(j), v) for j, v in m.get("accept_len_by_chain_length", {}).items() if _finite(v)]
            if ax_j and pts:
                ax_j[0].plot(*zip(*sorted(pts)), marker="o", label=label)
        ax_h.set(xlabel="draft tokens accepted per verify step", ylabel="fraction of steps",
                 title=f"{bench}: accepted-length histogram")
        ax_p.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1),
                 title=f"{bench}: per-position acceptance")
        n = len(metrics[bench]["accepted_histogram"])
        ax_h.set_xticks(range(n))
        ax_p.set_xticks(range(1, n))
        if ax_j:
            ax_j[0].set(xlabel="chain length j (draft tokens per step)", ylabel="acceptance length",
                        title=f"{bench}: acceptance length by chain length")
            ax_j[0].set_xticks(range(1, n))
        for ax in (ax_h, ax_p, *ax_j):
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def save_png(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG (parents created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
