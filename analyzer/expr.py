"""Report expressions (``--where``, ``--controls``) evaluated over a table's columns, never as code.

The text is parsed with :mod:`ast` and the tree walked here over an allow-list of node types; nothing is handed to
``eval``, ``DataFrame.query`` or ``DataFrame.eval``. What is allowed (pandas ``query`` syntax, a subset):

- column names, and `` `backticked names` `` for columns that are not identifiers;
- numbers, strings, True/False, and list or tuple literals of them (on the right of ``in``/``not in``/``==``/``!=``);
- arithmetic ``+ - * / // % **``, unary ``- + ~ not``; comparisons (chained too); ``and or & |`` (``&`` and ``|``
  bind like ``and`` and ``or``, below comparisons, as in pandas);
- ``in`` / ``not in`` a list literal (``Series.isin``), and ``==`` / ``!=`` a list literal, as pandas reads them;
- the functions in :data:`FUNCTIONS` (log, log10, log1p, exp, sqrt, abs, ...);
- string methods ``column.str.<m>(literal args)`` for ``m`` in :data:`STR_METHODS`;
- missing values: ``column.isna()`` / ``isnull()`` and ``column.notna()`` / ``notnull()``; and a missing text
  equals the empty string, so ``tag == ''`` and ``tag.isna()`` both select the untagged rows (``tag != ''`` the
  tagged ones).

Everything else (``@`` names, other attribute access, dunder names, calls of anything else, subscripts, lambdas,
comprehensions, f-strings, ``:=``) is refused with a one-line :class:`UserError` naming the problem and the columns.

Budget, part of the language: an expression is at most :data:`MAX_LENGTH` characters and nested at most
:data:`MAX_DEPTH` levels (each operator, call, comparison or bracket is a level; a chain ``a + b + c`` is two), and
the power of two literals has an exponent of at most 1000. Arithmetic (``+ - * / // % **``, unary ``- +``) and
the functions take numbers only, as fixed-width numpy values (:func:`_number`): text, a text column or a result
of ``.str`` is refused (``run * 300000000`` would repeat every name 300 million times), a column of Python objects
is read as float64 and every number is float64 in arithmetic (integers too: int64 wraps, ``6.9e9 ** 2 < 0``; a
result beyond float64 is inf; a negative literal to a fractional power, a complex number, is refused), so no
intermediate result is larger than a column of the table and no element costs more than a machine operation;
``.str`` methods keep or shrink the text. Regular expressions (``contains``, ``match``,
``fullmatch``) run on RE2 (Arrow's ``match_substring_regex``), which takes time linear in the text and has no
backreferences or lookaround: a pattern RE2 does not accept is refused, never handed to Python's backtracking ``re``.
``flags=`` takes ``re.IGNORECASE`` (2), ``re.MULTILINE`` (8), ``re.DOTALL`` (16) or their sum, given to RE2 as
``(?ims)``; ``case=False`` is ``(?i)``. So every allowed expression is evaluated in time linear in the table's rows
times its length, and anything over the budget is refused at once with one line naming the limit.
"""
from __future__ import annotations

import ast
import io
import operator
import re
import tokenize

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ncanalyze.core.errors import UserError

FUNCTIONS = {"log": np.log, "log10": np.log10, "log2": np.log2, "log1p": np.log1p, "exp": np.exp,
             "expm1": np.expm1, "sqrt": np.sqrt, "abs": np.abs}
STR_METHODS = {"contains": {"case", "regex", "na", "flags"}, "startswith": {"na"}, "endswith": {"na"},
               "match": {"case", "na", "flags"}, "fullmatch": {"case", "na", "flags"}, "lower": set(),
               "upper": set(), "strip": set(), "len": set()}
NA_METHODS = {"isna": False, "isnull": False, "notna": True, "notnull": True}  # column.<m>(): True where (not) missing
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge}
MAX_LENGTH = 1000  # characters of one expression
MAX_DEPTH = 50  # levels of nesting of its tree
_REGEX_METHODS = {"contains", "match", "fullmatch"}
_RE2_FLAGS = {2: "i", 8: "m", 16: "s"}  # re.IGNORECASE, re.MULTILINE, re.DOTALL as RE2's inline flags
_MAX_LITERAL_POW = 1000  # |exponent| of a power of two literals: 10**10**10 would hang the parser's user
_BACKTICK = re.compile(r"`([^`]*)`")
# a string literal (kept as it is: a backtick in it is text) or a backticked column name
_STRING_OR_BACKTICK = re.compile(r"""('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")|`([^`]*)`""")
_NAMES = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
          ast.BitAnd: "&", ast.BitOr: "|", ast.MatMult: "@", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>",
          ast.Is: "is", ast.IsNot: "is not"}


class _Refused(Exception):
    """Why an expression is not allowed or cannot be evaluated (becomes the UserError's middle part)."""


def _describe(node: ast.AST) -> str:
    kind = type(node)
    if kind in _NAMES:
        return f"operator {_NAMES[kind]!r}"
    return {ast.Subscript: "subscripts ([...])", ast.Lambda: "lambda", ast.ListComp: "comprehensions",
            ast.SetComp: "comprehensions", ast.DictComp: "comprehensions", ast.GeneratorExp: "comprehensions",
            ast.IfExp: "conditional expressions (x if c else y)", ast.JoinedStr: "f-strings",
            ast.NamedExpr: "assignment (:=)", ast.Dict: "dict literals", ast.Set: "set literals",
            ast.Starred: "starred expressions", ast.Attribute: "attribute access"}.get(kind, kind.__name__)


class _Evaluator:
    def __init__(self, df: pd.DataFrame, aliases: dict[str, str]):
        self.df, self.aliases = df, aliases

    def __call__(self, node: ast.AST):
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise _Refused(f"{_describe(node)} not allowed")
        return method(node)

    # leaves
    def _Constant(self, node: ast.Constant):
        if isinstance(node.value, bool | int | float | str):
            return node.value
        raise _Refused(f"literal {node.value!r} not allowed (numbers, strings, True/False only)")

    def _Name(self, node: ast.Name):
        name = self.aliases.get(node.id, node.id)
        if name in self.df.columns:
            return self.df[name]
        if node.id.startswith("__") or "__" in node.id:
            raise _Refused(f"name {node.id!r} not allowed (no dunder names)")
        if node.id in FUNCTIONS:
            raise _Refused(f"function {node.id!r} must be called, e.g. {node.id}(n_params)")
        raise _Refused(f"unknown name {node.id!r} (not a column)")

    def _literal_list(self, node: ast.AST) -> list:
        if not isinstance(node, ast.List | ast.Tuple):
            raise _Refused("'in' needs a list literal on its right, e.g. global_step in [20, 40]")
        values = [self(e) for e in node.elts]
        if any(isinstance(v, pd.Series) for v in values):
            raise _Refused("list elements must be literals")
        return values

    def _List(self, node):
        raise _Refused("a list literal is allowed only on the right of in, not in, == or !=")

    _Tuple = _List

    # operators
    def _UnaryOp(self, node: ast.UnaryOp):
        v = self(node.operand)
        if isinstance(node.op, ast.USub | ast.UAdd):
            v = _number(v, "-" if isinstance(node.op, ast.USub) else "+")
            return -v if isinstance(node.op, ast.USub) else +v
        if isinstance(node.op, ast.Not | ast.Invert):
            if isinstance(v, pd.Series):
                return ~v
            if isinstance(v, bool) or isinstance(node.op, ast.Not):
                return not v
            return ~v
        raise _Refused(f"{_describe(node.op)} not allowed")

    def _BinOp(self, node: ast.BinOp):
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise _Refused(f"{_describe(node.op)} not allowed")
        name = _NAMES[type(node.op)]
        a, b = self(node.left), self(node.right)
        if isinstance(a, str) or isinstance(b, str):
            raise _Refused(f"{name!r} on a string not allowed")
        a, b = _number(a, name), _number(b, name)
        if op is operator.pow and not isinstance(a, pd.Series) and not isinstance(b, pd.Series):
            if abs(b) > _MAX_LITERAL_POW:
                raise _Refused(f"exponent {b} of two literals too large")
            if a < 0 and not float(b).is_integer():
                raise _Refused(f"({a:g}) ** {b:g} is not a real number (a negative base to a fractional power)")
        with np.errstate(all="ignore"):
            return op(a, b)

    def _BoolOp(self, node: ast.BoolOp):
        op = operator.and_ if isinstance(node.op, ast.And) else operator.or_
        out = self(node.values[0])
        for v in node.values[1:]:
            out = op(out, self(v))
        return out

    def _Compare(self, node: ast.Compare):
        out, left = None, self(node.left)
        for cmp, right_node in zip(node.ops, node.comparators):
            if isinstance(cmp, ast.In | ast.NotIn) or (isinstance(cmp, ast.Eq | ast.NotEq)
                                                       and isinstance(right_node, ast.List | ast.Tuple)):
                values = self._literal_list(right_node)
                right = None
                res = left.isin(values) if isinstance(left, pd.Series) else left in values
                if isinstance(cmp, ast.NotIn | ast.NotEq):
                    res = ~res if isinstance(res, pd.Series) else not res
            elif type(cmp) in _CMPOPS:
                right = self(right_node)
                res = _CMPOPS[type(cmp)](*_empty_is_missing(left, right))
            else:
                raise _Refused(f"{_describe(cmp)} not allowed")
            out = res if out is None else out & res
            left = right
        return out

    # calls: the allowed functions and column.str.<method>(...)
    def _Call(self, node: ast.Call):
        if isinstance(node.func, ast.Name):
            name = node.func.id
            if name not in FUNCTIONS or name in self.aliases:
                raise _Refused(f"call of {name!r} not allowed (functions: {', '.join(FUNCTIONS)})")
            if len(node.args) != 1 or node.keywords:
                raise _Refused(f"{name}() takes one argument")
            with np.errstate(all="ignore"):
                return FUNCTIONS[name](_number(self(node.args[0]), f"{name}()"))
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in NA_METHODS and not isinstance(f.value, ast.Attribute):
            series = self(f.value)
            if not isinstance(series, pd.Series) or node.args or node.keywords:
                raise _Refused(f".{f.attr}() takes no arguments and needs a column, e.g. tag.{f.attr}()")
            missing = series.isna() | (series.astype(object).fillna("").astype(str).str.strip() == "") if _text(
                series) else series.isna()
            return ~missing if NA_METHODS[f.attr] else missing
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "str"
                and f.attr in STR_METHODS):
            series = self(f.value.value)
            if not isinstance(series, pd.Series):
                raise _Refused(f".str.{f.attr} needs a column")
            args = [self(a) for a in node.args]
            kwargs = {}
            for kw in node.keywords:
                if kw.arg not in STR_METHODS[f.attr]:
                    raise _Refused(f"keyword {kw.arg!r} of .str.{f.attr} not allowed")
                kwargs[kw.arg] = self(kw.value)
            if any(isinstance(a, pd.Series) for a in [*args, *kwargs.values()]):
                raise _Refused(f".str.{f.attr} takes literal arguments")
            if f.attr in _REGEX_METHODS:
                return _regex(series, f.attr, *args, **kwargs)
            return getattr(series.str, f.attr)(*args, **kwargs)
        if isinstance(f, ast.Attribute):
            raise _Refused(f"method .{f.attr}() not allowed (string methods: "
                           f"{', '.join(f'.str.{m}' for m in STR_METHODS)}; "
                           f"{', '.join(f'.{m}()' for m in NA_METHODS)})")
        raise _Refused(f"call of {_describe(f)} not allowed")

    def _Attribute(self, node: ast.Attribute):
        raise _Refused(f"attribute access .{node.attr} not allowed (only column.str.<method>(...) calls)")


def _number(v, op: str):
    """``v`` as an operand of arithmetic: a bool, or float64 (a number, a numeric column, a column of Python objects
    holding numbers): integers never wrap (int64 does) and overflow gives inf, as numpy's floats do; a
    :class:`_Refused` for text (``'a' * 9``, ``run * 300000000``: repetition) or anything else, so that every result
    is at most a column of 8-byte numbers."""
    if isinstance(v, bool | np.bool_):
        return v
    if isinstance(v, int | float | np.integer | np.floating):
        return np.float64(v)  # int64 wraps (6.9e9 ** 2 < 0); a Python int grows; a Python float raises on overflow
    if isinstance(v, pd.Series):
        if pd.api.types.is_bool_dtype(v.dtype):
            return v
        if pd.api.types.is_numeric_dtype(v.dtype) and v.dtype != object:
            return v.astype(np.float64)  # integer columns too: their products wrap on int64
        numbers = pd.to_numeric(v, errors="coerce")
        if not _text(v) or v.dropna().map(lambda x: isinstance(x, int | float | np.number)).all():
            if numbers.notna().sum() == v.notna().sum():
                return numbers.astype(float)
        raise _Refused(f"{op!r} on text ({v.name or 'a .str result'}) not allowed: arithmetic takes numbers "
                       "(text is compared, or tested with .str methods)")
    if isinstance(v, str):
        raise _Refused(f"{op!r} on a string not allowed")
    raise _Refused(f"{op!r} on {type(v).__name__} not allowed")


def _text(s) -> bool:
    """A column of text (pandas' ``str`` or object dtype), or of missing values only (an all-untagged ``tag``)."""
    return isinstance(s, pd.Series) and (pd.api.types.is_string_dtype(s.dtype) or s.dtype == object
                                         or bool(s.isna().all()))


def _empty_is_missing(left, right) -> tuple:
    """A text column compared with ``''``: its missing values read as ``''`` (an untagged row has no tag)."""
    if isinstance(right, str) and right == "" and _text(left):
        return left.astype(object).fillna(""), right
    if isinstance(left, str) and left == "" and _text(right):
        return left, right.astype(object).fillna("")
    return left, right


def _regex(series: pd.Series, method: str, pat=None, case: bool = True, flags: int = 0, na=None,
           regex: bool = True) -> pd.Series:
    """``series.str.<method>(pat, ...)`` on RE2 (linear time), never Python's backtracking ``re``: a boolean Series,
    False (or ``na``) where ``series`` is missing, as pandas' ``str`` dtype gives it."""
    if not isinstance(pat, str):
        raise _Refused(f".str.{method} takes a string pattern, e.g. .str.{method}('neo')")
    if not isinstance(flags, int) or isinstance(flags, bool) or flags & ~sum(_RE2_FLAGS):
        raise _Refused(f"flags={flags!r} not allowed: RE2 takes re.IGNORECASE (2), re.MULTILINE (8), re.DOTALL (16) "
                       "or their sum")
    if not isinstance(case, bool) or not isinstance(regex, bool):
        raise _Refused(f".str.{method}: case= and regex= take True or False")
    if pd.api.types.infer_dtype(series, skipna=True) not in ("string", "empty"):
        raise _Refused(f".str.{method} needs a text column ({series.name} holds {series.dtype} values)")
    text = pa.array(series.astype("string[pyarrow]"))
    inline = "".join(c for bit, c in _RE2_FLAGS.items() if flags & bit) + ("i" if not case else "")
    if method == "contains" and not regex:
        mask = pc.match_substring(text, pat, ignore_case="i" in inline)
    else:
        anchored = {"contains": "{}", "match": r"\A(?:{})", "fullmatch": r"\A(?:{})\z"}[method].format(pat)
        try:
            mask = pc.match_substring_regex(text, (f"(?{''.join(sorted(set(inline)))})" if inline else "") + anchored)
        except pa.ArrowInvalid as e:
            raise _Refused(f"regex {pat!r} not accepted by RE2, the linear-time engine expressions use (no "
                           f"backreferences, lookaround or possessive forms): {str(e).split(': ', 1)[-1]}") from None
    out = pd.Series(mask.to_pandas(types_mapper={pa.bool_(): pd.BooleanDtype()}.get).array, index=series.index)
    return out.fillna(False if na is None else na).astype(bool)  # as pandas' str dtype: a missing text is False


def _depth(tree: ast.AST) -> int:
    """The nesting depth of ``tree``, counted without recursion."""
    deepest, todo = 0, [(tree, 1)]
    while todo:
        node, d = todo.pop()
        deepest = max(deepest, d)
        todo.extend((child, d + 1) for child in ast.iter_child_nodes(node) if not isinstance(child, ast.expr_context))
    return deepest


def _boolean_precedence(text: str) -> str:
    """``&`` and ``|`` read as ``and`` and ``or`` (below comparisons), as pandas ``query`` reads them."""
    words = {"&": "and", "|": "or"}
    toks = [(tokenize.NAME, words[t.string]) if t.type == tokenize.OP and t.string in words else (t.type, t.string)
            for t in tokenize.generate_tokens(io.StringIO(text).readline)]
    return tokenize.untokenize(toks)


def _parse(expr: str, columns) -> tuple[ast.AST, dict[str, str]]:
    """The expression's tree and the placeholder names standing for its backticked columns."""
    aliases: dict[str, str] = {}

    def alias(m: re.Match) -> str:
        name = f"BACKTICKED_{len(aliases)}_"
        while name in columns:
            name += "_"
        aliases[name] = m.group(2)
        if m.group(2) not in columns:
            raise _Refused(f"unknown column `{m.group(2)}`")
        return name

    if len(expr) > MAX_LENGTH:
        raise _Refused(f"{len(expr)} characters, over the limit of {MAX_LENGTH}: shorten it")
    if "@" in _BACKTICK.sub("", re.sub(r"'[^']*'|\"[^\"]*\"", "", expr)):
        raise _Refused("'@' (local variables) not allowed")
    text = _STRING_OR_BACKTICK.sub(lambda m: m.group(0) if m.group(1) else alias(m), expr)
    try:
        tree = ast.parse(_boolean_precedence(text.strip()), mode="eval")
    except (SyntaxError, tokenize.TokenError) as e:
        if "too many nested" in str(e):
            raise _Refused(f"nested deeper than the limit of {MAX_DEPTH} levels: simplify it") from None
        raise _Refused(f"syntax error ({e.msg if isinstance(e, SyntaxError) else e.args[0]})") from None
    except (RecursionError, MemoryError):
        raise _Refused(f"nested deeper than the limit of {MAX_DEPTH} levels: simplify it") from None
    if _depth(tree.body) > MAX_DEPTH:
        raise _Refused(f"nested {_depth(tree.body)} levels deep, over the limit of {MAX_DEPTH}: simplify it")
    return tree.body, aliases


def evaluate(expr: str, df: pd.DataFrame, what: str = "expression"):
    """The value of ``expr`` over ``df``'s columns: a Series aligned with ``df`` (or a scalar when no column is
    used). Raises UserError naming ``what`` (e.g. "--where"), the problem and the columns."""
    try:
        tree, aliases = _parse(expr, set(df.columns))
        return _Evaluator(df, aliases)(tree)
    except _Refused as e:
        problem = str(e)
    except (TypeError, ValueError, AttributeError, KeyError, ZeroDivisionError, OverflowError) as e:
        problem = f"cannot be evaluated ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    except RecursionError:
        problem = f"nested deeper than the limit of {MAX_DEPTH} levels: simplify it"
    except MemoryError:
        problem = "needs more memory than there is (an intermediate result too large): simplify it"
    raise UserError(f"{what} {_shown(expr)}: {problem}; {_columns(df)}")


def _columns(df: pd.DataFrame, most: int = 300) -> str:
    """``columns: a, b, ...`` for a message, cut after ``most`` characters (the count of the rest said)."""
    names, shown = [str(c) for c in df.columns], ""
    for i, name in enumerate(names):
        if len(shown) + len(name) > most:
            return f"columns: {shown} ... and {len(names) - i} more"
        shown += (", " if shown else "") + name
    return f"columns: {shown}"


def _shown(expr: str, most: int = 120) -> str:
    """``expr`` quoted for a message, cut to its first ``most`` characters when longer."""
    return repr(expr) if len(expr) <= most else f"{expr[:most]!r}... ({len(expr)} characters)"


def condition(expr: str, df: pd.DataFrame, what: str = "--where") -> pd.Series:
    """The boolean mask of ``expr`` over ``df`` (pandas ``query`` semantics: missing values do not match)."""
    v = evaluate(expr, df, what)
    if not isinstance(v, pd.Series):
        if isinstance(v, bool | np.bool_):
            return pd.Series(bool(v), index=df.index)
        raise UserError(f"{what} {_shown(expr)}: not a condition (it gives {v!r}); {_columns(df)}")
    if v.dtype != bool:
        if v.dtype == object and v.map(lambda x: isinstance(x, bool | np.bool_) or x is None or x is pd.NA).all():
            return v.fillna(False).astype(bool)
        if str(v.dtype) == "boolean":
            return v.fillna(False).astype(bool)
        raise UserError(f"{what} {_shown(expr)}: not a condition (it gives {v.dtype} values, not True/False); "
                        f"{_columns(df)}")
    return v
