"""The benchmark's plots, from report.py's merged run (matplotlib, Agg backend).

  speedup.svg/.png   speedup over kiln eager per workload: kiln compiled,
                     PyTorch eager, PyTorch's fused ops, TorchScript (and
                     torch.compile where measured); log scale
  limits.svg/.png    achieved GB/s (memory-bound workloads) and GFLOP/s
                     (compute-bound ones) against the limits measured in the run
  compile.svg/.png   kiln's compile time per workload, beside TorchScript's
                     one-off cost

report.py calls draw_all(report, img_dir). The SVGs carry no date and a fixed
hash salt, so an unchanged run gives unchanged files.
"""

import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {  # one colour per contender, the same in every plot
    "kiln_eager_ms": "#9e9e9e",
    "kiln_compiled_ms": "#d95f02",
    "torch_eager_ms": "#7570b3",
    "torch_builtin_ms": "#a6a1d9",
    "torchscript_ms": "#1b9e77",
    "torch_compiled_ms": "#e7298a",
}
LABELS = {
    "kiln_eager_ms": "kiln eager",
    "kiln_compiled_ms": "kiln compiled",
    "torch_eager_ms": "PyTorch eager",
    "torch_builtin_ms": "PyTorch fused ops",
    "torchscript_ms": "TorchScript",
    "torch_compiled_ms": "torch.compile",
}


def ok(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def threads(rep):
    n = rep.get("threads")
    return f"{n} thread" + ("" if n == 1 else "s")


def short(name):
    head, _, rest = name.partition("_")
    return f"{head}\n{rest.replace('_', ' ')}"


def bottom_legend(fig, ax, labels=None):
    """One legend under the plot, in a band the layout leaves free."""
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, labels or names, loc="lower center", ncols=min(len(handles), 3 if labels else 6),
               fontsize=8, frameon=False)
    fig.subplots_adjust(bottom=0.24 if labels and len(labels) > 3 else 0.2)


def save(fig, img_dir, stem):
    os.makedirs(img_dir, exist_ok=True)
    fig.savefig(os.path.join(img_dir, stem + ".svg"), bbox_inches="tight", metadata={"Date": None})
    fig.savefig(os.path.join(img_dir, stem + ".png"), bbox_inches="tight", dpi=110, metadata={"Software": None})
    plt.close(fig)


def bars(ax, names, series, width_total=0.8):
    """Grouped bars: series is [(key, values)], values aligned with names (None: no bar)."""
    k = len(series)
    w = width_total / max(k, 1)
    for i, (key, vals) in enumerate(series):
        xs = [j + (i - (k - 1) / 2) * w for j in range(len(names))]
        hs = [v if ok(v) else 0 for v in vals]
        rects = ax.bar(xs, hs, w, color=COLORS[key], label=LABELS[key], edgecolor="white", linewidth=0.5)
        for r, v in zip(rects, vals):
            if not ok(v):
                r.set_visible(False)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([short(n) for n in names], fontsize=8)


def log_axis(ax, values, fmt, pad=1.8):
    """Log y axis over values with 1-2-5 ticks labelled by fmt."""
    ax.set_yscale("log")
    vs = [v for v in values if ok(v)]
    if not vs:
        return
    lo, hi = min(vs) / pad, max(vs) * pad
    ax.set_ylim(lo, hi)
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5) if lo <= m * 10.0 ** e <= hi]
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: fmt(v)))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def num_label(v):
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def x_label(v):
    return f"{v:.1f}x" if v >= 10 else f"{v:.2f}x"


def label_bars(ax, fmt):
    """Writes each visible bar's value above it."""
    for cont in ax.containers:
        for r in cont:
            if r.get_visible() and r.get_height() > 0:
                ax.annotate(fmt(r.get_height()), (r.get_x() + r.get_width() / 2, r.get_height()),
                            xytext=(0, 1), textcoords="offset points", ha="center", va="bottom",
                            fontsize=6, rotation=90)


def speedup(rep, img_dir):
    rows = rep["side_by_side"]
    keys = [k for k in ("kiln_compiled_ms", "torch_eager_ms", "torch_builtin_ms", "torchscript_ms",
                        "torch_compiled_ms") if any(ok(r.get(k)) for r in rows)]
    names = [r["name"] for r in rows]
    series = [(k, [r["kiln_eager_ms"] / r[k] if ok(r.get(k)) and ok(r["kiln_eager_ms"]) else None
                   for r in rows]) for k in keys]
    fig, ax = plt.subplots(figsize=(max(7, 1.05 * len(names) + 2), 4.6))
    bars(ax, names, series)
    log_axis(ax, [v for _, vs in series for v in vs] + [1], lambda v: f"{v:g}x", pad=2.5)
    ax.axhline(1, color="black", linewidth=0.8)
    label_bars(ax, x_label)
    ax.set_ylabel("speedup over kiln eager (kiln eager time / time)")
    ax.set_title(f"Speedup over kiln eager, {threads(rep)} (above 1: faster than kiln eager)", fontsize=10)
    ax.grid(axis="y", which="major", alpha=0.3)
    bottom_legend(fig, ax)
    save(fig, img_dir, "speedup")


def limits(rep, img_dir):
    rows = rep["side_by_side"]
    lim = rep.get("limits") or {}
    keys = [k for k in ("kiln_eager_ms", "kiln_compiled_ms", "torch_eager_ms", "torch_builtin_ms",
                        "torchscript_ms", "torch_compiled_ms") if any(ok(r.get("rate_" + k)) for r in rows)]
    panels = [("memory", "GB/s", lim.get("bandwidth_gbps"), "measured bandwidth"),
              ("compute", "GFLOP/s", lim.get("sgemm_gflops"), "measured sgemm")]
    panels = [p for p in panels if any(r["bound"] == p[0] for r in rows)]
    if not panels or not keys:
        return
    widths = [max(2, sum(r["bound"] == p[0] for r in rows)) for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(2.5 + 1.3 * sum(widths), 4.6),
                             gridspec_kw={"width_ratios": widths})
    axes = axes if len(panels) > 1 else [axes]
    for ax, (kind, unit, limit, what) in zip(axes, panels):
        sel = [r for r in rows if r["bound"] == kind]
        bars(ax, [r["name"] for r in sel], [(k, [r.get("rate_" + k) for r in sel]) for k in keys])
        if ok(limit):
            ax.axhline(limit, color="black", linestyle="--", linewidth=1)
            ax.annotate(f"{what} {limit:.3g} {unit}", xy=(0.01, limit), xycoords=("axes fraction", "data"),
                        xytext=(0, 3), textcoords="offset points", fontsize=8)
        top = max([r.get("rate_" + k) or 0 for r in sel for k in keys] + [limit if ok(limit) else 0])
        ax.set_ylim(0, top * 1.2)
        label_bars(ax, num_label)
        ax.set_ylabel(unit)
        ax.set_title(f"{kind}-bound: {unit}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Achieved rate against the machine's measured limits, {threads(rep)}", fontsize=10)
    bottom_legend(fig, axes[0])
    fig.subplots_adjust(wspace=0.25)
    save(fig, img_dir, "limits")


def compile_time(rep, img_dir):
    rows = [r for r in rep["side_by_side"] if ok(r.get("kiln_compile_ms")) or ok(r.get("torchscript_prep_ms"))]
    if not rows:
        return
    names = [r["name"] for r in rows]
    series = [("kiln_compiled_ms", [r.get("kiln_compile_ms") for r in rows])]
    if any(ok(r.get("torchscript_prep_ms")) for r in rows):
        series.append(("torchscript_ms", [r.get("torchscript_prep_ms") for r in rows]))
    if any(ok(r.get("torch_compiled_prep_ms")) for r in rows):
        series.append(("torch_compiled_ms", [r.get("torch_compiled_prep_ms") for r in rows]))
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(names) + 2), 4.6))
    bars(ax, names, series)
    labels = {"kiln_compiled_ms": "kiln: passes, fusion, LLVM, linking (not the traced call)",
              "torchscript_ms": "TorchScript: script + freeze + profiling runs",
              "torch_compiled_ms": "torch.compile: first call beyond steady state"}
    bottom_legend(fig, ax, [labels[k] for k, _ in series])
    log_axis(ax, [v for _, vs in series for v in vs], lambda v: f"{v:g}", pad=2.5)
    label_bars(ax, num_label)
    ax.set_ylabel("ms, once per shape")
    ax.set_title("Compile time per workload", fontsize=10)
    ax.grid(axis="y", which="major", alpha=0.3)
    save(fig, img_dir, "compile")


def draw_all(rep, img_dir):
    plt.rcParams["svg.hashsalt"] = "kiln-bench"
    plt.rcParams["font.size"] = 9
    speedup(rep, img_dir)
    limits(rep, img_dir)
    compile_time(rep, img_dir)
