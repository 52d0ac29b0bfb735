"""Token columns: a spec that reads only the token column, and the check that a column holds token
ids. Packed streams and token-budget batches read a table so."""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa

from spiral_lightning.core.spec import TableSpec


def token_spec(spec: TableSpec, column: str, kind: str) -> TableSpec:
    """``spec`` reading only the token ``column``; ``ValueError`` naming the dataset ``kind`` for
    options it cannot honour, since it yields token ids alone."""
    if spec.columns is not None and column not in spec.columns:
        raise ValueError(f"the token column {column!r} is not among the columns {list(spec.columns)} of {spec.uri!r}")
    if spec.media or spec.padded:
        raise ValueError(
            f"a {kind} yields only the token column {column!r}, so the spec's media and padded projections "
            "do not apply; drop them from the spec"
        )
    if spec.null_fill or spec.null_mask:
        raise ValueError(
            f"a {kind} batches whole documents, so null_fill and null_mask do not apply; keep null documents "
            f"out with filter='{column} IS NOT NULL'"
        )
    return replace(spec, columns=(column,))


def check_token_column(schema: pa.Schema, column: str, uri: str, kind: str) -> None:
    """``ValueError`` unless ``column`` of ``schema`` (the table ``uri``'s) holds a list of integers per row."""
    found = schema.field(column).type
    if not (pa.types.is_list(found) or pa.types.is_large_list(found)) or not pa.types.is_integer(found.value_type):
        raise ValueError(
            f"a {kind} reads a column of token ids (a list or large_list of integers per row), not {column!r} of "
            f"type {found} in {uri!r}"
        )
