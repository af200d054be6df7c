"""`overnight report OUT`: the job's story as plots (matplotlib), in one self-contained HTML file.

It reads what the job left in OUT, in every job folder (the root, each shard, each Ray worker): the parts
(through DuckDB), the manifests and the progress timeline each attempt recorded (``timeline.json``). The
plots are PNG images embedded in the HTML as data URIs, so the file opens anywhere with no network.

    rows done and output tokens/s over time, one lane per shard or worker, with the deadline;
    the ETA forecast as it evolved (the forecast finish against the actual finish and the deadline);
    predicted against actual output length (log-log), with Kendall's tau;
    rows per length bucket; the latency from queued to finished; errors by message;
    the engine settings of the run, and its engine-hours and cost where the rows carry engine_seconds.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from overnight.pipeline.output.checkpoint import OutputError
from overnight.pipeline.output.layout import job_dirs
from overnight.pipeline.tools.inspection import open_results


@dataclass
class Figure:
    name: str      # file name stem for --png
    title: str
    png: bytes
    note: str = ""


@dataclass
class Report:
    out: str
    summary: list[tuple[str, str]]
    figures: list[Figure] = field(default_factory=list)
    settings: list[tuple[str, str]] = field(default_factory=list)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def _times(ts):
    return [dt.datetime.fromtimestamp(t) for t in ts]


def _clock_axis(axis) -> None:
    import matplotlib.dates as mdates

    axis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))


def build(url: str) -> Report:
    con, manifest = open_results(url)
    dirs = job_dirs(url)
    lanes = [(d.label if len(dirs) > 1 else "job", d.out.read_timeline(), d.out.read_manifest() or {}) for d in dirs]
    row = _row_filter(con)
    n, ok, err, otok = con.execute(
        f"select count(*) filter ({row}), count(*) filter (status = 'ok' and {row}), "
        f"count(*) filter (status = 'error' and {row}), coalesce(sum(output_tokens), 0) from results").fetchone()
    total = (manifest or {}).get("counts", {}).get("num_rows")
    report = Report(url, [("output", url), ("state", str((manifest or {}).get("state", "?"))),
                          ("rows", f"{n} done of {total if total is not None else '?'} ({ok} ok, {err} error)"),
                          ("output tokens", f"{otok:,}"), ("job folders", str(len(dirs)))])
    from overnight.pipeline.tools.inspection import cost_lines
    report.summary += [("cost", line.split(": ", 1)[1]) for line in cost_lines(con, manifest, None, n)]
    deadline = _deadline(lanes)
    if any(t for _, t, _ in lanes):
        report.figures.append(_progress(lanes, deadline))
        eta = _forecast(lanes, deadline)
        if eta is not None:
            report.figures.append(eta)
    for make in (_lengths, _buckets, _latency, _errors):
        f = make(con)
        if f is not None:
            report.figures.append(f)
    report.settings = _settings(manifest or {})
    return report


def _row_filter(con) -> str:
    """With n > 1 a row's samples are output rows of their own (sample_index 0 .. n-1): a row counts once."""
    columns = {r[0] for r in con.execute("describe results").fetchall()}
    return "coalesce(sample_index, 0) = 0" if "sample_index" in columns else "true"


def _deadline(lanes) -> Optional[float]:
    """A sample taken between forecasts carries the last one's time left, and one past the deadline 0: the
    earliest end that a sample still before it gives is the deadline's."""
    ends = [s["t"] + s["deadline_left_s"] for _, samples, _ in lanes for s in samples
            if s.get("deadline_left_s") is not None and s["deadline_left_s"] > 0]
    return min(ends) if ends else None


def _progress(lanes, deadline) -> Figure:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for label, samples, _ in lanes:
        if not samples:
            continue
        t = _times([s["t"] for s in samples])
        ax1.plot(t, [s["rows_done"] for s in samples], label=label)
        ax2.plot(t, [s["output_tokens_per_s"] for s in samples], label=label)
    for ax in (ax1, ax2):
        if deadline is not None:
            ax.axvline(dt.datetime.fromtimestamp(deadline), color="red", linestyle="--", label="deadline")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("rows done")
    ax2.set_ylabel("output tokens/s")
    ax2.set_xlabel("time")
    ax1.legend(loc="upper left", fontsize=8)
    _clock_axis(ax2.xaxis)
    fig.autofmt_xdate()
    return Figure("progress", "Rows done and output tokens/s over time", _png(fig),
                  "One line per shard or worker; rows done include earlier attempts'.")


def _forecast(lanes, deadline) -> Optional[Figure]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.5))
    drawn = False
    finish = max((s["t"] for _, samples, _ in lanes for s in samples), default=None)
    for label, samples, _ in lanes:
        pts = [(s["t"], s["t"] + s["eta_s"]) for s in samples if s.get("eta_s") is not None]
        if pts:
            drawn = True
            ax.plot(_times([p[0] for p in pts]), _times([p[1] for p in pts]), label=f"{label}: forecast finish")
    if not drawn:
        plt.close(fig)
        return None
    if finish is not None:
        ax.axhline(dt.datetime.fromtimestamp(finish), color="green", linestyle=":", label="last sample (finish)")
    if deadline is not None:
        ax.axhline(dt.datetime.fromtimestamp(deadline), color="red", linestyle="--", label="deadline")
    ax.set_xlabel("when forecast")
    ax.set_ylabel("forecast finish")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _clock_axis(ax.xaxis)
    _clock_axis(ax.yaxis)
    fig.autofmt_xdate()
    return Figure("forecast", "The ETA as it evolved", _png(fig),
                  "Each point is the finish the job forecast at that moment; an honest forecast is flat.")


def _lengths(con) -> Optional[Figure]:
    from overnight.buckets.metrics import kendall_tau

    rows = con.execute("select predicted_tokens, output_tokens from results where status = 'ok' and "
                       "predicted_tokens is not null and output_tokens is not null").fetchall()
    if len(rows) < 2:
        return None
    pred = np.array([r[0] for r in rows], dtype=float)
    actual = np.array([r[1] for r in rows], dtype=float)
    tau = kendall_tau(pred, actual)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.scatter(np.maximum(pred, 1), np.maximum(actual, 1), s=6, alpha=0.4)
    hi = max(pred.max(), actual.max(), 2)
    ax.plot([1, hi], [1, hi], color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted output tokens")
    ax.set_ylabel("actual output tokens")
    ax.grid(alpha=0.3, which="both")
    ax.set_title(f"Kendall's tau {tau:.3f}, mean predicted {pred.mean():.0f} vs actual {actual.mean():.0f}",
                 fontsize=9)
    return Figure("lengths", "Predicted against actual output length", _png(fig), f"Kendall's tau: {tau:.3f}")


def _buckets(con) -> Optional[Figure]:
    rows = con.execute(f"select bucket, count(*) from results where bucket is not null and {_row_filter(con)} "
                       f"group by 1 order by 1").fetchall()
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar([str(b) for b, _ in rows], [k for _, k in rows])
    ax.set_xlabel("length bucket (0: shortest predicted)")
    ax.set_ylabel("rows")
    ax.grid(alpha=0.3, axis="y")
    return Figure("buckets", "Rows per length bucket", _png(fig))


def _latency(con) -> Optional[Figure]:
    rows = con.execute(f"select epoch(finished_at - queued_at) from results where status = 'ok' and "
                       f"finished_at is not null and queued_at is not null and {_row_filter(con)}").fetchall()
    if not rows:
        return None
    lat = np.array([r[0] for r in rows], dtype=float)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.hist(lat, bins=min(50, max(5, len(lat) // 20)))
    p50, p90 = np.percentile(lat, [50, 90])
    ax.axvline(p50, color="black", linestyle="--", label=f"p50 {p50:.1f} s")
    ax.axvline(p90, color="red", linestyle="--", label=f"p90 {p90:.1f} s")
    ax.set_xlabel("seconds from queued to finished")
    ax.set_ylabel("rows")
    ax.legend(fontsize=8)
    return Figure("latency", "Latency, queued to finished", _png(fig))


def _errors(con) -> Figure:
    rows = con.execute("select regexp_replace(error, '^[^:]*#[0-9]+: ', ''), count(*) from results "
                       "where status = 'error' group by 1 order by 2 desc limit 10").fetchall()
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.35 * max(1, len(rows))))
    if rows:
        labels = [(m[:80] + "...") if len(m) > 80 else m for m, _ in rows][::-1]
        ax.barh(labels, [k for _, k in rows][::-1], color="tab:red")
        ax.set_xlabel("rows")
    else:
        ax.text(0.5, 0.5, "no error rows", ha="center", va="center")
        ax.set_axis_off()
    return Figure("errors", "Errors by message", _png(fig))


def _settings(manifest: dict) -> list[tuple[str, str]]:
    cfg = manifest.get("config", {})
    out = [("model", str(manifest.get("fingerprint_fields", {}).get("model")))]
    for section in ("engine", "sampling", "scheduler"):
        for k, v in (cfg.get(section) or {}).items():
            if v not in (None, [], ""):
                out.append((f"{section}.{k}", str(v)))
    return out


def render_html(report: Report) -> str:
    def table(rows):
        return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                                   for k, v in rows) + "</table>"

    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>overnight report: {html.escape(report.out)}</title>",
             "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse}th,td{padding:2px 10px;text-align:left;border-bottom:1px solid #ddd}"
             "th{font-weight:600}img{max-width:100%}figure{margin:2em 0}figcaption{color:#555}</style>",
             "</head><body>", "<h1>overnight report</h1>", table(report.summary)]
    for f in report.figures:
        data = base64.b64encode(f.png).decode()
        parts.append(f"<figure><h2>{html.escape(f.title)}</h2><img alt='{html.escape(f.name)}' "
                     f"src='data:image/png;base64,{data}'><figcaption>{html.escape(f.note)}</figcaption></figure>")
    if report.settings:
        parts += ["<h2>Settings</h2>", table(report.settings)]
    parts.append("</body></html>")
    return "\n".join(parts)


def write(report: Report, html_path: Optional[str], png_dir: Optional[str]) -> list[str]:
    written = []
    option = "--html"
    try:
        if html_path:
            with open(html_path, "w", encoding="utf-8") as f:
                f.write(render_html(report))
            written.append(html_path)
        option = "--png"
        if png_dir:
            os.makedirs(png_dir, exist_ok=True)
            for fig in report.figures:
                path = os.path.join(png_dir, f"{fig.name}.png")
                with open(path, "wb") as f:
                    f.write(fig.png)
                written.append(path)
    except OSError as e:
        raise OutputError(f"{option} {html_path if option == '--html' else png_dir}: cannot be written "
                          f"({e.strerror or e}); give a path in a folder that exists and is writable.") from None
    return written
