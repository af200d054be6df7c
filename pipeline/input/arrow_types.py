"""Arrow types and batches as the job reads them: which column types are text or ids, which unify across files,
and each batch conformed to the input's one schema (missing columns as nulls, ids that are not UTF-8 as null)."""

from __future__ import annotations

import json
from typing import Optional

import pyarrow as pa

# Field metadata on a batch's id column whose text ids were not valid UTF-8: {row number: reason} as JSON. Those
# ids read as null, so the hash split and the resume filter key such a row by its origin, as they key a null id
# (and match its error row by it); ``validate`` makes each one an error row saying why.
BAD_IDS_KEY = b"overnight.invalid_ids"
# A request column's values that could not take the type the files share: {row number: the value, as text}
BAD_VALUES_KEY = b"overnight.uncast_values"


def is_string_view(t: pa.DataType) -> bool:
    return getattr(pa.types, "is_string_view", lambda _: False)(t)


def is_text(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or is_string_view(t) or pa.types.is_null(t))


def is_id_type(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t) or is_string_view(t)


def compatible(a: pa.DataType, b: pa.DataType, bytes_are_text: bool = False) -> bool:
    """Whether two files' types of one column unify: the same, null, both integers, both floats, both text
    (with ``bytes_are_text``, bytes too: the prompt or chat column), or structs and lists whose fields merge; a
    dictionary-encoded column by its values' type."""
    a = a.value_type if pa.types.is_dictionary(a) else a
    b = b.value_type if pa.types.is_dictionary(b) else b
    if a == b or pa.types.is_null(a) or pa.types.is_null(b):
        return True
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        return True
    if pa.types.is_floating(a) and pa.types.is_floating(b):
        return True
    if nested(a) and nested(b):
        return merged(a, b) is not None
    text = (pa.types.is_string, pa.types.is_large_string, is_string_view)
    if bytes_are_text:  # text written without Parquet's UTF8 annotation, as validate reads a prompt or chat column:
        text += (pa.types.is_binary, pa.types.is_large_binary)  # read as binary, the type both cast to
    return any(f(a) for f in text) and any(f(b) for f in text)


def merged(a: pa.DataType, b: pa.DataType) -> Optional[pa.DataType]:
    """Structs of other fields (a JSON schema per file) as one type: their fields merged, a file's missing ones
    null (as a struct column's rows of one file already are); a field's own type is not promoted (text would
    become bytes, int64 uint64): the same in both, or null. None when they do not merge."""
    try:
        return pa.unify_schemas([pa.schema([("c", a)]), pa.schema([("c", b)])], promote_options="default")[0].type
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None


def nested(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) or pa.types.is_list(t) or pa.types.is_large_list(t)


def plain(schema: pa.Schema) -> pa.Schema:
    """The schema with string_view columns as string (binary_view as binary), and a dictionary-encoded column (a
    pandas category) as its values' type, which every file's columns unify with and the output holds."""
    fields = []
    for f in schema:
        if pa.types.is_dictionary(f.type):
            f = f.with_type(f.type.value_type)
        if is_string_view(f.type):
            f = f.with_type(pa.string())
        elif getattr(pa.types, "is_binary_view", lambda _: False)(f.type):
            f = f.with_type(pa.binary())
        fields.append(f)
    return pa.schema(fields, metadata=schema.metadata)


class ColumnCastError(ValueError):
    """A column's values in one file cannot be cast to the type every file's columns share."""

    def __init__(self, column: str, source: pa.DataType, target: pa.DataType, cause: Exception):
        super().__init__(f"column {column!r}: {source} -> {target}: {cause}")
        self.column, self.source, self.target, self.cause = column, source, target, cause


def conform(batch: pa.RecordBatch, schema: pa.Schema, ids: Optional[str] = None, first: int = 0,
            per_row=()) -> pa.RecordBatch:
    """The batch with exactly the schema's columns and types: missing columns as nulls, widths unified.

    ids: the id column, whose text ids that are not valid UTF-8 become null, with their reasons in the column's
    metadata (BAD_IDS_KEY; first: the batch's first row number). per_row: columns whose values are each a row's own
    (a request's seed, max_tokens ...): one that cannot take the shared type (a uint64 above int64's range) is null,
    with the value in the column's metadata (BAD_VALUES_KEY), and its row an error row; in another column it stops
    the job (ColumnCastError)."""
    if not len(schema):
        return batch.select([])  # no columns, but the batch's rows (a hash split counting an input without ids)
    arrays, fields = [], list(schema)
    for j, f in enumerate(schema):
        i = batch.schema.get_field_index(f.name)
        col = batch.column(i) if i >= 0 else pa.nulls(batch.num_rows, f.type)
        if col.type != f.type:
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:  # a uint64 above int64's range ...
                if f.name not in per_row:
                    raise ColumnCastError(f.name, col.type, f.type, e) from None
                col, bad = _cast_each(col, f.type, first)
                fields[j] = f.with_metadata({BAD_VALUES_KEY: json.dumps(bad).encode()})
        if f.name == ids and (pa.types.is_string(f.type) or pa.types.is_large_string(f.type)):
            col, bad = valid_ids(col, first)
            if bad:
                fields[j] = f.with_metadata({BAD_IDS_KEY: json.dumps(bad).encode()})
        arrays.append(col)
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=schema.metadata))


def _cast_each(col: pa.Array, to: pa.DataType, first: int) -> tuple[pa.Array, dict]:
    """The values that take the type, the others null; {row number: value as text} of those."""
    values, bad = [], {}
    for r, v in enumerate(col.to_pylist()):
        try:
            values.append(pa.array([v], col.type).cast(to)[0].as_py())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            values.append(None)
            bad[str(first + r)] = repr(v)[:80]
    return pa.array(values, to), bad


def valid_ids(col: pa.Array, first: int) -> tuple[pa.Array, dict]:
    """The ids with those that are not valid UTF-8 as null, and {row number: reason} of those."""
    try:
        col.validate(full=True)
        return col, {}
    except pa.ArrowInvalid:
        pass
    values, bad = [], {}
    for r, raw in enumerate(col.cast(pa.binary() if pa.types.is_string(col.type) else pa.large_binary()).to_pylist()):
        try:
            values.append(None if raw is None else raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            values.append(None)
            bad[str(first + r)] = f"byte {e.start} is not valid UTF-8 ({raw[e.start:e.start + 1]!r})"
    return pa.array(values, col.type), bad
