"""`overnight status OUT`: the job as a whole and per shard, from the files each shard keeps in OUT.

It reads status.json, manifest.json and the lock of every job folder in OUT (see output.layout); it writes
nothing. A shard whose status says running but whose lock holder is gone is reported as stopped: it was
killed, and rerunning its command continues it.
"""

from __future__ import annotations

from typing import Optional

from overnight.pipeline.output.checkpoint import OutputDir, OutputError
from overnight.pipeline.output.layout import combined_state, job_dirs
from overnight.pipeline.output.lock import RunLock
from overnight.pipeline.progress import fmt_duration
from overnight.pipeline.report import eta_for

EXIT_ORDER = (69, 1, 75)  # the job's exit code is the first of these any shard had, else 0


def _is_running(out: OutputDir) -> bool:
    lock = RunLock(out)
    holder = lock.holder()
    return holder is not None and not lock.is_stale(holder)


def is_current(st: Optional[dict], m: Optional[dict]) -> bool:
    """Whether status.json is the latest attempt's. An attempt writes its first status at its first flush, so
    until then (and for good when it is killed before) the file is an earlier attempt's: its counts and exit code
    are not this attempt's."""
    attempts = (m or {}).get("attempts") or []
    if not st or not attempts:
        return bool(st)
    if isinstance(st.get("attempt"), int):
        return st["attempt"] >= len(attempts)
    started, updated = attempts[-1].get("started_at"), st.get("updated_at")  # a status without its attempt
    return not (started and updated and updated < started)


def duplicates(d) -> int:
    """Input rows of job folder ``d`` skipped as duplicate ids (neither done nor left), as far as its latest
    attempt has read."""
    st, m = d.out.read_status(), d.out.read_manifest()
    counts = (m or {}).get("counts", {})
    if isinstance(counts.get("num_duplicates"), int):
        return counts["num_duplicates"]
    return (((st or {}).get("rows") or {}).get("duplicates") or 0) if is_current(st, m) else 0


def unrecorded_rows(out: OutputDir, counts: dict) -> int:
    """Rows in the parts that the manifest's counts do not know yet: a run killed between writing a part and
    updating its manifest leaves one such part (the next run's scan counts it). Only the parts past the
    manifest's ``num_parts`` are read, and of them only the sample_index column; a row of n samples counts once."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from overnight.pipeline.output.checkpoint import PART_RE

    known = counts.get("num_parts")
    if not isinstance(known, int):
        return 0
    paths = sorted(out.part_paths(), key=lambda p: int(PART_RE.match(p.rsplit("/", 1)[-1]).group(1)))
    rows = 0
    for p in paths[known:]:
        try:
            with out.fs.open(p, "rb") as f:
                pf = pq.ParquetFile(f, pre_buffer=False)
                if "sample_index" not in pf.schema_arrow.names:
                    rows += pf.metadata.num_rows
                    continue
                col = pf.read(columns=["sample_index"], use_threads=False).column(0)
                rows += col.length() - pc.sum(pc.fill_null(pc.not_equal(col, 0), False).cast("int64")).as_py() \
                    if col.length() else 0
        except (OSError, ValueError):  # a damaged part: inspect names it with its fix; status counts what it can
            continue
    return rows


def shard_status(d, lock_of: OutputDir) -> dict:
    st, m = d.out.read_status() or {}, d.out.read_manifest() or {}
    if not is_current(st, m):
        st = {}  # an earlier attempt's: the manifest's counts stand, the exit code is not known yet
    state = st.get("state") or m.get("state") or "not started"
    if m.get("state") == "running" and state != "running":
        state = "running"  # a new attempt began; its first status is written at its first flush
    if state == "running" and not _is_running(lock_of):
        state = "stopped"
    rows = st.get("rows", {})
    counts = m.get("counts", {})
    total = rows.get("total", counts.get("num_rows"))
    done = max(rows.get("done") or 0, counts.get("num_done") or 0)
    if rows.get("removed"):  # the run knows of results no longer in the input: the manifest counts them, it not
        done = rows.get("done") or 0
    extra = unrecorded_rows(d.out, counts) if state != "running" and state != "completed" else 0
    done += extra
    # Duplicate ids are skipped, neither done nor left; a completed job has none left.
    dup = rows.get("duplicates") or counts.get("num_duplicates") or 0
    if d.worker is not None:  # a Ray worker's folder: all the rows it holds (its units this attempt are fewer)
        done = max(counts.get("num_done") or 0, (rows.get("ok") or 0) + (rows.get("error") or 0))
    elif total is not None:  # the output's rows may include some no longer in the input
        done = min(done, max(0, total - dup))
    left = rows.get("remaining")
    if left is None:
        left = None if total is None else max(0, total - done - dup)  # (done counts the rows unrecorded)
    elif extra:
        left = max(0, left - extra)  # the status's figure, from before the part its manifest does not know
    return {"shard": d.label, "state": state, "rows_total": total, "rows_done": done,
            "rows_left": 0 if state == "completed" else left,
            "output_tokens_per_s": st.get("output_tokens_per_s") if state == "running" else None,
            "eta_s": eta_for(state, st.get("eta_s")),
            "exit_code": st.get("exit_code") if state != "running" else None,
            "attempts": len(m.get("attempts", [])), "updated_at": st.get("updated_at") or m.get("updated_at"),
            "run_id": m.get("run_id"), "out": d.out.shown()}


def job_status(url: str) -> dict:
    out = OutputDir(url)
    if not out.fs.exists(out.root):
        raise OutputError(f"Output folder {url} does not exist. Pass the --out folder of a run.")
    dirs = job_dirs(url)
    driver = out.read_status() if not any(d.shard is None and d.worker is None for d in dirs) else None
    if driver and "workers" in driver:
        return _ray_status(out, dirs, driver)
    if not dirs and not driver and _is_running(out):  # a run holds OUT and has written nothing yet (a Ray driver
        # reading the input's ids and placing its workers, a job opening): starting, not "no job"
        return {"out": out.shown(), "state": "starting", "shards": None, "rows_total": None, "rows_done": 0,
                "rows_left": None, "output_tokens_per_s": None, "eta_s": None, "exit_code": None, "per_shard": []}
    if not dirs:
        raise OutputError(f"{url} holds no overnight job (no manifest.json or parts/, at its top or in shards/). "
                          f"Pass the --out folder of a run.")
    shards = [shard_status(d, d.out) for d in dirs]
    n = max((d.shard.n for d in dirs if d.shard is not None), default=None)
    if n is not None:
        present = {d.shard.k for d in dirs if d.shard is not None}
        for k in sorted(set(range(n)) - present):
            shards.append({"shard": f"{k}/{n}", "state": "not started", "rows_total": None, "rows_done": 0,
                           "rows_left": None, "output_tokens_per_s": None, "eta_s": None, "exit_code": None,
                           "attempts": 0, "updated_at": None, "run_id": None, "out": None})
        shards.sort(key=lambda s: int(s["shard"].split("/")[0]) if s["shard"] != "-" else -1)
    states = [s["state"] for s in shards]
    state = combined_state(["running" if s == "stopped" else s for s in states], len(shards))
    if "stopped" in states and state == "running" and "running" not in states:
        state = "stopped"
    totals = [s["rows_total"] for s in shards]
    total = sum(totals) if None not in totals else None
    done = sum(s["rows_done"] or 0 for s in shards)
    lefts = [s["rows_left"] for s in shards]
    etas = [s["eta_s"] for s in shards]
    codes = [s["exit_code"] for s in shards]
    exit_code: Optional[int] = None
    if state not in ("running", "not started") and None not in codes:
        exit_code = next((c for c in EXIT_ORDER if c in codes), 0)
    return {"out": out.shown(), "state": state, "shards": len(shards) if n is not None else None,
            "rows_total": total, "rows_done": done,
            "rows_left": sum(lefts) if total is not None and None not in lefts else None,
            # the running shards' rates; none known yet (no status written): not known, not 0
            "output_tokens_per_s": (round(sum(s["output_tokens_per_s"] or 0 for s in shards), 2)
                                    if any(s["output_tokens_per_s"] is not None for s in shards) else None),
            "eta_s": max(etas) if None not in etas else None, "exit_code": exit_code,
            "per_shard": shards}


def _ray_status(out: OutputDir, dirs, driver: dict) -> dict:
    """A job on Ray workers: the driver's status for the whole, each worker's folder for its line. The workers
    run while the driver holds OUT's lock."""
    state = driver.get("state", "running")
    if state == "running" and not _is_running(out):
        state = "stopped"
    rows = driver.get("rows", {})
    n = driver.get("workers")
    workers = []
    for d in dirs:
        if d.worker is None:
            continue
        w = shard_status(d, out)
        w["rows_total"] = w["rows_left"] = None  # a worker's share is whatever units it took
        if isinstance(n, int) and d.worker >= n:  # a folder of an earlier attempt with more workers: its rows
            # count, its state (running, stopped, its exit code) is not this attempt's
            w.update(state="not in this run", output_tokens_per_s=None, eta_s=None, exit_code=None)
        workers.append(w)
    done, left = rows.get("done", 0), rows.get("remaining")
    if state == "stopped":  # a driver killed: its last status is older than what its workers' folders hold
        # (less the rows whose ids left the input, as the driver counted them at its start: a folder holds them)
        held = sum(w["rows_done"] or 0 for w in workers) - (rows.get("removed") or 0)
        if held > done and isinstance(rows.get("total"), int):
            done, left = min(held, rows["total"]), max(0, rows["total"] - held)
    return {"out": out.shown(), "state": state, "shards": None, "workers": driver.get("workers"),
            "rows_total": rows.get("total"), "rows_done": done, "rows_left": left,
            "output_tokens_per_s": driver.get("output_tokens_per_s") if state == "running" else None,
            "eta_s": eta_for(state, driver.get("eta_s")), "exit_code": driver.get("exit_code"), "per_shard": workers}


def status_lines(s: dict) -> list[str]:
    total = "?" if s["rows_total"] is None else s["rows_total"]
    left = "?" if s["rows_left"] is None else s["rows_left"]
    head = f"{s['out']}: {s['state']}"
    if s.get("workers"):
        head += f", {s['workers']} Ray workers"
    if s["shards"]:
        counts: dict = {}
        for p in s["per_shard"]:
            counts[p["state"]] = counts.get(p["state"], 0) + 1
        head += f", {s['shards']} shards (" + ", ".join(f"{v} {k}" for k, v in counts.items()) + ")"
    rate = "-" if s["output_tokens_per_s"] is None else f"{s['output_tokens_per_s']:.0f}"
    lines = [head, f"rows: {s['rows_done']} done of {total}, {left} left; {rate} tok/s; "
                   f"ETA {fmt_duration(s['eta_s'])}; exit code {'-' if s['exit_code'] is None else s['exit_code']}"]
    cols = ("shard", "state", "done", "left", "tok/s", "ETA", "exit", "attempts", "updated")
    rows = [(p["shard"], p["state"], str(p["rows_done"]), "?" if p["rows_left"] is None else str(p["rows_left"]),
             "-" if p["output_tokens_per_s"] is None else f"{p['output_tokens_per_s']:.0f}",
             fmt_duration(p["eta_s"]) if p["eta_s"] is not None else "-",
             "-" if p["exit_code"] is None else str(p["exit_code"]), str(p["attempts"]), p["updated_at"] or "-")
            for p in s["per_shard"]]
    if not rows:  # a Ray job whose workers have written no folder yet (starting, or an empty input)
        return lines
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    return lines
