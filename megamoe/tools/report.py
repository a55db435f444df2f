"""Presenting benchmark results: a progress bar on stderr, text and Markdown tables.

Also runnable: ``python -m megamoe.tools.report results.json [--markdown]`` renders a saved JSON
list of records (what BENCHMARKS.md's table is made from).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence, TextIO

__all__ = ["ProgressBar", "format_table", "format_layer_table", "format_generic_table", "main"]

BAR_WIDTH = 28
# Without a terminal (CI logs, subprocesses) the bar prints one line per stage, not per step.
_MIN_REDRAW_S = 0.1


class ProgressBar:
    """A one-line progress bar: ``[#####.....]  42%  3/7  dsv3 reference: timing``.

    Redraws in place on a terminal; elsewhere prints a line whenever the label changes, so logs
    stay short. ``enabled=False`` (ranks other than 0) makes every call a no-op.
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total, self.done = max(total, 1), 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.label, self._last_draw = "", 0.0

    def step(self, n: int = 1, label: str | None = None) -> None:
        self.done = min(self.done + n, self.total)
        self.update(label)

    def update(self, label: str | None = None) -> None:
        if not self.enabled:
            return
        changed = label is not None and label != self.label
        if label is not None:
            self.label = label
        now = time.monotonic()
        if self.tty:
            if changed or self.done == self.total or now - self._last_draw >= _MIN_REDRAW_S:
                self.stream.write("\r" + self._line() + "\x1b[K")
                self.stream.flush()
                self._last_draw = now
        elif changed:
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def close(self, label: str = "done") -> None:
        """Draw the final state (``label``) and end the line."""
        if not self.enabled:
            return
        self.label = label
        self.stream.write(
            ("\r" if self.tty else "") + self._line() + ("\x1b[K\n" if self.tty else "\n")
        )
        self.stream.flush()

    def _line(self) -> str:
        filled = BAR_WIDTH * self.done // self.total
        pct = 100 * self.done // self.total
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        return f"[{bar}] {pct:3d}%  {self.done}/{self.total}  {self.label}"


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != 0 and abs(value) < 10**-digits:
            return f"{value:.2g}"
        return f"{value:.{digits}f}"
    return str(value)


def _check_cell(rec: dict) -> str:
    if rec.get("check") is None:
        return "-"
    verdict = "ok" if rec.get("check_ok") else "FAIL"
    return f"{verdict} ({_fmt(rec.get('check_rel'), 4)})"


def _backend_cell(rec: dict) -> str:
    resolved = rec.get("resolved_backend")
    cell = f"{rec['backend']} ({resolved})" if resolved else rec["backend"]
    precision = rec.get("precision") or "bf16"
    return cell if precision == "bf16" else f"{cell} {precision}"


def _status_cell(rec: dict) -> str | None:
    status = rec.get("status", "ok")
    return None if status == "ok" else f"{status}: {rec.get('note', '')}"


# (header, how to read one record); the check cell comes last (a skipped row's reason goes there).
_LAYER_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("shape", lambda r: r.get("model") or r["preset"]),
    ("W", lambda r: r["world_size"]),
    ("backend", lambda r: _backend_cell(r)),
    ("routing", lambda r: r.get("routing")),
    ("tokens/rank", lambda r: r["tokens_per_rank"]),
    ("mode", lambda r: r.get("mode") or "-"),
    ("fwd ms", lambda r: _fmt(r["fwd_ms"], 3)),
    ("bwd ms", lambda r: _fmt(r["bwd_ms"], 3)),
    ("fwd+bwd ms", lambda r: _fmt(r["fwdbwd_ms"], 3)),
    ("fwd TFLOP/s", lambda r: _fmt(r["fwd_tflops"], 1)),
    ("fwd+bwd TFLOP/s", lambda r: _fmt(r["fwdbwd_tflops"], 1)),
    ("% GEMM peak", lambda r: _fmt(_pct_of_peak(r), 0)),
    (
        "vs torch-a2a",
        lambda r: (
            "-" if r.get("speedup_vs_torch_a2a") is None else f"{r['speedup_vs_torch_a2a']:.2f}x"
        ),
    ),
)
_CHECK_COLUMN = ("check (rel err)", _check_cell)
# Shown only when some record has the field (host times, NVLink copies, tunables): (header, field).
_COMM_COLUMNS: tuple[tuple[str, str], ...] = (
    ("vs bf16", "speedup_vs_bf16"),
    ("host fwd ms", "host_fwd_ms"),
    ("host bwd ms", "host_bwd_ms"),
    ("dispatch GB/s", "dispatch_gbps"),
    ("combine GB/s", "combine_gbps"),
    ("dy pull GB/s", "dispatch_bwd_gbps"),
    ("dx push GB/s", "combine_bwd_gbps"),
    ("comm programs", "comm_programs"),
    ("push programs", "push_programs"),
    ("copy programs", "copy_programs"),
    ("minibatch rows", "minibatch_rows"),
    ("ring rows", "ring_rows"),
    ("down lag", "down_lag"),
    ("overlap shared", "overlap_shared"),
    ("comm kernel", "comm_kernel"),
)


def _columns(records: Sequence[dict]) -> list[tuple[str, Any]]:
    """The layer columns, with the communication ones that some record fills."""
    comm = [
        (header, lambda r, f=field: _fmt(r.get(f), 2 if f.startswith(("host", "speedup")) else 0))
        for header, field in _COMM_COLUMNS
        if any(r.get(field) is not None for r in records)
    ]
    return [*_LAYER_COLUMNS, *comm, _CHECK_COLUMN]


def _pct_of_peak(rec: dict) -> float | None:
    peak, rate = rec.get("gemm_peak_tflops"), rec.get("fwdbwd_tflops")
    if not peak or rate is None:
        return None
    return 100.0 * rate / peak


def _layer_rows(records: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    columns = _columns(records)
    headers = [h for h, _ in columns]
    rows = []
    for rec in records:
        status = _status_cell(rec)
        if status is None:
            rows.append([str(_fmt(get(rec))) for _, get in columns])
        else:
            head = [str(_fmt(get(rec))) for _, get in columns[:6]]
            rows.append(head + ["-"] * (len(headers) - 7) + [status])
    return headers, rows


def _text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def _markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _layer_records(records: Sequence[dict]) -> list[dict]:
    return [r for r in records if "fwdbwd_ms" in r and "preset" in r]


def format_layer_table(records: Sequence[dict], *, markdown: bool = False) -> str:
    """One row per (preset, world size, backend) layer record; skipped/failed ones say why."""
    headers, rows = _layer_rows(_layer_records(records))
    return _markdown_table(headers, rows) if markdown else _text_table(headers, rows)


def format_generic_table(records: Sequence[dict], *, markdown: bool = False) -> str:
    """Any list of flat records (e.g. the grouped-GEMM kernel benchmark): union of their keys."""
    headers: list[str] = []
    for rec in records:
        headers += [k for k in rec if k not in headers]
    rows = [[str(_fmt(rec.get(h))) for h in headers] for rec in records]
    return _markdown_table(headers, rows) if markdown else _text_table(headers, rows)


def format_table(records: Sequence[dict], *, markdown: bool = False) -> str:
    """Layer records first (with the run's facts above), then training records
    (``megamoe train-bench``), then any other records."""
    from .train_bench import format_summary

    layer = _layer_records(records)
    train = [r for r in records if r.get("kind") == "train"]
    other = [r for r in records if r not in layer and r not in train]
    parts = []
    if layer:
        first = layer[0]
        parts.append(
            f"gpu: {first.get('gpu')}   commit: {first.get('commit')}   "
            f"date: {first.get('date')}   "
            f"dense bf16 GEMM peak: {_fmt(first.get('gemm_peak_tflops'), 1)} TFLOP/s   "
            f"iters: {first.get('iters')}"
        )
        parts.append(format_layer_table(layer, markdown=markdown))
    if train:
        parts.append(format_summary(train, markdown=markdown))
    if other:
        parts.append(format_generic_table(other, markdown=markdown))
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.tools.report",
        description="Render benchmark JSON records as a table.",
    )
    parser.add_argument("results", nargs="+", help="JSON files written by `megamoe bench --out`")
    parser.add_argument("--markdown", action="store_true", help="Markdown (for BENCHMARKS.md)")
    args = parser.parse_args(argv)
    try:
        records = load_records(args.results)
    except ValueError as exc:
        parser.error(str(exc))
    print(format_table(records, markdown=args.markdown))
    return 0


def load_records(paths: Sequence[str]) -> list[dict]:
    """The records of JSON files written by ``megamoe bench --out``, concatenated."""
    records: list[dict] = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of records, got {type(data).__name__}")
        records += data
    return records


if __name__ == "__main__":
    raise SystemExit(main())
