"""The rows done in OUT, predicted again and matched with their lengths there.

    rows = predicted_done_rows(cfg, source, model, annotator, scan, limit)  # parsed, tokenized, predicted
    got = done_lengths(out_url, cfg.input.id_column, [r.id for r in rows])   # their ok results' lengths

`plan --out` scales its predictions by actual over its own predictions of these rows, and a resumed run's online
predictor learns from them (``warm_start``) before its first row: the predictions a run recorded are not the ones
a fresh predictor makes (under `online`, the prior's for the first rows and the refitted model's after).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from overnight.pipeline.input.resume import DoneRows
from overnight.pipeline.input.stage import prepare

log = logging.getLogger("overnight")

# Done rows a resumed run's online predictor learns from: its window (buckets/predictors.py).
WARM_ROWS = 1024


def predicted_done_rows(cfg, source, model, annotator, scan, limit: int) -> list:
    """The first ``limit`` rows of the input that OUT holds (one per id), as the input stage prepares them."""
    rows: list = []
    for batch in prepare(cfg, source, model, annotator, DoneRows(scan, limit)):
        rows.extend(batch.rows)
    return rows


@dataclass
class DoneLengths:
    index: np.ndarray        # positions (in the ids asked for) of the rows with ok results
    completions: np.ndarray  # results of each (a row asking for n samples has n)
    mean_tokens: np.ndarray  # output tokens of a completion, on average
    hit_cap: np.ndarray      # a completion ran to max_tokens


def done_lengths(out_url: str, id_column: str, ids: list) -> Optional[DoneLengths]:
    """The ok results in OUT of these ids (every shard's or worker's); None where OUT's results lack the columns."""
    import pyarrow as pa

    from overnight.pipeline.tools.inspection import open_results

    con, _ = open_results(out_url)
    try:
        cols = {r[0] for r in con.execute("describe results").fetchall()}
        if not ids or not {"status", "output_tokens", "finish_reason", id_column} <= cols:
            return None
        con.register("_asked", pa.table({"pos": pa.array(np.arange(len(ids), dtype=np.int64)), "id": pa.array(ids)}))
        quoted = '"' + id_column.replace('"', '""') + '"'
        got = con.execute(f"select a.pos, count(*), avg(r.output_tokens), bool_or(r.finish_reason = 'length') "
                          f"from results r join _asked a on r.{quoted} = a.id where r.status = 'ok' "
                          f"group by a.pos order by a.pos").fetchall()
    finally:
        con.close()
    cols = list(zip(*got)) if got else [(), (), (), ()]
    return DoneLengths(np.asarray(cols[0], dtype=np.int64), np.asarray(cols[1], dtype=np.float64),
                       np.asarray(cols[2], dtype=np.float64), np.asarray(cols[3], dtype=bool))


def warm_start(cfg, source, model, annotator, scan, out_url: str, limit: int = WARM_ROWS) -> int:
    """A resumed run's online predictor learns from the rows done before (the first ``limit`` in input order), as
    it would have from rows finished in this run, so that the order and the forecast go by what it learned from
    the first row, not from the prior until 256 more rows finish. Returns the rows it learned from.

    ``scan``: every id done in OUT (a Ray worker's: every worker folder's); ``out_url``: the folder whose results
    hold them (a Ray worker's: OUT's root)."""
    from overnight.buckets.annotate import LengthAnnotator
    from overnight.buckets.features import stack

    if not annotator.predictor.learns or not len(scan.done):
        return 0
    # its own annotator: the job's takes its buckets' bounds from the first rows it runs
    rows = predicted_done_rows(cfg, source.second_pass(), model,
                               LengthAnnotator(annotator.predictor, cfg.sampling.max_tokens), scan, limit)
    got = done_lengths(out_url, cfg.input.id_column, [r.id for r in rows])
    if got is None or not len(got.index):
        return 0
    # predictions are per sequence: a row of n samples teaches its mean sample's length, as in the run
    annotator.predictor.observe(stack([rows[i].features for i in got.index]), np.rint(got.mean_tokens),
                                got.hit_cap)
    return len(got.index)


def after_warm_start(batches, cfg, source, model, annotator, scan, out_url: str, tally=None,
                     on_work: Callable[[], None] = lambda: None):
    """The input stage's ``batches``; on a resume, once the first row left to answer is read, the online predictor
    first learns from the rows done before (in the reader's thread), and that batch's rows are predicted again. A
    rerun that finds every row done does not pay for it (at 10M rows done, a query over all their parts).
    ``on_work`` hears of that first row before the learning begins: the engine may start meanwhile."""
    pending = bool(len(scan.done)) and annotator.predictor.learns
    for batch in batches:
        if pending and batch.rows:
            pending = False
            on_work()
            _learn(cfg, source, model, annotator, scan, out_url, batch.rows, tally)
        yield batch


def _learn(cfg, source, model, annotator, scan, out_url: str, rows: list, tally) -> None:
    t0 = time.perf_counter()
    try:
        learned = warm_start(cfg, source, model, annotator, scan, out_url)
        if learned:
            before = sum(r.predicted_tokens or 0 for r in rows)
            annotator.predict_again(rows)
            if tally is not None:  # (it counted the batch's predictions before)
                tally.predicted_tokens += sum(r.predicted_tokens or 0 for r in rows) - before
    except Exception as e:  # learning is an aid: the run goes on from the prior's predictions
        log.warning(f"the length predictor could not learn from the rows done before ({type(e).__name__}: {e}); "
                    f"it starts from its prior, as in a new run")
        return
    if learned:
        log.info(f"the length predictor learned from {learned} rows done before ({time.perf_counter() - t0:.1f} s)")
