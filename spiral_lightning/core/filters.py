"""The filter language: a subset of SQL's ``WHERE`` clause, parsed once and compiled per backend.

A filter is text such as ``label < 5 AND name LIKE 'cat%' AND score IS NOT NULL``: comparisons of
a column with a literal, ``AND``/``OR``/``NOT``, ``IN``, ``BETWEEN``, ``IS [NOT] NULL`` and
``LIKE``. ``parse`` turns it into a small tree of plain values; ``to_spiral`` and ``to_arrow``
compile the tree against a table's schema, typing each literal from its column's type, so the
same text keeps the same rows on every backend (SQL's rule included: a comparison with a null
keeps no row).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import spiral
import sqlglot
from sqlglot import expressions as sql

#: A node of a compiled expression tree.
_Node = TypeVar("_Node")

#: A literal of the language: SQL's numbers, strings and booleans.
Scalar: TypeAlias = int | float | str | bool

#: Comparison operators of the language, and the operator that reads the other way round.
_FLIPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "=", "!=": "!="}
_COMPARISONS: dict[type[sql.Expr], str] = {
    sql.LT: "<",
    sql.LTE: "<=",
    sql.GT: ">",
    sql.GTE: ">=",
    sql.EQ: "=",
    sql.NEQ: "!=",
}


class Compare(NamedTuple):
    """``column op value`` with ``op`` one of ``< <= > >= = !=``."""

    column: str
    op: str
    value: Scalar


class InSet(NamedTuple):
    """``column IN (values...)``."""

    column: str
    values: tuple[Scalar, ...]


class IsNull(NamedTuple):
    """``column IS NULL``."""

    column: str


class Like(NamedTuple):
    """``column LIKE pattern``: ``%`` matches any run of characters, ``_`` any one character."""

    column: str
    pattern: str


class And(NamedTuple):
    left: Filter
    right: Filter


class Or(NamedTuple):
    left: Filter
    right: Filter


class Not(NamedTuple):
    operand: Filter


#: A parsed filter: a tree of the values above.
Filter: TypeAlias = Compare | InSet | IsNull | Like | And | Or | Not


def parse(text: str) -> Filter:
    """The tree of ``text``; ``ValueError`` quoting the part the language does not have."""
    try:
        tree = sqlglot.parse_one(text)
    except sqlglot.errors.SqlglotError as error:
        raise ValueError(f"cannot parse the filter {text!r}: {_fault(error)}; {_LANGUAGE}") from None
    return _node(tree, text)


#: What the filter language has, for errors.
_LANGUAGE = (
    "a filter compares columns with literals (x < 5, name = 'cat') and joins them with AND, OR, NOT, IN (...), "
    "BETWEEN, IS [NOT] NULL and LIKE"
)


def _fault(error: sqlglot.errors.SqlglotError) -> str:
    """Where the parser stopped, in the words of the filter rather than of the parser's classes."""
    if isinstance(error, sqlglot.errors.ParseError) and error.errors:
        first = error.errors[0]
        where = f"at column {first.get('col')}"
        word = first.get("highlight") or ""
        if str(first.get("description", "")).startswith("Required keyword"):
            return f"{word!r} {where} has nothing to compare or join after it"
        return f"{first.get('description')} near {word!r} {where}"
    return "a quote is not closed, or a character is not part of the language"


def _node(node: sql.Expr, text: str) -> Filter:
    if isinstance(node, sql.Paren):
        return _node(node.this, text)
    if isinstance(node, sql.And):
        return And(_node(node.this, text), _node(node.expression, text))
    if isinstance(node, sql.Or):
        return Or(_node(node.this, text), _node(node.expression, text))
    if isinstance(node, sql.Not):
        return Not(_node(node.this, text))
    if type(node) in _COMPARISONS:
        op = _COMPARISONS[type(node)]
        if isinstance(node.this, sql.Column):
            return Compare(_column(node.this, text), op, _literal(node.expression, text))
        if isinstance(node.expression, sql.Column):
            return Compare(_column(node.expression, text), _FLIPPED[op], _literal(node.this, text))
        _column(node.this, text)
    if isinstance(node, sql.In) and not node.args.get("query"):
        return InSet(_column(node.this, text), tuple(_literal(value, text) for value in node.expressions))
    if isinstance(node, sql.Between):
        column = _column(node.this, text)
        low, high = _literal(node.args["low"], text), _literal(node.args["high"], text)
        return And(Compare(column, ">=", low), Compare(column, "<=", high))
    if isinstance(node, sql.Is) and isinstance(node.expression, sql.Null):
        return IsNull(_column(node.this, text))
    if isinstance(node, sql.Like):
        pattern = _literal(node.expression, text)
        if not isinstance(pattern, str):
            raise ValueError(f"LIKE takes a string pattern, not {node.expression.sql()!r} in the filter {text!r}")
        return Like(_column(node.this, text), pattern)
    raise ValueError(
        f"the filter {text!r} uses {node.sql()!r}, which the filter language does not have; it has comparisons "
        "of a column with a literal, AND, OR, NOT, IN, BETWEEN, IS [NOT] NULL and LIKE"
    )


def _column(node: sql.Expr, text: str) -> str:
    if not isinstance(node, sql.Column) or node.table:
        raise ValueError(f"expected a column name, not {node.sql()!r}, in the filter {text!r}")
    return str(node.name)


def _literal(node: sql.Expr, text: str) -> Scalar:
    if isinstance(node, sql.Neg) and isinstance(node.this, sql.Literal) and not node.this.is_string:
        value = _literal(node.this, text)
        assert isinstance(value, int | float)
        return -value
    if isinstance(node, sql.Boolean):
        return bool(node.this)
    if isinstance(node, sql.Literal):
        if node.is_string:
            return str(node.this)
        number = str(node.this)
        return float(number) if any(mark in number for mark in ".eE") else int(number)
    raise ValueError(f"expected a literal, not {node.sql()!r}, in the filter {text!r}")


def columns(tree: Filter) -> set[str]:
    """The columns ``tree`` reads."""
    if isinstance(tree, And | Or):
        return columns(tree.left) | columns(tree.right)
    if isinstance(tree, Not):
        return columns(tree.operand)
    return {tree.column}


class _Typed(NamedTuple):
    """A literal converted to its column's type: the Python value and the Arrow type."""

    value: Scalar
    type: pa.DataType


def _typed(value: Scalar, field: pa.Field, text: str) -> _Typed:
    """``value`` as a value of ``field``'s type, or ``ValueError`` naming both."""
    kind = field.type
    mismatch = ValueError(f"column {field.name!r} has type {kind}, which the literal {value!r} in {text!r} is not")
    if pa.types.is_boolean(kind):
        if not isinstance(value, bool):
            raise mismatch
        return _Typed(value, kind)
    if isinstance(value, bool):
        raise mismatch
    if pa.types.is_integer(kind):
        if not isinstance(value, int):
            raise mismatch
        if not _fits(value, kind):
            raise ValueError(f"the literal {value} in {text!r} is out of the range of column {field.name!r} ({kind})")
        return _Typed(value, kind)
    if pa.types.is_floating(kind):
        if not isinstance(value, int | float):
            raise mismatch
        return _Typed(float(value), kind)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        if not isinstance(value, str):
            raise mismatch
        return _Typed(value, kind)
    raise ValueError(
        f"column {field.name!r} has type {kind}; the filter language compares numbers, strings and booleans ({text!r})"
    )


def _fits(value: int, kind: pa.DataType) -> bool:
    bits = int(kind.bit_width)
    if pa.types.is_unsigned_integer(kind):
        return 0 <= value < 1 << bits
    return -(1 << (bits - 1)) <= value < 1 << (bits - 1)


def _field(schema: pa.Schema, name: str, text: str) -> pa.Field:
    if name not in schema.names:
        raise ValueError(f"unknown column {name!r} in the filter {text!r}; the table has {schema.names}")
    return schema.field(name)


#: Vortex literal type names by Arrow type, for Spiral.
_SPIRAL_TYPES = {
    pa.bool_(): "bool",
    pa.string(): "utf8",
    pa.large_string(): "utf8",
    **{getattr(pa, f"int{b}")(): f"i{b}" for b in (8, 16, 32, 64)},
    **{getattr(pa, f"uint{b}")(): f"u{b}" for b in (8, 16, 32, 64)},
    pa.float32(): "f32",
    pa.float64(): "f64",
}
_SPIRAL_COMPARE: dict[str, Callable[[spiral.Expression, spiral.Expression], spiral.Expression]] = {
    "<": spiral.lt,
    "<=": spiral.lte,
    ">": spiral.gt,
    ">=": spiral.gte,
    "=": spiral.eq,
    "!=": spiral.not_eq,
}


def to_spiral(tree: Filter, schema: pa.Schema, text: str) -> spiral.Expression:
    """``tree`` as a Spiral expression over a table of ``schema``."""

    def literal(value: Scalar, field: pa.Field) -> spiral.Expression:
        typed = _typed(value, field, text)
        return spiral.literal(typed.value, _SPIRAL_TYPES[typed.type])

    def build(node: Filter) -> spiral.Expression:
        if isinstance(node, And):
            return spiral.and_(build(node.left), build(node.right))
        if isinstance(node, Or):
            return spiral.or_(build(node.left), build(node.right))
        if isinstance(node, Not):
            return spiral.not_(build(node.operand))
        field = _field(schema, node.column, text)
        column = spiral.column(node.column)
        if isinstance(node, Compare):
            return _SPIRAL_COMPARE[node.op](column, literal(node.value, field))
        if isinstance(node, InSet):
            return _balanced(spiral.or_, [spiral.eq(column, literal(value, field)) for value in node.values])
        if isinstance(node, IsNull):
            return spiral.is_null(column)
        _typed(node.pattern, field, text)
        return spiral.call("spql.like", column, spiral.literal(node.pattern))

    return build(tree)


def _balanced(combine: Callable[[_Node, _Node], _Node], parts: list[_Node]) -> _Node:
    """``parts`` combined in pairs, then pairs of pairs: a tree ``log2(len(parts))`` deep, where
    one value after another would nest a long ``IN`` list past the depth spiral-sdk decodes."""
    while len(parts) > 1:
        parts = [combine(*parts[i : i + 2]) if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


_ARROW_COMPARE: dict[str, Callable[[Any, Any], pc.Expression]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "=": operator.eq,
    "!=": operator.ne,
}


def to_arrow(tree: Filter, schema: pa.Schema, text: str) -> pc.Expression:
    """``tree`` as a ``pyarrow.compute`` expression over a table of ``schema``."""

    def literal(value: Scalar, field: pa.Field) -> pa.Scalar:
        typed = _typed(value, field, text)
        return pa.scalar(typed.value, typed.type)

    def build(node: Filter) -> pc.Expression:
        if isinstance(node, And):
            return build(node.left) & build(node.right)
        if isinstance(node, Or):
            return build(node.left) | build(node.right)
        if isinstance(node, Not):
            return ~build(node.operand)
        field = _field(schema, node.column, text)
        column = pc.field(node.column)
        if isinstance(node, Compare):
            return _ARROW_COMPARE[node.op](column, literal(node.value, field))
        if isinstance(node, InSet):
            values = [_typed(value, field, text).value for value in node.values]
            return column.isin(pa.array(values, field.type))
        if isinstance(node, IsNull):
            return column.is_null()
        _typed(node.pattern, field, text)
        return pc.match_like(column, node.pattern)

    return build(tree)
