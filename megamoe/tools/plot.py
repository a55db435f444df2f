"""Plots of layer benchmark records.

``megamoe plot results.json ... --out layer.png``: bars of TFLOP/s per backend for each (shape,
world size). ``--x tokens``: forward and fwd+bwd time against tokens per rank, one line per
(shape, W, backend) (records of ``megamoe bench --tokens N1 N2 ...``). ``--x shape``: fwd+bwd
speedup over torch-a2a per shape, bars per backend, one panel per (timing mode, tokens) (the
model-shape sweep). ``--x precision``: fp8's speedup over bf16 per shape (records of ``megamoe
bench --precision bf16 fp8``), forward and fwd+bwd panels, bars per weight-quantization cadence
(``--micro-batches``). ``--x train`` (the default for records of ``megamoe train-bench``): bars of
tokens/s per GPU per (model, routing), one per MoE implementation. ``--x breakdown``: where
the step time of train records made with ``--breakdown`` goes, a stacked bar per (model,
implementation). matplotlib is optional
(``pip install megamoe[plot]``); it is imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import TUNABLES
from .report import load_records

__all__ = [
    "plot_layer",
    "plot_tokens",
    "plot_shapes",
    "plot_precision",
    "plot_train",
    "plot_breakdown",
    "shape_name",
    "series_name",
    "main",
]

# Fixed colours so that a backend looks the same in every plot.
BACKEND_COLORS = {
    "fused": "#d62728",
    "triton": "#1f77b4",
    "torch-a2a": "#7f7f7f",
    "reference": "#bcbd22",
}
METRICS = (("fwd_tflops", "forward"), ("fwdbwd_tflops", "forward + backward"))
TIME_METRICS = (("fwd_ms", "forward"), ("fwdbwd_ms", "forward + backward"))
LINE_STYLES = ("-", "--", ":", "-.")
HATCHES = ("", "//", "..", "xx")


def _layer_ok(records: Sequence[dict]) -> list[dict]:
    return [
        r
        for r in records
        if "preset" in r and r.get("fwdbwd_tflops") is not None and r.get("status", "ok") == "ok"
    ]


def shape_name(rec: dict) -> str:
    """The record's shape: its preset, its model, or H,I,E,K,Is of a custom shape."""
    if rec.get("model") == "custom":
        dims = ("hidden", "intermediate", "experts", "top_k", "shared_intermediate")
        return ",".join(str(rec[d]) for d in dims)
    return rec.get("model") or rec["preset"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok_records(records: Sequence[dict]) -> list[dict]:
    recs = _layer_ok(records)
    if not recs:
        raise ValueError("records must hold at least one layer record with a status of ok")
    return recs


def _finish(plt, fig, axes, recs: Sequence[dict], path: str, ylabel: str, legend: str) -> None:
    """Label, title (GPU and commit of the first record), legend, write the PNG, close."""
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(loc=legend, fontsize=8)
    first = recs[0]
    fig.suptitle(
        f"megamoe layer, {first.get('gpu', '?')}, commit {first.get('commit', '?')}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tokens(records: Sequence[dict], path: str) -> None:
    """Write a PNG of time (ms) against tokens per rank, one line per (preset, W, backend)."""
    plt = _pyplot()
    recs = _ok_records(records)
    lines: dict[tuple, list[dict]] = {}
    for r in recs:
        lines.setdefault(
            (shape_name(r), r["world_size"], r["backend"], series_name(r, recs)), []
        ).append(r)
    worlds = sorted({key[1] for key in lines})
    fig, axes = plt.subplots(1, len(TIME_METRICS), figsize=(6 * len(TIME_METRICS), 4))
    for ax, (field, title) in zip(axes, TIME_METRICS):
        for (preset, world, backend, name), rs in lines.items():
            rs = sorted(rs, key=lambda r: r["tokens_per_rank"])
            ax.plot(
                [r["tokens_per_rank"] for r in rs],
                [r[field] for r in rs],
                marker="o",
                color=BACKEND_COLORS.get(backend),
                linestyle=LINE_STYLES[worlds.index(world) % len(LINE_STYLES)],
                label=f"{preset} W={world} {name}",
            )
        ax.set_xlabel("tokens per rank")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    _finish(plt, fig, axes, recs, path, "ms (median, max over ranks)", "upper left")


def series_name(rec: dict, records: Sequence[dict]) -> str:
    """The backend, plus the tunables whose values differ among its records of the same preset
    and world size (a ``--tune`` sweep), so that every variant gets its own bars."""
    key = (rec["backend"], shape_name(rec), rec["world_size"])
    mine = [r for r in records if (r["backend"], shape_name(r), r["world_size"]) == key]
    varied = [f for f in TUNABLES if len({r.get(f) for r in mine}) > 1]
    return " ".join([rec["backend"], *(f"{f}={rec.get(f)}" for f in varied)])


def plot_layer(records: Sequence[dict], path: str) -> None:
    """Write a PNG with one panel per metric; groups = (preset, W), bars = backends (and their
    tunable variants: hatched)."""
    plt = _pyplot()
    recs = _ok_records(records)
    groups = list(dict.fromkeys((shape_name(r), r["world_size"]) for r in recs))
    names = {id(r): series_name(r, recs) for r in recs}
    series = list(dict.fromkeys((r["backend"], names[id(r)]) for r in recs))
    by_key = {(shape_name(r), r["world_size"], names[id(r)]): r for r in recs}
    width = 0.8 / len(series)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(6 * len(METRICS), 4), sharey=True)
    for ax, (field, title) in zip(axes, METRICS):
        for j, (backend, name) in enumerate(series):
            xs, ys = [], []
            for g, (preset, world) in enumerate(groups):
                rec = by_key.get((preset, world, name))
                if rec is not None:
                    xs.append(g + (j - (len(series) - 1) / 2) * width)
                    ys.append(rec[field])
            variant = [n for b, n in series if b == backend].index(name)
            ax.bar(
                xs,
                ys,
                width,
                label=name,
                color=BACKEND_COLORS.get(backend),
                hatch=HATCHES[variant % len(HATCHES)],
                edgecolor="white",
            )
        peaks = [r["gemm_peak_tflops"] for r in recs if r.get("gemm_peak_tflops")]
        if peaks:
            ax.axhline(
                max(peaks), color="black", linestyle="--", linewidth=0.8, label="dense bf16 GEMM"
            )
        ax.set_xticks(range(len(groups)), [f"{p}\nW={w}" for p, w in groups])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    _finish(plt, fig, axes, recs, path, "TFLOP/s per GPU", "upper right")


def plot_shapes(records: Sequence[dict], path: str, baseline: str = "torch-a2a") -> None:
    """Write a PNG of fwd+bwd speedup over ``baseline`` per shape (bars: our backends), one
    panel per (timing mode, tokens per rank)."""
    plt = _pyplot()
    recs = [r for r in _ok_records(records) if r.get("speedup_vs_torch_a2a") is not None]
    ours = [r for r in recs if r["backend"] != baseline]
    if not ours:
        raise ValueError(f"records must hold layer records of a backend other than {baseline}")
    panels = sorted({(r.get("mode") or "throughput", r["tokens_per_rank"]) for r in ours})
    shapes = list(dict.fromkeys(shape_name(r) for r in ours))
    backends = list(dict.fromkeys(r["backend"] for r in ours))
    width = 0.8 / len(backends)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(8, 0.7 * len(shapes)), 3 * len(panels)), squeeze=False
    )
    axes = [row[0] for row in axes]
    for ax, (mode, tokens) in zip(axes, panels):
        for j, backend in enumerate(backends):
            got = {
                shape_name(r): r["speedup_vs_torch_a2a"]
                for r in ours
                if r["backend"] == backend
                and (r.get("mode") or "throughput") == mode
                and r["tokens_per_rank"] == tokens
            }
            xs = [i + (j - (len(backends) - 1) / 2) * width for i, s in enumerate(shapes)]
            ax.bar(
                [x for x, s in zip(xs, shapes) if s in got],
                [got[s] for s in shapes if s in got],
                width,
                label=backend,
                color=BACKEND_COLORS.get(backend, "#2ca02c"),
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{mode} mode, {tokens} tokens", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    _finish(plt, fig, axes, recs, path, f"fwd+bwd speedup over {baseline}", "upper right")


def _cadence(rec: dict) -> str:
    """How often the record's fp8 weights were quantized (``micro_batches``)."""
    n = rec.get("micro_batches") or 1
    return "weights quantized every step" if n == 1 else f"weights quantized every {n} steps"


def plot_precision(records: Sequence[dict], path: str) -> None:
    """Write a PNG of fp8's speedup over bf16 per shape (``speedup_vs_bf16``, the same
    backend in the same run), a forward and a fwd+bwd panel per tokens per rank, bars per
    weight-quantization cadence."""
    plt = _pyplot()
    recs = [r for r in _ok_records(records) if r.get("speedup_vs_bf16") is not None]
    if not recs:
        raise ValueError("records must hold fp8 layer records with speedup_vs_bf16")
    panels = [
        (key, label, tokens)
        for tokens in sorted({r["tokens_per_rank"] for r in recs})
        for key, label in (("fwd_speedup_vs_bf16", "forward"), ("speedup_vs_bf16", "fwd+bwd"))
    ]
    shapes = list(dict.fromkeys(shape_name(r) for r in recs))
    series = list(dict.fromkeys(_cadence(r) for r in recs))
    width = 0.8 / len(series)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(8, 0.7 * len(shapes)), 3 * len(panels)), squeeze=False
    )
    axes = [row[0] for row in axes]
    for ax, (key, label, tokens) in zip(axes, panels):
        for j, name in enumerate(series):
            got = {
                shape_name(r): r[key]
                for r in recs
                if _cadence(r) == name and r["tokens_per_rank"] == tokens and r.get(key)
            }
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(shapes))]
            ax.bar(
                [x for x, s in zip(xs, shapes) if s in got],
                [got[s] for s in shapes if s in got],
                width,
                label=name,
                hatch=HATCHES[j % len(HATCHES)],
                color=BACKEND_COLORS.get(recs[0]["backend"], "#2ca02c"),
                edgecolor="black",
                linewidth=0.4,
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{label}, {tokens} tokens per rank", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    _finish(plt, fig, axes, recs, path, "fp8 speedup over bf16", "lower right")


def _train_ok(records: Sequence[dict]) -> list[dict]:
    return [
        r
        for r in records
        if r.get("kind") == "train"
        and r.get("status", "ok") == "ok"
        and r.get("tokens_per_s_per_gpu") is not None
    ]


def _impl_color(impl: str) -> str:
    if impl == "native":
        return BACKEND_COLORS["torch-a2a"]
    return BACKEND_COLORS.get(impl.removeprefix("megamoe-"), "#2ca02c")


def _tokens_per_step(rec: dict) -> int | str:
    tokens = rec.get("tokens")
    return "?" if tokens is None else tokens * (rec.get("microbatches") or 1)


# The parts of a step, bottom to top, from a train record's breakdown_ms (the MoE block less
# its routed experts: router and shared expert).
BREAKDOWN_PARTS = (
    ("routed experts", lambda b: b["experts"], "#d62728"),
    ("router + shared expert", lambda b: b["moe_block"] - b["experts"], "#ff9896"),
    ("attention", lambda b: b["attention"], "#1f77b4"),
    ("optimizer", lambda b: b["optimizer"], "#2ca02c"),
    ("rest", lambda b: b["rest"], "#c7c7c7"),
)


def plot_breakdown(records: Sequence[dict], path: str) -> None:
    """Write a PNG of where the step time of train records with a ``breakdown_ms`` goes: one
    stacked bar per (model, routing, layers, micro-batches, implementation)."""
    recs = [r for r in _train_ok(records) if r.get("breakdown_ms")]
    if not recs:
        raise ValueError("records must hold a train record with breakdown_ms (--breakdown)")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(recs) + 2), 4.8))
    labels = []
    for x, rec in enumerate(recs):
        bottom = 0.0
        for part, value, color in BREAKDOWN_PARTS:
            ms = value(rec["breakdown_ms"])
            ax.bar(x, ms, 0.7, bottom=bottom, color=color, label=part if x == 0 else None)
            bottom += ms
        ax.annotate(f"{rec['step_ms']:.0f} ms", (x, bottom), ha="center", va="bottom", fontsize=7)
        micro = rec.get("microbatches") or 1
        labels.append(
            f"{rec['model']}\n{rec['impl'].removeprefix('megamoe-')}"
            + (f"\n{micro} micro-batches" if micro > 1 else "")
        )
    ax.set_xticks(range(len(recs)), labels, fontsize=7)
    first = recs[0]
    _finish_train(
        plt,
        fig,
        ax,
        path,
        "ms per training step (medians)",
        f"where a training step's time goes, {first.get('gpu', '?')}, "
        f"{first.get('precision', '?')}, commit {first.get('commit', '?')}",
    )


def _finish_train(plt, fig, ax, path: str, ylabel: str, title: str) -> None:
    """Axis label, grid, legend and title of a train-bench plot; write it to ``path``."""
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="best", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_train(records: Sequence[dict], path: str) -> None:
    """Write a PNG of tokens/s per GPU of ``megamoe train-bench`` records: groups = (model,
    routing, layers), bars = implementations, each labelled with its speedup over native."""
    recs = _train_ok(records)
    if not recs:
        raise ValueError("records must hold at least one train record with a status of ok")
    plt = _pyplot()
    groups = list(dict.fromkeys((r["model"], r["routing"], r["layers"]) for r in recs))
    impls = list(dict.fromkeys(r["impl"] for r in recs))
    by_key = {(r["model"], r["routing"], r["layers"], r["impl"]): r for r in recs}
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(6.0, (1.2 + 0.5 * len(impls)) * len(groups)), 4.5))
    labelled: set[str] = set()
    for j, impl in enumerate(impls):
        for g, group in enumerate(groups):
            rec = by_key.get((*group, impl))
            if rec is None:
                continue
            x = g + (j - (len(impls) - 1) / 2) * width
            ax.bar(
                x,
                rec["tokens_per_s_per_gpu"],
                width,
                color=_impl_color(impl),
                label=None if impl in labelled else impl,
                edgecolor="white",
            )
            labelled.add(impl)
            speedup = rec.get("speedup_vs_native")
            if speedup is not None and impl != "native":
                ax.annotate(
                    f"{speedup:.2f}x",
                    (x, rec["tokens_per_s_per_gpu"]),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(
        range(len(groups)), [f"{m}\n{routing}, {layers} layers" for m, routing, layers in groups]
    )
    first = recs[0]
    _finish_train(
        plt,
        fig,
        ax,
        path,
        "tokens/s per GPU (median step)",
        f"megamoe train-bench, {first.get('gpu', '?')}, W={first.get('world_size', '?')}, "
        f"{first.get('precision', '?')}, {_tokens_per_step(first)} tokens/step, commit "
        f"{first.get('commit', '?')}",
    )


def add_x_argument(parser) -> None:
    """``--x``: which plot (shared by ``megamoe plot`` and this module's CLI)."""
    parser.add_argument(
        "--x",
        choices=("backend", "tokens", "shape", "precision", "train", "breakdown"),
        default="backend",
        help="bars per backend (default), time against tokens per rank, speedup per shape, "
        "fp8's speedup over bf16 per shape, "
        "tokens/s of train-bench records (the default when there are no layer records), or "
        "where their step time goes (train-bench --breakdown)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="megamoe plot", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON files written by `megamoe bench --out`")
    parser.add_argument("--out", required=True, help="PNG file to write")
    add_x_argument(parser)
    args = parser.parse_args(argv)
    plot = {
        "tokens": plot_tokens,
        "shape": plot_shapes,
        "precision": plot_precision,
        "train": plot_train,
        "breakdown": plot_breakdown,
    }.get(args.x, plot_layer)
    try:
        records = load_records(args.results)
        if args.x == "backend" and not _layer_ok(records) and _train_ok(records):
            plot = plot_train
        plot(records, args.out)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
