"""The tracer of chapter 11's modifiers: a ``score_mod`` or ``mask_mod`` evaluated on kernel values.

A modifier is a plain Python function. While a flex kernel factory builds its ``@T.prim_func`` it calls
the ``ModifierPlan``'s ``score``, ``score_and_derivative`` and ``mask`` on its index expressions, and
those call the modifier on

* ``Sym`` values: each operator returns a TileLang expression, so the formula is inlined into the
  generated C or CUDA;
* ``Dual`` numbers (value, derivative): the chain rule through ``score_mod`` for the backward, from one
  evaluation on ``Dual(score, 1)``.

The helpers (``where``, ``tanh``, ``exp``, …) take tensors, kernel values and Duals alike, and so do the
torch functions they stand for. A tensor a modifier indexes with b, h, q_idx or kv_idx (or declares
with ``captured``) becomes a slot of the kernels' two packed inputs (``ModifierPlan.pack``).
``plan_modifiers`` checks and traces the modifiers; ``cached_plan`` reuses a trace while nothing the
modifiers read has changed. ``ModifierPlan.key`` is what a compiled kernel depends on, and plans are
equal when their keys are (the compile cache's key, ``api.compiled``). The front door and the block
masks are ``api.flex``; the float64 reference is ``checking.flex_reference``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import types

import tilelang.language as T
import torch
from tilelang import tvm

__all__ = ["captured", "Captured", "where", "tanh", "exp", "log", "sqrt", "abs", "minimum", "maximum", "sigmoid",
           "clamp", "ReadOutOfRange", "Sym", "Dual", "ModifierPlan", "plan_modifiers", "cached_plan", "HELPERS",
           "name_of", "float64_reads", "fixed_module"]

_tir = tvm.tirx
HELPERS = ("where", "tanh", "exp", "log", "sqrt", "abs", "minimum", "maximum")


# --- Kernel-side values ----------------------------------------------------------------------------------------

def _const(x, dtype):
    return _tir.const(x, dtype)


def _as_expr(x):
    """A TileLang expression for a Sym or a Python number (floats become float32)."""
    if isinstance(x, Sym):
        return x.expr
    if isinstance(x, tvm.ir.PrimExpr):
        return x
    if isinstance(x, bool):
        return _const(x, "bool")
    if isinstance(x, int):
        if not -2 ** 31 <= x < 2 ** 31:
            raise ValueError(f"the integer {x} does not fit the kernel's int32 index arithmetic (a kernel value "
                             "is an int32): keep index constants below 2**31, or compute with floats")
        return _const(x, "int32")
    if isinstance(x, float):
        return _const(x, "float32")
    raise TypeError(f"a kernel value cannot be combined with a {type(x).__name__}")


def _promote(a, b):
    """Both operands as expressions of one type: float32 if either is a float, else int32 (bools count as 0/1)."""
    a, b = _as_expr(a), _as_expr(b)
    floating = "float" in a.dtype or "float" in b.dtype
    dtype = "float32" if floating else "int32"
    return (a if a.dtype == dtype else _tir.Cast(dtype, a)), (b if b.dtype == dtype else _tir.Cast(dtype, b))


def _need_bool(x, op):
    e = _as_expr(x)
    if e.dtype != "bool":
        raise TypeError(f"`{op}` combines conditions (booleans); got a {e.dtype} value")
    return e


def _safe(op):
    """An integer // or % whose divisor may be 0 at run time: 0 there (torch raises; C would stop the process)."""
    def apply(a, b):
        if "float" in a.dtype or (isinstance(b, _tir.IntImm) and b.value != 0):
            return op(a, b)
        return _tir.if_then_else(b == 0, _const(0, a.dtype), op(a, _tir.if_then_else(b == 0, _const(1, b.dtype), b)))
    return apply


def _torch_function(cls, func, types, args=(), kwargs=None):
    """torch functions on kernel values and Duals: the ones a modifier can use map to the course helpers, and a
    tensor indexed by b, h, q_idx or kv_idx becomes a kernel input (as ``captured`` makes it)."""
    kwargs = kwargs or {}
    if func is torch.Tensor.__getitem__:
        return _index_tensor(*args)
    name = getattr(func, "__name__", str(func))
    helper = _TORCH_HELPERS.get(name)
    if helper is None or func not in (getattr(torch, name, None), getattr(torch.Tensor, name, None)):
        raise TypeError(f"torch.{name} cannot be compiled into a kernel; the torch functions a modifier can use "
                        f"are torch.{', torch.'.join(sorted(_TORCH_HELPERS))} (and Python's operators)")
    return helper(*args, **kwargs)


class Sym:
    """A value inside a kernel being built: wraps a TileLang expression and gives it Python's operators.

    Why not the bare expressions? TVM's ``~`` on a boolean is a *bitwise* not, which C evaluates
    to −2 (true) for true: ``~(q_idx >= kv_idx)`` would hide nothing. Here ``~``, ``&`` and ``|`` on
    booleans are logical, ``/`` is a float division (as in torch), and using a kernel value where
    Python needs a plain bool (``if``, ``and``, ``or``) raises instead of tracing one branch.
    """

    __slots__ = ("expr",)
    __torch_function__ = classmethod(_torch_function)

    def __init__(self, expr):
        self.expr = expr

    @property
    def dtype(self):
        return str(self.expr.dtype)

    def __repr__(self):
        return f"Sym({self.expr})"

    def _bin(self, other, fn, reverse=False):
        if isinstance(other, Dual):
            return NotImplemented
        a, b = _promote(other, self) if reverse else _promote(self, other)
        return Sym(fn(a, b))

    def __add__(self, o): return self._bin(o, lambda a, b: a + b)
    def __radd__(self, o): return self._bin(o, lambda a, b: a + b, True)
    def __sub__(self, o): return self._bin(o, lambda a, b: a - b)
    def __rsub__(self, o): return self._bin(o, lambda a, b: a - b, True)
    def __mul__(self, o): return self._bin(o, lambda a, b: a * b)
    def __rmul__(self, o): return self._bin(o, lambda a, b: a * b, True)

    def __truediv__(self, o):
        return self._bin(o, lambda a, b: _tir.Cast("float32", a) / _tir.Cast("float32", b))

    def __rtruediv__(self, o):
        return self._bin(o, lambda a, b: _tir.Cast("float32", a) / _tir.Cast("float32", b), True)

    def __floordiv__(self, o): return self._bin(o, _safe(_tir.floordiv))
    def __rfloordiv__(self, o): return self._bin(o, _safe(_tir.floordiv), True)
    def __mod__(self, o): return self._bin(o, _safe(_tir.floormod))
    def __rmod__(self, o): return self._bin(o, _safe(_tir.floormod), True)
    def __neg__(self): return Sym(-_promote(self, 0)[0])
    def __lt__(self, o): return self._bin(o, lambda a, b: a < b)
    def __le__(self, o): return self._bin(o, lambda a, b: a <= b)
    def __gt__(self, o): return self._bin(o, lambda a, b: a > b)
    def __ge__(self, o): return self._bin(o, lambda a, b: a >= b)
    def __eq__(self, o): return self._bin(o, _tir.EQ)
    def __ne__(self, o): return self._bin(o, _tir.NE)
    def __and__(self, o): return Sym(_tir.And(_need_bool(self, "&"), _need_bool(o, "&")))
    __rand__ = __and__
    def __or__(self, o): return Sym(_tir.Or(_need_bool(self, "|"), _need_bool(o, "|")))
    __ror__ = __or__
    def __invert__(self): return Sym(_tir.Not(_need_bool(self, "~")))
    __hash__ = None

    def _new(self, size, fill, dtype):
        if tuple(size) not in ((), (1,)):
            raise TypeError(f"a kernel value makes scalars only (new_zeros/new_ones of size (), not {tuple(size)})")
        dtype = self.dtype if dtype is None else {torch.bool: "bool"}.get(
            dtype, "float32" if dtype.is_floating_point else "int32")
        return Sym(_const(bool(fill) if dtype == "bool" else fill, dtype))

    def new_zeros(self, size, dtype=None, **_):
        """A scalar 0 (False for torch.bool), as ``Tensor.new_zeros(())`` (torch's and_masks/or_masks use it)."""
        return self._new(size, 0, dtype)

    def new_ones(self, size, dtype=None, **_):
        """A scalar 1 (True for torch.bool), as ``Tensor.new_ones(())``."""
        return self._new(size, 1, dtype)

    def __bool__(self):
        raise TypeError("a kernel value has no Python truth value: `if`, `and`, `or`, `not` and chained comparisons "
                        "cannot be compiled; write where(cond, a, b), &, |, ~ instead")

    def __float__(self):
        raise TypeError("a kernel value cannot become a Python float (math.* functions cannot be compiled); use the "
                        f"course helpers {', '.join(HELPERS)}")

    __int__ = __index__ = __float__


class Dual:
    """A value with its derivative with respect to the score: forward-mode differentiation of a score_mod.

    ``value`` and ``deriv`` are torch tensors, Syms or numbers; the operators and helpers apply the
    chain rule, so ``score_mod(Dual(s, 1), ...)`` returns ``Dual(score_mod(s), ∂score_mod/∂s)``.
    Comparisons compare values (their result has no derivative).
    """

    __slots__ = ("value", "deriv")
    __torch_function__ = classmethod(_torch_function)

    def __init__(self, value, deriv=0.0):
        self.value, self.deriv = value, deriv

    def __repr__(self):
        return f"Dual({self.value!r}, {self.deriv!r})"

    @staticmethod
    def parts(x):
        return (x.value, x.deriv) if isinstance(x, Dual) else (x, 0.0)

    def __add__(self, o):
        (a, da), (b, db) = Dual.parts(self), Dual.parts(o)
        return Dual(a + b, da + db)

    __radd__ = __add__

    def __sub__(self, o):
        (a, da), (b, db) = Dual.parts(self), Dual.parts(o)
        return Dual(a - b, da - db)

    def __rsub__(self, o):
        return Dual.__sub__(Dual(*Dual.parts(o)), self)

    def __mul__(self, o):
        (a, da), (b, db) = Dual.parts(self), Dual.parts(o)
        return Dual(a * b, da * b + a * db)

    __rmul__ = __mul__

    def __truediv__(self, o):
        (a, da), (b, db) = Dual.parts(self), Dual.parts(o)
        return Dual(a / b, (da * b - a * db) / (b * b))

    def __rtruediv__(self, o):
        return Dual.__truediv__(Dual(*Dual.parts(o)), self)

    def __neg__(self):
        return Dual(-self.value, -self.deriv)

    def __pow__(self, n):
        if not isinstance(n, int) or n < 1:
            raise TypeError("a score can be raised to a positive int power only (write x * x, or exp/log)")
        out = self
        for _ in range(n - 1):
            out = out * self
        return out

    def _cmp(self, o, op):
        return op(self.value, Dual.parts(o)[0])

    def __lt__(self, o): return self._cmp(o, lambda a, b: a < b)
    def __le__(self, o): return self._cmp(o, lambda a, b: a <= b)
    def __gt__(self, o): return self._cmp(o, lambda a, b: a > b)
    def __ge__(self, o): return self._cmp(o, lambda a, b: a >= b)
    def __eq__(self, o): return self._cmp(o, lambda a, b: a == b)
    def __ne__(self, o): return self._cmp(o, lambda a, b: a != b)
    __hash__ = None

    def __bool__(self):
        return bool(self.value)


# --- The course helpers: one name, three kinds of value --------------------------------------------------------

def _kind(*xs):
    if any(isinstance(x, Dual) for x in xs):
        return "dual"
    if any(isinstance(x, Sym) for x in xs):
        return "sym"
    if any(isinstance(x, torch.Tensor) for x in xs):
        return "torch"
    return "number"


def where(cond, a, b):
    """``a`` where ``cond`` holds, else ``b`` (torch.where, T.if_then_else, or both parts of a Dual)."""
    kind = _kind(cond, a, b)
    if kind == "dual":
        (va, da), (vb, db) = Dual.parts(a), Dual.parts(b)
        return Dual(where(cond, va, vb), where(cond, da, db))
    if kind == "sym":
        c = _need_bool(cond, "where")
        ea, eb = _promote(a, b)
        return Sym(_tir.if_then_else(c, ea, eb))
    if kind == "torch":
        return torch.where(torch.as_tensor(cond), torch.as_tensor(a), torch.as_tensor(b))
    return a if cond else b


def _unary(name, torch_fn, tl_fn, math_fn, derivative):
    def helper(x):
        kind = _kind(x)
        if kind == "dual":
            v, d = Dual.parts(x)
            return Dual(helper(v), d * derivative(v, helper))
        if kind == "sym":
            e = _as_expr(x)
            return Sym(tl_fn(e if e.dtype == "float32" else _tir.Cast("float32", e)))
        if kind == "torch":
            return torch_fn(x if x.is_floating_point() else x.double())
        return math_fn(x)

    helper.__name__ = helper.__qualname__ = name
    helper.__doc__ = f"{name}(x) on a tensor, a kernel value or a Dual (with its derivative)."
    return helper


tanh = _unary("tanh", torch.tanh, T.tanh, math.tanh, lambda v, f: 1 - f(v) * f(v))
exp = _unary("exp", torch.exp, T.exp, math.exp, lambda v, f: f(v))
log = _unary("log", torch.log, T.log, math.log, lambda v, f: 1 / v)
sqrt = _unary("sqrt", torch.sqrt, T.sqrt, math.sqrt, lambda v, f: 0.5 / f(v))


def abs(x):  # noqa: A001 - the helper mirrors torch.abs
    """|x| on a tensor, a kernel value or a Dual (derivative sign(x), 0 at 0)."""
    return where(x < 0, -x, x)


def sigmoid(x):
    """1 / (1 + exp(−x))."""
    return 1.0 / (1.0 + exp(-x))


def clamp(x, min=None, max=None):  # noqa: A002 - torch.clamp's names
    """x limited to [min, max] (either may be None)."""
    if min is not None:
        x = maximum(x, min)
    if max is not None:
        x = minimum(x, max)
    return x


def minimum(a, b):
    """The smaller of a and b, elementwise (ties take a)."""
    return where(b < a, b, a)


def maximum(a, b):
    """The larger of a and b, elementwise (ties take a)."""
    return where(b > a, b, a)


def _torch_where(condition, input, other):  # noqa: A002 - torch.where's names
    return where(condition, input, other)


_TORCH_HELPERS = {"tanh": tanh, "exp": exp, "log": log, "sqrt": sqrt, "abs": abs, "where": _torch_where,
                  "minimum": minimum, "maximum": maximum, "sigmoid": sigmoid, "clamp": clamp}


def _method(helper):
    def method(self, *args, **kwargs):
        return helper(self, *args, **kwargs)

    method.__name__ = helper.__name__
    method.__doc__ = f"``Tensor.{helper.__name__}``: the course helper on a kernel value or a Dual."
    return method


for _helper_name in ("tanh", "exp", "log", "sqrt", "abs", "minimum", "maximum", "sigmoid", "clamp"):
    setattr(Sym, _helper_name, _method(_TORCH_HELPERS[_helper_name]))  # score.tanh(), as on a tensor
    setattr(Dual, _helper_name, _method(_TORCH_HELPERS[_helper_name]))
del _helper_name


# --- Captured tensors ------------------------------------------------------------------------------------------

class _ThreadState(threading.local):
    """Per thread (kernels are compiled in parallel threads): the kernel being built, a stack of _Loader, and
    whether the float64 reference is running."""

    def __init__(self):
        self.build = []
        self.float64 = []


_STATE = _ThreadState()


@contextlib.contextmanager
def float64_reads(on=True):
    """Inside, a float ``Captured`` indexed with torch indices reads float64 values (when ``on``): the float64
    reference (``checking.flex_reference``) evaluates a score_mod in it."""
    _STATE.float64.append(on)
    try:
        yield
    finally:
        _STATE.float64.pop()


class Captured:
    """A tensor a modifier reads, declared so that it becomes a kernel input: ``doc = captured(document_ids)``.

    Index it as the tensor (``doc[q_idx]``, ``slopes[h]``, ``doc[b, q_idx]``). On torch indices it
    *is* the tensor (floats in float64 inside ``flex_reference``), so the same modifier also runs in
    PyTorch's own ``flex_attention``; in a kernel it reads a packed input. A negative index counts
    from the end (as in torch); an index the host can bound outside the tensor is an error, and
    rows and keys past the end of a ragged tile read a clamped index, never out of bounds. Assign
    ``handle.tensor`` to change the values without recompiling. A plain tensor that a modifier
    indexes with b, h, q_idx or kv_idx (``slopes[h]``) is captured the same way, without the handle.
    """

    def __init__(self, tensor, name=None):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"captured() takes a torch.Tensor; got {type(tensor).__name__}")
        if tensor.is_complex():
            raise TypeError(f"captured tensors must be integer, boolean or floating point; got {tensor.dtype}")
        self.tensor = tensor
        self.name = name or "captured"

    @property
    def kind(self):
        t = self.tensor
        return "float" if t.is_floating_point() else "bool" if t.dtype == torch.bool else "int"

    @property
    def buffer_kind(self):
        return "float" if self.kind == "float" else "int"

    def __repr__(self):
        return f"captured({self.name}, shape={tuple(self.tensor.shape)}, {self.tensor.dtype})"

    @property
    def layout_key(self):
        return (tuple(self.tensor.shape), self.kind)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, (Sym, Dual)) for i in index):
            return _index_tensor(self, index)
        float64 = self.kind == "float" and _STATE.float64 and _STATE.float64[-1]
        t = self.tensor.double() if float64 else self.tensor
        index = tuple(i.to(t.device) if isinstance(i, torch.Tensor) else i for i in index)
        return t[index]


def captured(tensor, name=None):
    """Declare a tensor that a modifier reads (see ``Captured``)."""
    return Captured(tensor, name)


def _index_tensor(source, index):
    """``source[index]`` (a tensor or a Captured) inside a modifier being compiled: a load from the packed inputs."""
    if not _STATE.build:
        raise RuntimeError("a tensor was indexed with kernel values outside a kernel build")
    return _STATE.build[-1].load(source, index if isinstance(index, tuple) else (index,))


# What a trace's loads read: stand-ins for the kernels' packed inputs, so that a traced expression holds its loads.
_TRACE_BUFFERS = (tvm.tirx.decl_buffer((2 ** 31 - 1,), "float32", "CapturedF"),
                  tvm.tirx.decl_buffer((2 ** 31 - 1,), "int32", "CapturedI"))
# The modifiers' arguments while tracing: the same variables every time, so equal formulas hash equal.
_TRACE_VARS = {"score": _tir.Var("score", "float32"),
               **{n: _tir.Var(n, "int32") for n in ("b", "h", "q_idx", "kv_idx")}}


def _tensor_name(fn, tensor):
    """The name under which ``fn`` sees ``tensor`` (a closure cell or a global), for messages."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return "tensor"
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):
            if cell.cell_contents is tensor:
                return name
    for name in code.co_names:
        if fn.__globals__.get(name) is tensor:
            return name
    return "tensor"


class ReadOutOfRange(IndexError, ValueError):
    """A modifier reads a tensor past its end (an IndexError, as torch's, and a ValueError)."""


class _Loader:
    """Turns reads of captured tensors into loads from the kernel's packed inputs.

    Tracing (no ``plan``): each tensor gets a slot (its offset in the float32 or int32 input) on first
    use, and the order of the reads of each modifier is recorded. Building (a ``plan``): the n-th read
    of the modifier takes the n-th recorded slot, so a tensor made inside the modifier works too.
    """

    def __init__(self, plan=None, buffers=None, which=None, fn=None):
        self.plan, self.buffers, self.which, self.fn = plan, buffers or _TRACE_BUFFERS, which, fn
        self.count = 0
        self.handles, self.sources, self.slots, self.offsets = [], [], {}, []
        self.sizes = {"float": 0, "int": 0}
        self.sequences, self.reads = {}, []

    def begin(self, which, fn):
        """Start recording the reads of one evaluation of ``fn`` (tracing)."""
        self.which, self.fn = which, fn
        self.sequences[which] = []

    def _slot(self, source, tensor):
        if self.plan is not None:
            sequence = self.plan.sequences[self.which]
            if self.count >= len(sequence):
                raise RuntimeError(f"{name_of(self.fn)} read more tensors than when it was traced")
            slot = sequence[self.count]
            self.count += 1
            handle = self.plan.handles[slot]
            if (tuple(tensor.shape), Captured(tensor).kind) != handle.layout_key:
                raise RuntimeError(f"{name_of(self.fn)} read a different tensor than when it was traced ({handle!r})")
            return slot, handle, self.plan.offsets[slot]
        if id(source) not in self.slots:
            handle = source if isinstance(source, Captured) else Captured(source, _tensor_name(self.fn, source))
            self.slots[id(source)] = len(self.handles)
            self.handles.append(handle)
            self.sources.append(source)  # alive while traced: no other tensor takes its id
            self.offsets.append(self.sizes[handle.buffer_kind])
            self.sizes[handle.buffer_kind] += tensor.numel()
        slot = self.slots[id(source)]
        self.sequences[self.which].append(slot)
        return slot, self.handles[slot], self.offsets[slot]

    def load(self, source, index):
        tensor = source.tensor if isinstance(source, Captured) else source
        label = source.name if isinstance(source, Captured) else _tensor_name(self.fn, source)
        what = f"{self.which or 'modifier'} `{name_of(self.fn)}`" if self.fn is not None else "a modifier"
        if len(index) != tensor.dim():
            raise TypeError(f"{what} indexes `{label}` (shape {tuple(tensor.shape)}) with {len(index)} indices: a "
                            f"modifier reads one element, so give one index per dimension ({tensor.dim()})")
        exprs = []
        for i in index:
            if isinstance(i, Dual):
                raise TypeError(f"{what} indexes `{label}` by the score: a tensor is indexed by b, h, q_idx or kv_idx")
            if not isinstance(i, (Sym, int)) or isinstance(i, bool):
                raise TypeError(f"{what} indexes `{label}` with a {type(i).__name__}: a modifier reads one element, "
                                f"indexed by ints and b, h, q_idx, kv_idx (slices, masks and None cannot be compiled)")
            e = _promote(i, 0)[0]
            if "float" in e.dtype or _as_expr(i).dtype == "bool":
                raise TypeError(f"{what} indexes `{label}` with a {_as_expr(i).dtype} value; indices are integers")
            exprs.append(e)
        slot, handle, offset = self._slot(source, tensor)
        flat = _const(offset, "int32")
        stride = 1
        for size, e in reversed(list(zip(tensor.shape, exprs))):
            e = _tir.if_then_else(e < 0, e + size, e)  # torch's negative indices count from the end
            flat = flat + _tir.max(0, _tir.min(e, size - 1)) * stride  # rows and keys past the end of a tile
            stride *= size
        if self.plan is None:
            self.reads.append((self.which, self.fn, handle, tuple(exprs)))
        value = self.buffers[0 if handle.buffer_kind == "float" else 1][flat]
        return Sym(_tir.NE(value, _const(0, "int32")) if handle.kind == "bool" else value)


@contextlib.contextmanager
def _building(loader):
    _STATE.build.append(loader)
    try:
        yield loader
    finally:
        _STATE.build.pop()


# --- Checking and tracing the modifiers ------------------------------------------------------------------------

def name_of(fn):
    """A modifier's name, for messages."""
    return getattr(fn, "__name__", type(fn).__name__)


def _check_arity(fn, what, n, names):
    if not callable(fn):
        raise TypeError(f"{what} must be a function {what}({', '.join(names)}); got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
        sig.bind(*range(n))
    except ValueError:
        return  # a builtin without a signature: let the trace tell
    except TypeError:
        raise TypeError(f"{what} `{name_of(fn)}` must take {n} arguments ({', '.join(names)}); its signature is "
                        f"{name_of(fn)}{sig}") from None



def _about_kernel_values(exc):
    """Whether an exception raised inside a modifier came from a kernel value (not from the modifier's own raise)."""
    if isinstance(exc, getattr(getattr(tvm, "error", None), "TVMError", ())):
        return True
    text = str(exc)
    return any(word in text for word in ("Sym", "Dual", "kernel value", "PrimExpr", "int32 index arithmetic",
                                         "cannot be compiled"))


def _call(fn, what, args):
    """Call a modifier on kernel values; a failure of an operation on them becomes an error that names it (the
    modifier's own exceptions pass through unchanged)."""
    try:
        return fn(*args)
    except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
        if not _about_kernel_values(exc):
            raise
        raise TypeError(f"{what} `{name_of(fn)}` uses an operation the kernel cannot express ({type(exc).__name__}: "
                        f"{exc}). Write it with +, -, *, /, //, %, comparisons, &, |, ~, indexing of tensors by "
                        f"b, h, q_idx, kv_idx, and torch.where, torch.tanh, torch.exp, … (or the helpers "
                        f"{', '.join(HELPERS)} of course_utils.api.flex)") from exc


def _score_result(fn, out, dual=False):
    value = out.value if dual and isinstance(out, Dual) else out
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = Sym(_const(float(value), "float32"))
    if not isinstance(value, Sym):
        raise TypeError(f"score_mod `{name_of(fn)}` must return a score (a number computed from its arguments); "
                        f"got {type(value).__name__}")
    if value.dtype == "bool":
        raise TypeError(f"score_mod `{name_of(fn)}` returned a boolean: a condition belongs in a mask_mod")
    return value


def _mask_result(fn, out):
    if not isinstance(out, Sym) or out.dtype != "bool":
        got = out.dtype if isinstance(out, Sym) else type(out).__name__
        raise TypeError(f"mask_mod `{name_of(fn)}` must return a boolean (a comparison, or conditions joined with "
                        f"&, |, ~); got {got}")
    return out.expr


def _reads_var(expr, var):
    found = []
    tvm.tirx.stmt_functor.post_order_visit(expr, lambda node: found.append(True) if node.same_as(var) else None)
    return bool(found)


class ModifierPlan:
    """The modifiers of one kernel, traced, with the layout of the tensors they read.

    Built by ``plan_modifiers``; a kernel factory calls ``score``, ``score_and_derivative`` and
    ``mask`` on its index expressions while it builds its ``@T.prim_func``. ``key`` is what a
    compiled kernel depends on: the traced formulas (with every Python value the modifiers read
    baked in) and the shapes of the tensors they read, whose values are kernel inputs. Two plans
    are equal (and hash alike) when their keys are, so in the compile cache's key (``api.compiled``)
    an equal formula of another function object finds the kernel already compiled.
    """

    def __init__(self, score_mod, mask_mod, loader, traced):
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.handles, self.offsets, self.sequences = loader.handles, loader.offsets, loader.sequences
        self.reads, self.traced = loader.reads, traced
        self._checked = set()  # (B, H, Q_LEN, KV_LEN) whose reads check_reads found in range
        self.sizes = (max(1, loader.sizes["float"]), max(1, loader.sizes["int"]))
        mask = traced.get("mask")
        self.mask_reads_b = mask is not None and _reads_var(mask, _TRACE_VARS["b"])
        self.mask_reads_h = mask is not None and _reads_var(mask, _TRACE_VARS["h"])
        formulas = tuple((name, tvm.ir.structural_hash(e)) for name, e in sorted(traced.items()))
        self.key = (formulas, tuple((k, tuple(v)) for k, v in sorted(self.sequences.items())),
                    tuple(h.layout_key for h in self.handles))

    def __eq__(self, other):
        return isinstance(other, ModifierPlan) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def current(self):
        """Whether the tensors read still have the shapes and kinds this plan was traced with."""
        return self.key[2] == tuple(h.layout_key for h in self.handles)

    def _indices(self, b, h, q_idx, kv_idx):
        return tuple(Sym(_promote(x, 0)[0]) for x in (b, h, q_idx, kv_idx))

    def score(self, buffers, score, b, h, q_idx, kv_idx):
        """The expression of score_mod(score, b, h, q_idx, kv_idx) (``score`` when there is none)."""
        if self.score_mod is None:
            return score
        with _building(_Loader(self, buffers, "score_mod", self.score_mod)):
            out = _call(self.score_mod, "score_mod", (Sym(score),) + self._indices(b, h, q_idx, kv_idx))
        return _score_result(self.score_mod, out).expr

    def score_and_derivative(self, buffers, score, b, h, q_idx, kv_idx):
        """(score_mod(s), ∂score_mod/∂s) as expressions, from one evaluation on a Dual."""
        with _building(_Loader(self, buffers, "score_mod'", self.score_mod)):
            out = _call(self.score_mod, "score_mod",
                        (Dual(Sym(score), Sym(_const(1.0, "float32"))),) + self._indices(b, h, q_idx, kv_idx))
        value = _score_result(self.score_mod, out, dual=True)
        deriv = out.deriv if isinstance(out, Dual) else 0.0
        return value.expr, _promote(deriv, 0.0)[0]

    def mask(self, buffers, b, h, q_idx, kv_idx):
        """The boolean expression of mask_mod(b, h, q_idx, kv_idx) (true when there is none)."""
        if self.mask_mod is None:
            return _const(True, "bool")
        with _building(_Loader(self, buffers, "mask_mod", self.mask_mod)):
            return _mask_result(self.mask_mod, _call(self.mask_mod, "mask_mod", self._indices(b, h, q_idx, kv_idx)))

    def check_reads(self, batch, heads, seq_q, seq_k):
        """Raise ``ReadOutOfRange`` (an IndexError) where a read's index, bounded on the host over b < batch,
        h < heads, q_idx < seq_q, kv_idx < seq_k, leaves the tensor (negative indices count from the end, as in
        torch), and ``ValueError`` where integer arithmetic leaves int32. Indices that depend on the score or on
        other reads are not checked (the kernel clamps them)."""
        if (batch, heads, seq_q, seq_k) in self._checked:
            return
        analyzer = tvm.arith.Analyzer()
        for name, n in (("b", batch), ("h", heads), ("q_idx", seq_q), ("kv_idx", seq_k)):
            analyzer.bind(_TRACE_VARS[name], tvm.ir.Range(0, n))
        for which, fn, handle, exprs in self.reads:
            for dim, (size, e) in enumerate(zip(handle.tensor.shape, exprs)):
                bound = analyzer.const_int_bound(e)
                if bound.min_value <= -2 ** 31 or bound.max_value >= 2 ** 31 - 1:
                    continue  # not bounded on the host
                if bound.min_value < -size or bound.max_value >= size:
                    raise ReadOutOfRange(
                        f"{which.rstrip(chr(39))} `{name_of(fn)}` reads `{handle.name}` (shape "
                        f"{tuple(handle.tensor.shape)}) at index {bound.min_value}..{bound.max_value} in dimension "
                        f"{dim} (for B={batch}, H={heads}, Q_LEN={seq_q}, KV_LEN={seq_k}), past its size {size}: "
                        f"give it {bound.max_value + 1} entries, or keep the index in range (torch.clamp, %)")
        self._check_overflow(analyzer, batch, heads, seq_q, seq_k)
        self._checked.add((batch, heads, seq_q, seq_k))

    def _check_overflow(self, analyzer, batch, heads, seq_q, seq_k):
        """Raise ``ValueError`` where integer arithmetic on b, h, q_idx, kv_idx alone leaves int32 (the kernel's
        index type; torch computes it in int64 and would not overflow)."""
        indices = [_TRACE_VARS[n] for n in ("b", "h", "q_idx", "kv_idx")]

        def index_only(expr):
            other = []

            def visit(node):
                if isinstance(node, _tir.BufferLoad) or (isinstance(node, _tir.Var)
                                                         and not any(node.same_as(v) for v in indices)):
                    other.append(node)

            tvm.tirx.stmt_functor.post_order_visit(expr, visit)
            return not other

        def visit(node):
            if isinstance(node, (_tir.Add, _tir.Sub, _tir.Mul)) and str(node.dtype) == "int32" and not found:
                bound = analyzer.const_int_bound(node)
                if (bound.min_value < -2 ** 31 or bound.max_value >= 2 ** 31) and index_only(node):
                    found.append((node, bound))

        for name, expr in self.traced.items():
            found = []
            tvm.tirx.stmt_functor.post_order_visit(expr, visit)
            if found:
                node, bound = found[0]
                fn = self.mask_mod if name == "mask" else self.score_mod
                raise ValueError(
                    f"{'mask_mod' if name == 'mask' else 'score_mod'} `{name_of(fn)}` computes {node}, which reaches "
                    f"{bound.min_value}..{bound.max_value} for B={batch}, H={heads}, Q_LEN={seq_q}, KV_LEN={seq_k}: "
                    "past int32, the kernel's integer type (torch's int64 would not overflow). Keep the integers "
                    "smaller, or compute in floats (multiply by 1.0 first)")

    def check_no_grad(self):
        """Refuse, where autograd is on, a tensor the modifiers read that requires grad: it would get none."""
        if not torch.is_grad_enabled():
            return
        for handle in self.handles:
            if handle.tensor.requires_grad:
                raise ValueError(f"`{handle.name}` {tuple(handle.tensor.shape)}, read by a modifier, requires grad: "
                                 "flex_attention computes gradients for q, k and v only. Pass it detached "
                                 f"(`{handle.name}.detach()`), or run under torch.no_grad()")

    def pack(self, device):
        """The kernels' two captured inputs (float32, int32): every captured tensor, flattened, at its offset, with
        its current values."""
        floats = torch.zeros(self.sizes[0], dtype=torch.float32, device=device)
        ints = torch.zeros(self.sizes[1], dtype=torch.int32, device=device)
        for handle, offset in zip(self.handles, self.offsets):
            tensor = handle.tensor
            try:
                flat = tensor.detach().reshape(-1).to(device)
            except (RuntimeError, NotImplementedError) as exc:
                raise ValueError(f"`{handle.name}`, read by a modifier, is on {tensor.device} and cannot be read by "
                                 f"kernels on {device} ({exc}); move it there with .to({str(device)!r})") from None
            if handle.buffer_kind == "int":
                if flat.numel() and int(flat.long().abs().max()) >= 2 ** 31:
                    raise ValueError(f"{handle!r}: values must fit in int32")
                ints[offset:offset + flat.numel()] = flat.to(torch.int32)
            else:
                floats[offset:offset + flat.numel()] = flat.float()
        return floats, ints


_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_FIXED_MODULES = {__name__}  # modules whose functions a fingerprint counts by identity (``fixed_module``)


def fixed_module(name):
    """Count the functions of module ``name`` by identity in fingerprints (the course's own modifiers, whose code
    and closures are fixed), instead of following what they read."""
    _FIXED_MODULES.add(name)


def _value_key(value, seen, depth):
    """A hashable summary of a value a modifier reads, or None where it cannot be summarised (a dict, a list, an
    object): its traced formula may depend on every part of it. Tensors count by identity and layout, since their
    values are kernel inputs, read afresh on every call."""
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, tuple):
        keys = tuple(_value_key(v, seen, depth) for v in value)
        return None if any(k is None for k in keys) else keys
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), tuple(value.shape), value.dtype, value._version)
    if isinstance(value, Captured):
        return ("captured", id(value), _value_key(value.tensor, seen, depth))
    if isinstance(value, (types.ModuleType, types.BuiltinFunctionType, type)):
        return ("object", id(value))
    if isinstance(value, types.FunctionType):  # the helpers and the chapter's modifiers are fixed; the user's are
        # followed
        return ("object", id(value)) if value.__module__ in _FIXED_MODULES else _fingerprint(value, seen, depth + 1)
    return None


@functools.lru_cache(maxsize=1024)
def _global_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= set(_global_names(const))
    return tuple(sorted(names))


def _fingerprint(fn, seen=None, depth=0):
    """What a modifier reads: its code and the values of its defaults, closure cells and the globals it names
    (through the functions it calls), or None where one of them cannot be summarised."""
    if fn is None:
        return ()
    if not isinstance(fn, types.FunctionType) or depth > 8:
        return None
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return ("again", id(fn))
    seen.add(id(fn))
    parts = [fn.__code__, _value_key(fn.__defaults__ or (), seen, depth)]
    if fn.__kwdefaults__:
        parts.append(_value_key(tuple(sorted(fn.__kwdefaults__.items())), seen, depth))
    for cell in fn.__closure__ or ():
        try:
            parts.append(_value_key(cell.cell_contents, seen, depth))
        except ValueError:  # an empty cell
            parts.append(("empty",))
    for name in _global_names(fn.__code__):
        if name in fn.__globals__:
            key = _value_key(fn.__globals__[name], seen, depth)
            parts.append(None if key is None else (name, key))
    return None if any(p is None for p in parts) else tuple(parts)


_PLANS = {}
_PLANS_LOCK = threading.Lock()


def cached_plan(score_mod=None, mask_mod=None):
    """``plan_modifiers``, reused while nothing the modifiers read has changed (``_fingerprint``: their code and
    the values of the globals and closure cells they use); traced again otherwise, or when one of those values
    cannot be summarised."""
    fingerprints = (_fingerprint(score_mod), _fingerprint(mask_mod))
    if None in fingerprints:
        return plan_modifiers(score_mod, mask_mod)
    key = (score_mod, mask_mod, fingerprints)
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
    if plan is None or not plan.current():
        plan = plan_modifiers(score_mod, mask_mod)
        with _PLANS_LOCK:
            if len(_PLANS) >= 128:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan
    return plan


def _forget_plans():
    """Drop the traced plans (``cached_plan.cache_clear``; the kernels are ``api.compiled``'s)."""
    with _PLANS_LOCK:
        _PLANS.clear()


cached_plan.cache_clear = _forget_plans


def plan_modifiers(score_mod=None, mask_mod=None):
    """Check both modifiers (arity, return type, only operations a kernel can express) and trace them.

    Raises ``TypeError`` naming the modifier. Returns a ``ModifierPlan``.
    """
    if score_mod is not None:
        _check_arity(score_mod, "score_mod", 5, ("score", "b", "h", "q_idx", "kv_idx"))
    if mask_mod is not None:
        _check_arity(mask_mod, "mask_mod", 4, ("b", "h", "q_idx", "kv_idx"))
    loader = _Loader()
    idx = [Sym(_TRACE_VARS[n]) for n in ("b", "h", "q_idx", "kv_idx")]
    score = Sym(_TRACE_VARS["score"])
    traced = {}
    with _building(loader):
        if score_mod is not None:
            loader.begin("score_mod", score_mod)
            traced["score"] = _score_result(score_mod, _call(score_mod, "score_mod", [score] + idx)).expr
            loader.begin("score_mod'", score_mod)
            out = _call(score_mod, "score_mod", [Dual(score, Sym(_const(1.0, "float32")))] + idx)
            traced["score'"] = _score_result(score_mod, out, dual=True).expr
            traced["derivative"] = _promote(out.deriv if isinstance(out, Dual) else 0.0, 0.0)[0]
        if mask_mod is not None:
            loader.begin("mask_mod", mask_mod)
            traced["mask"] = _mask_result(mask_mod, _call(mask_mod, "mask_mod", idx))
    return ModifierPlan(score_mod, mask_mod, loader, traced)


