"""The output rows' Arrow schema: the id, the passthrough columns (renamed ``input_<name>`` where they clash with
a result field), then the result fields; ``sample_index`` when a job asks for n > 1, ``logprobs`` when it asks for
logprobs. ``OutputSchema.table`` turns a list of results into one part's table (``writer.CheckpointWriter``
writes it), one output row per sample.
"""

from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa

from overnight.pipeline.records import Result

# The logprobs column: per generated token, the chosen token and its K most likely alternatives, best first.
TOKEN_LOGPROB = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())])
LOGPROBS_TYPE = pa.list_(pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32()),
                                    ("top_logprobs", pa.list_(TOKEN_LOGPROB))]))


class OutputSchema:
    """Arrow schema of output rows: id, passthrough columns, then the result fields.

    With ``samples`` (the job asks for n > 1: --n or an ``n`` column) each completion of a row is an output row,
    numbered by ``sample_index`` (0 .. n-1; an error row has 0), all of a row's in the same part; with ``logprobs``
    (--logprobs or a ``logprobs`` column) a ``logprobs`` column holds each token's. Jobs that ask for neither have
    neither column."""

    def __init__(self, id_name: str, id_type: pa.DataType, passthrough: list[pa.Field], samples: bool = False,
                 logprobs: bool = False, renamed_before: Optional[dict] = None):
        """renamed_before: the renames an OUT's earlier attempts recorded (its manifest's), where it has some:
        a column that clashes with a result field only in case keeps its own name unless they renamed it (an OUT
        begun before names clashed without case wrote it so, and one column keeps one name in every part)."""
        from overnight.pipeline.records import RESULT_FIELDS, SAMPLE_FIELDS

        reserved = set(RESULT_FIELDS) | set(SAMPLE_FIELDS) | {id_name}
        exact = set(reserved)
        self.id_name = id_name
        self.samples = samples
        self.logprobs = logprobs
        # Input column name -> output column name; clashes with result fields get an "input_" prefix (again, while
        # that too is a name taken: an input with both "text" and "input_text" keeps both). Names clash without
        # regard to case, as DuckDB reads them: a part with "Status" and "status" is read with "status_1".
        reserved = {n.lower() for n in reserved}
        taken = reserved | {f.name.lower() for f in passthrough}
        self.renames = {}
        for f in passthrough:
            name = f.name
            legacy = renamed_before is not None and name not in exact and name not in renamed_before
            if name.lower() in reserved and not legacy:
                name = f"input_{name}"
                while name.lower() in taken:
                    name = f"input_{name}"
                taken.add(name.lower())
            self.renames[f.name] = name
        # Naive UTC: DuckDB and pandas read it without a timezone database.
        ts = pa.timestamp("ms")
        self.schema = pa.schema(
            [pa.field(id_name, id_type)]
            + [pa.field(self.renames[f.name], f.type) for f in passthrough]
            + ([pa.field("sample_index", pa.int32())] if samples else [])
            + [
                pa.field("text", pa.string()),
                pa.field("finish_reason", pa.string()),
                pa.field("prompt_tokens", pa.int32()),
                pa.field("output_tokens", pa.int32()),
                pa.field("predicted_tokens", pa.int32()),
                pa.field("bucket", pa.int16()),
                pa.field("queued_at", ts),
                pa.field("first_token_at", ts),
                pa.field("finished_at", ts),
                pa.field("status", pa.string()),
                pa.field("error", pa.string()),
                pa.field("prompt_hash", pa.string()),
                pa.field("engine_seconds", pa.float64()),
            ]
            + ([pa.field("logprobs", LOGPROBS_TYPE)] if logprobs else [])
            + [
                pa.field("run_id", pa.string()),
                pa.field("model", pa.string()),
            ]
        )

    def table(self, results: list[Result], run_id: str, model: str) -> pa.Table:
        cols: dict[str, Any] = {}
        if self.samples or self.logprobs:
            results, cols["sample_index"], cols["logprobs"] = _by_sample(results)
        n = len(results)
        cols[self.id_name] = [r.id for r in results]
        for src, dst in self.renames.items():
            cols[dst] = [r.passthrough.get(src) for r in results]
        for name in ("text", "finish_reason", "prompt_tokens", "output_tokens", "predicted_tokens", "bucket",
                     "status", "error", "prompt_hash", "engine_seconds"):
            cols[name] = [getattr(r, name) for r in results]
        for name in ("queued_at", "first_token_at", "finished_at"):
            cols[name] = [None if getattr(r, name) is None else int(getattr(r, name) * 1000) for r in results]
        cols["run_id"] = [run_id] * n
        cols["model"] = [r.adapter or model for r in results]  # a row run through an adapter: the adapter
        arrays = [pa.array(cols[f.name], type=f.type) for f in self.schema]
        return pa.Table.from_arrays(arrays, schema=self.schema)


def _by_sample(results: list[Result]) -> tuple[list[Result], list[int], list]:
    """One result per completion (text, finish reason and tokens its own; the row's engine time shared evenly),
    with its sample_index and logprobs."""
    from dataclasses import replace

    rows, index, logprobs = [], [], []
    for r in results:
        if not r.samples:
            rows.append(r)
            index.append(0)
            logprobs.append(None)
            continue
        share = None if r.engine_seconds is None else r.engine_seconds / len(r.samples)
        for s in r.samples:
            rows.append(replace(r, text=s.text, finish_reason=s.finish_reason, output_tokens=s.num_output_tokens,
                                engine_seconds=share, samples=None))
            index.append(s.index)
            logprobs.append(s.logprobs)
    return rows, index, logprobs
