"""FlexAttention in TileLang: score and mask modifiers, written once, compiled into the kernels.

    out = flex_attention(q, k, v, score_mod=soft_cap, block_mask=create_block_mask(causal, ...))

A ``score_mod(score, b, h, q_idx, kv_idx) -> score`` changes a scaled score; a
``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` may see key ``kv_idx``
(PyTorch's FlexAttention conventions). Both are plain Python functions written with ordinary
operators and the helpers below (``where``, ``tanh``, ``exp``, …). The same function runs

* on torch tensors, in the float64 reference (``flex_reference``) and in ``create_block_mask``;
* on ``Sym`` values, while a kernel factory builds its ``@T.prim_func``: each operator returns a
  TileLang expression, so the modifier's formula is inlined into the generated C or CUDA;
* on ``Dual`` numbers (value, derivative) in the backward kernel: the chain rule through
  ``score_mod`` comes from evaluating it once on ``Dual(score, 1)``.

Tensors a modifier reads (ALiBi slopes, document ids) are declared with ``captured(tensor)``; the
handle is indexed like the tensor (``doc[b, q_idx]``). The kernels receive every captured tensor
packed into one float32 and one int32 input, so one kernel serves new values of the same shapes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
from typing import NamedTuple

import tilelang.language as T
import torch
from tilelang import tvm

from ..core.reference import head_chunks, rounded_out_delta_grads
from ..kernels.flash_flex import EMPTY, FULL, PARTIAL, FlexFunction
from .inputs import check_attention_inputs

__all__ = ["flex_attention", "create_block_mask", "BlockMask", "captured", "Captured", "where", "tanh", "exp", "log",
           "sqrt", "abs", "minimum", "maximum", "Sym", "Dual", "ModifierPlan", "plan_modifiers", "flex_reference",
           "flex_references", "noop_mask", "visible_pairs", "EMPTY", "PARTIAL", "FULL", "HELPERS", "default_block",
           "causal_mask", "soft_cap", "alibi_slopes", "alibi", "document_ids", "document_mask", "prefix_lm",
           "window_with_globals"]

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


class Sym:
    """A value inside a kernel being built: wraps a TileLang expression and gives it Python's operators.

    Why not the bare expressions? TVM's ``~`` on a boolean is a *bitwise* not, which C evaluates
    to −2 (true) for true: ``~(q_idx >= kv_idx)`` would hide nothing. Here ``~``, ``&`` and ``|`` on
    booleans are logical, ``/`` is a float division (as in torch), and using a kernel value where
    Python needs a plain bool (``if``, ``and``, ``or``) raises instead of tracing one branch.
    """

    __slots__ = ("expr",)

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

    def __floordiv__(self, o): return self._bin(o, _tir.floordiv)
    def __rfloordiv__(self, o): return self._bin(o, _tir.floordiv, True)
    def __mod__(self, o): return self._bin(o, _tir.floormod)
    def __rmod__(self, o): return self._bin(o, _tir.floormod, True)
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


def minimum(a, b):
    """The smaller of a and b, elementwise (ties take a)."""
    return where(b < a, b, a)


def maximum(a, b):
    """The larger of a and b, elementwise (ties take a)."""
    return where(b > a, b, a)


# --- Captured tensors ------------------------------------------------------------------------------------------

class _ThreadState(threading.local):
    """Per thread (kernels are compiled in parallel threads): the kernel being built, a stack of _Loader, and
    whether the float64 reference is running."""

    def __init__(self):
        self.build = []
        self.float64 = []


_STATE = _ThreadState()


class Captured:
    """A tensor a modifier reads, declared so that it becomes a kernel input: ``doc = captured(document_ids)``.

    Index it as the tensor (``doc[q_idx]``, ``slopes[h]``, ``doc[b, q_idx]``). On torch indices it
    *is* the tensor (floats in float64 inside ``flex_reference``), so the same modifier also runs in
    PyTorch's own ``flex_attention``; in a kernel it reads a packed input, with each index
    clamped to its dimension so that rows and keys past the end never read out of bounds. Assign
    ``handle.tensor`` to change the values without recompiling.
    """

    def __init__(self, tensor, name=None):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"captured() takes a torch.Tensor; got {type(tensor).__name__}")
        if tensor.dtype == torch.bool or tensor.is_complex():
            raise TypeError(f"captured tensors must be integer or floating point; got {tensor.dtype}")
        self.tensor = tensor
        self.name = name or "captured"
        self.kind = "float" if tensor.is_floating_point() else "int"

    def __repr__(self):
        return f"captured({self.name}, shape={tuple(self.tensor.shape)}, {self.tensor.dtype})"

    @property
    def layout_key(self):
        return (tuple(self.tensor.shape), self.kind)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, (Sym, Dual)) for i in index):
            if not _STATE.build:
                raise RuntimeError(f"{self!r} was indexed with kernel values outside a kernel build")
            if len(index) != self.tensor.dim():
                raise TypeError(f"{self!r} has {self.tensor.dim()} dimensions; indexed with {len(index)} indices")
            return _STATE.build[-1].load(self, index)
        float64 = self.kind == "float" and _STATE.float64 and _STATE.float64[-1]
        t = self.tensor.double() if float64 else self.tensor
        index = tuple(i.to(t.device) if isinstance(i, torch.Tensor) else i for i in index)
        return t[index]


def captured(tensor, name=None):
    """Declare a tensor that a modifier reads (see ``Captured``)."""
    return Captured(tensor, name)


class _Loader:
    """Turns reads of captured tensors into loads from the kernel's packed inputs (or records them, when tracing)."""

    def __init__(self, layout=None, buffers=None):
        self.layout = dict(layout or {})  # id(handle) -> (kind, offset)
        self.handles = []  # in order of first use
        self.buffers = buffers  # (float32 buffer, int32 buffer) or None while tracing
        self.sizes = {"float": 0, "int": 0}

    def load(self, handle, index):
        if id(handle) not in self.layout:
            if self.buffers is not None:
                raise RuntimeError(f"{handle!r} was not seen when the modifiers were traced")
            self.layout[id(handle)] = (handle.kind, self.sizes[handle.kind])
            self.sizes[handle.kind] += handle.tensor.numel()
            self.handles.append(handle)
        kind, offset = self.layout[id(handle)]
        flat = _const(offset, "int32")
        stride = 1
        for size, i in reversed(list(zip(handle.tensor.shape, index))):
            if isinstance(i, Dual):
                raise TypeError("a captured tensor is indexed by b, h, q_idx or kv_idx, not by the score")
            e = _promote(i, 0)[0]
            if "float" in e.dtype:
                raise TypeError(f"{handle!r} indexed by a float")
            flat = flat + _tir.max(0, _tir.min(e, size - 1)) * stride
            stride *= size
        if self.buffers is None:
            return Sym(_tir.Var(f"{handle.name}_value", "float32" if kind == "float" else "int32"))
        buffer = self.buffers[0 if kind == "float" else 1]
        return Sym(buffer[flat])


@contextlib.contextmanager
def _building(loader):
    _STATE.build.append(loader)
    try:
        yield loader
    finally:
        _STATE.build.pop()


# --- Checking and tracing the modifiers ------------------------------------------------------------------------

def _name(fn):
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
        raise TypeError(f"{what} `{_name(fn)}` must take {n} arguments ({', '.join(names)}); its signature is "
                        f"{_name(fn)}{sig}") from None


def noop_mask(b, h, q_idx, kv_idx):
    """Every query sees every key."""
    return q_idx >= 0


def _call(fn, what, args):
    """Call a modifier on kernel values; any failure becomes an error that names it."""
    try:
        return fn(*args)
    except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise TypeError(f"{what} `{_name(fn)}` uses an operation the kernel cannot express ({type(exc).__name__}: "
                        f"{exc}). Write it with +, -, *, /, //, %, comparisons, &, |, ~, indexing of "
                        f"captured() tensors and the helpers {', '.join(HELPERS)} of course_utils.api.flex") from None


def _score_result(fn, out, dual=False):
    value = out.value if dual and isinstance(out, Dual) else out
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = Sym(_const(float(value), "float32"))
    if not isinstance(value, Sym):
        raise TypeError(f"score_mod `{_name(fn)}` must return a score (a number computed from its arguments); "
                        f"got {type(value).__name__}")
    if value.dtype == "bool":
        raise TypeError(f"score_mod `{_name(fn)}` returned a boolean: a condition belongs in a mask_mod")
    return value


def _mask_result(fn, out):
    if not isinstance(out, Sym) or out.dtype != "bool":
        got = out.dtype if isinstance(out, Sym) else type(out).__name__
        raise TypeError(f"mask_mod `{_name(fn)}` must return a boolean (a comparison, or conditions joined with "
                        f"&, |, ~); got {got}")
    return out.expr


class ModifierPlan:
    """The modifiers of one kernel, checked, with the layout of the tensors they capture.

    Built by ``plan_modifiers``; a kernel factory calls ``score``, ``score_and_derivative`` and
    ``mask`` on its index expressions while it builds its ``@T.prim_func``.
    """

    def __init__(self, score_mod, mask_mod, loader):
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.layout = loader.layout
        self.handles = loader.handles
        self.sizes = (max(1, loader.sizes["float"]), max(1, loader.sizes["int"]))
        self.key = (score_mod, mask_mod, tuple(h.layout_key for h in self.handles))  # what a kernel depends on
        self._packed = (None, None)

    def current(self):
        """Whether the captured tensors still have the shapes this plan was traced with."""
        return self.key[2] == tuple(h.layout_key for h in self.handles)

    def _indices(self, b, h, q_idx, kv_idx):
        return tuple(Sym(_promote(x, 0)[0]) for x in (b, h, q_idx, kv_idx))

    def score(self, buffers, score, b, h, q_idx, kv_idx):
        """The expression of score_mod(score, b, h, q_idx, kv_idx) (``score`` when there is none)."""
        if self.score_mod is None:
            return score
        with _building(_Loader(self.layout, buffers)):
            out = _call(self.score_mod, "score_mod", (Sym(score),) + self._indices(b, h, q_idx, kv_idx))
        return _score_result(self.score_mod, out).expr

    def score_and_derivative(self, buffers, score, b, h, q_idx, kv_idx):
        """(score_mod(s), ∂score_mod/∂s) as expressions, from one evaluation on a Dual."""
        with _building(_Loader(self.layout, buffers)):
            out = _call(self.score_mod, "score_mod",
                        (Dual(Sym(score), Sym(_const(1.0, "float32"))),) + self._indices(b, h, q_idx, kv_idx))
        value = _score_result(self.score_mod, out, dual=True)
        deriv = out.deriv if isinstance(out, Dual) else 0.0
        return value.expr, _promote(deriv, 0.0)[0]

    def mask(self, buffers, b, h, q_idx, kv_idx):
        """The boolean expression of mask_mod(b, h, q_idx, kv_idx) (true when there is none)."""
        if self.mask_mod is None:
            return _const(True, "bool")
        with _building(_Loader(self.layout, buffers)):
            return _mask_result(self.mask_mod, _call(self.mask_mod, "mask_mod", self._indices(b, h, q_idx, kv_idx)))

    def pack(self, device):
        """The kernels' two captured inputs (float32, int32): every captured tensor, flattened, at its offset.

        Cached while the captured tensors are the same objects, unmodified (their version counters).
        """
        stamp = (str(device),) + tuple((id(h.tensor), h.tensor._version) for h in self.handles)
        if self._packed[0] == stamp:
            return self._packed[1]
        floats = torch.zeros(self.sizes[0], dtype=torch.float32, device=device)
        ints = torch.zeros(self.sizes[1], dtype=torch.int32, device=device)
        for handle in self.handles:
            kind, offset = self.layout[id(handle)]
            flat = handle.tensor.detach().reshape(-1).to(device)
            if kind == "int":
                if flat.numel() and int(flat.long().abs().max()) >= 2 ** 31:
                    raise ValueError(f"{handle!r}: values must fit in int32")
                ints[offset:offset + flat.numel()] = flat.to(torch.int32)
            else:
                floats[offset:offset + flat.numel()] = flat.float()
        self._packed = (stamp, (floats, ints))
        return floats, ints


@functools.lru_cache(maxsize=128)
def _cached_plan(score_mod, mask_mod):
    return plan_modifiers(score_mod, mask_mod)


def cached_plan(score_mod=None, mask_mod=None):
    """``plan_modifiers``, traced once per pair of functions (again if a captured tensor changed shape)."""
    plan = _cached_plan(score_mod, mask_mod)
    if not plan.current():
        _cached_plan.cache_clear()
        plan = _cached_plan(score_mod, mask_mod)
    return plan


def plan_modifiers(score_mod=None, mask_mod=None):
    """Check both modifiers (arity, return type, only operations a kernel can express) and trace their captures.

    Raises ``TypeError`` naming the modifier. Returns a ``ModifierPlan``.
    """
    if score_mod is not None:
        _check_arity(score_mod, "score_mod", 5, ("score", "b", "h", "q_idx", "kv_idx"))
    if mask_mod is not None:
        _check_arity(mask_mod, "mask_mod", 4, ("b", "h", "q_idx", "kv_idx"))
    loader = _Loader()
    idx = [Sym(_tir.Var(n, "int32")) for n in ("b", "h", "q_idx", "kv_idx")]
    with _building(loader):
        if score_mod is not None:
            _score_result(score_mod, _call(score_mod, "score_mod", [Sym(_tir.Var("score", "float32"))] + idx))
            out = _call(score_mod, "score_mod", [Dual(Sym(_tir.Var("score", "float32")), 1.0)] + idx)
            _score_result(score_mod, out, dual=True)
        if mask_mod is not None:
            _mask_result(mask_mod, _call(mask_mod, "mask_mod", idx))
    return ModifierPlan(score_mod, mask_mod, loader)


# --- The float64 reference -------------------------------------------------------------------------------------

def _index_grids(batch_ids, head_ids, seq_q, seq_k, device):
    b = torch.as_tensor(batch_ids, device=device).view(-1, 1, 1, 1)
    h = torch.as_tensor(head_ids, device=device).view(1, -1, 1, 1)
    q_idx = torch.arange(seq_q, device=device).view(1, 1, -1, 1)
    kv_idx = torch.arange(seq_k, device=device).view(1, 1, 1, -1)
    return b, h, q_idx, kv_idx


def _reference_mask(mask_mod, b, h, q_idx, kv_idx):
    out = mask_mod(b, h, q_idx, kv_idx)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"mask_mod `{_name(mask_mod)}` must return a boolean tensor on tensor inputs; got {got}")
    return out


def flex_reference(q, k, v, *, score_mod=None, mask_mod=None, sm_scale=None, compute_dtype=torch.float64,
                   batch_ids=None, head_ids=None):
    """softmax(mask(score_mod(Q Kᵀ · scale))) V computed naively in ``compute_dtype``; returns (O, LSE).

    O has q's dtype; LSE is float32, natural log. A row that sees no key gets O = 0 and LSE = −∞.
    ``batch_ids`` / ``head_ids``: the b and h the modifiers see when q is a slice of a larger
    problem. With a 16-bit ``compute_dtype`` this is the low-precision reference of
    ``course_utils.core.reference.attention_reference`` (products in 16 bits, softmax in float32).
    """
    group = q.shape[1] // k.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    softmax_dtype = torch.float32 if compute_dtype in (torch.float16, torch.bfloat16) else compute_dtype
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)
    b, h, q_idx, kv_idx = _index_grids(range(q.shape[0]) if batch_ids is None else batch_ids,
                                       range(q.shape[1]) if head_ids is None else head_ids,
                                       q.shape[2], k.shape[2], q.device)
    scores = torch.einsum("bhqd,bhkd->bhqk", qc, kc).to(softmax_dtype) * scale
    if score_mod is not None:
        _STATE.float64.append(compute_dtype == torch.float64)
        try:
            scores = score_mod(scores, b, h, q_idx, kv_idx)
        finally:
            _STATE.float64.pop()
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
            raise TypeError(f"score_mod `{_name(score_mod)}` must return a floating-point tensor on tensor inputs")
        scores = scores.to(softmax_dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if mask_mod is not None:
        visible = _reference_mask(mask_mod, b, h, q_idx, kv_idx)
        scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = torch.einsum("bhqk,bhkd->bhqd", probs.to(compute_dtype), vc).to(q.dtype)
    return out, (row_max + torch.log(denom)).squeeze(-1).to(torch.float32)


def flex_references(q, k, v, *, d_out=None, score_mod=None, mask_mod=None, sm_scale=None, rounded_out_delta=False):
    """``validation.references`` for modifiers: float64 and low-precision O, LSE (and gradients), every head.

    The result plugs into ``check_forward(..., refs=...)`` and ``check_backward(..., refs=...)``.
    Computed one batch entry and one K/V head group at a time, with the b and h the modifiers see.
    ``rounded_out_delta``: also ``grads_delta``, as ``validation.references`` makes it.
    """
    kw = dict(score_mod=score_mod, mask_mod=mask_mod, sm_scale=sm_scale)
    want = d_out is not None
    rounded_out_delta = rounded_out_delta and want and q.dtype in (torch.float16, torch.bfloat16)
    result = {"out": torch.empty_like(q, dtype=torch.float64), "lse": q.new_empty(q.shape[:3], dtype=torch.float32),
              "out_low": torch.empty_like(q)}
    if want:
        for key, dtype in (("grads", torch.float64), ("grads_low", q.dtype)) + (
                (("grads_delta", torch.float64),) if rounded_out_delta else ()):
            result[key] = [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v)]
    for b, hq, hkv in head_chunks(q, k):
        heads = range(q.shape[1])[hq]
        for suffix, dtype in (("", torch.float64), ("_low", q.dtype)):
            leaves = [t[b:b + 1, hh].detach().to(dtype).requires_grad_(want) for t, hh in ((q, hq), (k, hkv), (v, hkv))]
            with torch.enable_grad():
                out, lse = flex_reference(*leaves, compute_dtype=dtype, batch_ids=[b], head_ids=list(heads), **kw)
                result["out" + suffix][b:b + 1, hq] = out.detach()
                if not suffix:
                    result["lse"][b:b + 1, hq] = lse
                if want:
                    d_chunk = d_out[b:b + 1, hq].to(out.dtype)
                    delta_too = rounded_out_delta and not suffix
                    grads = torch.autograd.grad(out, leaves, d_chunk, allow_unused=True, retain_graph=delta_too)
                    for index, (hh, g) in enumerate(zip((hq, hkv, hkv), grads)):
                        if g is not None:
                            result["grads" + suffix][index][b:b + 1, hh] = g
                    if delta_too:
                        grads = rounded_out_delta_grads(out, lse, leaves, d_chunk, q.dtype, allow_unused=True)
                        for index, (hh, g) in enumerate(zip((hq, hkv, hkv), grads)):
                            if g is not None:
                                result["grads_delta"][index][b:b + 1, hh] = g
    return result


# --- Block masks -----------------------------------------------------------------------------------------------

class BlockMask(NamedTuple):
    """Which (query block, key block) tiles a mask leaves empty, full or partial, and the lists the kernels walk.

    ``state`` [B', H', query blocks, key blocks] holds EMPTY, PARTIAL or FULL (B' and H' are 1 when
    the mask does not depend on b or h). A tile that runs past the end of the queries or keys is
    never FULL: only PARTIAL tiles pay for the mask. The forward walks, for each query block,
    ``kv_count`` key blocks listed in ``kv_list``; the backward walks, for each key block,
    ``q_count`` query blocks listed in ``q_list`` (all int32, on the device of the inputs).
    """

    state: torch.Tensor
    kv_count: torch.Tensor
    kv_list: torch.Tensor
    q_count: torch.Tensor
    q_list: torch.Tensor
    block: tuple
    seq_q: int
    seq_k: int
    mask_mod: object

    @property
    def shape(self):
        return (self.state.shape[0], self.state.shape[1], self.seq_q, self.seq_k)

    def fraction_skipped(self):
        """The share of (query block, key block) tiles the kernels skip."""
        return int((self.state == EMPTY).sum()) / self.state.numel()

    def without_skipping(self):
        """The same mask with no tile skipped: EMPTY tiles become PARTIAL (visited and masked). What skipping saves
        is the time difference."""
        state = torch.where(self.state == EMPTY, PARTIAL, self.state).int()
        return _with_lists(state, self.block, self.seq_q, self.seq_k, self.mask_mod)

    def counts(self):
        """{"empty": n, "partial": n, "full": n} tiles."""
        return {name: int((self.state == s).sum()) for name, s in (("empty", EMPTY), ("partial", PARTIAL),
                                                                    ("full", FULL))}

    def __repr__(self):
        c = self.counts()
        return (f"BlockMask(shape={self.shape}, block={self.block}, mask_mod={_name(self.mask_mod)}, "
                f"{c['full']} full, {c['partial']} partial, {c['empty']} empty tiles: "
                f"{self.fraction_skipped():.0%} skipped)")


def default_block(device):
    """The tile of the flex kernels on ``device``: 128 × 128 on a GPU (FlexAttention's default), 16 × 16 on the CPU."""
    return (128, 128) if torch.device(device).type == "cuda" else (16, 16)


def _check_size(value, name, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}; got {value!r}")


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", block=None):
    """Evaluate ``mask_mod`` on every (b, h, q_idx, kv_idx) and summarise it per tile: a ``BlockMask``.

    ``B`` or ``H`` None: the mask does not depend on b (h), evaluated at 0 and shared. ``block``:
    (query rows, keys) per tile, default ``default_block(device)``. The mask is evaluated a band of
    query blocks at a time, so a long sequence never holds its whole Q_LEN × KV_LEN mask.
    """
    plan_modifiers(mask_mod=mask_mod)
    _check_size(B, "B", True)
    _check_size(H, "H", True)
    _check_size(Q_LEN, "Q_LEN")
    _check_size(KV_LEN, "KV_LEN")
    block = default_block(device) if block is None else tuple(block)
    if len(block) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in block):
        raise ValueError(f"block must be (query rows, keys), two positive ints; got {block!r}")
    bm, bn = block
    nq, nk = -(-Q_LEN // bm), -(-KV_LEN // bn)
    bb, hh = B or 1, H or 1
    state = torch.empty(bb, hh, nq, nk, dtype=torch.int32, device=device)
    band = max(1, (1 << 24) // (bb * hh * bm * nk * bn))  # query blocks per evaluation
    for q0 in range(0, nq, band):
        q1 = min(nq, q0 + band)
        b, h, q_idx, kv_idx = _index_grids(range(bb), range(hh), (q1 - q0) * bm, nk * bn, device)
        q_idx = q_idx + q0 * bm
        inside = (q_idx < Q_LEN) & (kv_idx < KV_LEN)
        visible = _reference_mask(mask_mod, b, h, q_idx.clamp(max=Q_LEN - 1), kv_idx.clamp(max=KV_LEN - 1))
        visible = (visible & inside).expand(bb, hh, (q1 - q0) * bm, nk * bn)
        tiles = visible.reshape(bb, hh, q1 - q0, bm, nk, bn)
        inside_tiles = inside.expand_as(visible).reshape(bb, hh, q1 - q0, bm, nk, bn)
        any_visible = tiles.any(dim=5).any(dim=3)
        all_visible = tiles.all(dim=5).all(dim=3) & inside_tiles.all(dim=5).all(dim=3)
        state[:, :, q0:q1] = torch.where(all_visible, FULL, torch.where(any_visible, PARTIAL, EMPTY)).int()
    return _with_lists(state, block, Q_LEN, KV_LEN, mask_mod)


def visible_pairs(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu"):
    """How many (b, h, query, key) pairs ``mask_mod`` leaves visible (B, H: as in ``create_block_mask``).

    The exact work of a masked attention: FLOPs are 4 · D · this many (forward). Evaluated a band
    of queries at a time.
    """
    bb, hh = B or 1, H or 1
    band = max(1, (1 << 24) // (bb * hh * KV_LEN))
    total = 0
    for q0 in range(0, Q_LEN, band):
        b, h, q_idx, kv_idx = _index_grids(range(bb), range(hh), min(band, Q_LEN - q0), KV_LEN, device)
        total += int(_reference_mask(mask_mod, b, h, q_idx + q0, kv_idx).expand(bb, hh, -1, KV_LEN).sum())
    return total


def _with_lists(state, block, seq_q, seq_k, mask_mod):
    """The BlockMask of ``state``: the non-empty blocks of each row (column) first, in increasing order."""
    visited = state != EMPTY
    kv_list = torch.sort((~visited).int(), dim=-1, stable=True).indices.int()
    q_list = torch.sort((~visited).transpose(-1, -2).int(), dim=-1, stable=True).indices.int()
    return BlockMask(state.contiguous(), visited.sum(-1).int().contiguous(), kv_list.contiguous(),
                     visited.sum(-2).int().contiguous(), q_list.contiguous(), block, seq_q, seq_k, mask_mod)


# --- The public function ---------------------------------------------------------------------------------------

def _check_block_mask(block_mask, mask_mod, q, k):
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must come from create_block_mask; got {type(block_mask).__name__}")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError(f"block_mask was made from mask_mod `{_name(block_mask.mask_mod)}`, not `{_name(mask_mod)}`")
    bb, hh = block_mask.state.shape[:2]
    if (block_mask.seq_q, block_mask.seq_k) != (q.shape[2], k.shape[2]):
        raise ValueError(f"block_mask is for Q_LEN={block_mask.seq_q}, KV_LEN={block_mask.seq_k}; q has "
                         f"{q.shape[2]} queries and k {k.shape[2]} keys")
    if bb not in (1, q.shape[0]) or hh not in (1, q.shape[1]):
        raise ValueError(f"block_mask is for B={bb}, H={hh}; q has B={q.shape[0]}, H={q.shape[1]}")
    if block_mask.state.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.state.device}; q is on {q.device}")


def flex_attention(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, sm_scale=None, return_lse=False):
    """Attention with a score modifier and a mask, compiled into the course's TileLang kernels.

    q: [B, H, S_q, D]; k, v: [B, H_kv, S_k, D] (GQA when H_kv < H). ``score_mod(score, b, h,
    q_idx, kv_idx)`` changes each scaled score; ``mask_mod(b, h, q_idx, kv_idx)`` hides pairs.
    ``block_mask`` (``create_block_mask``) says which tiles to skip; given a mask_mod alone, it is
    built here (once per call: build it yourself to reuse it). Returns O (and the natural-log LSE
    [B, H, S_q], float32, with ``return_lse``); rows that see no key get O = 0 and LSE = −∞.
    Differentiable (once) with respect to q, k and v.
    """
    check_attention_inputs("flex_attention", q, k, v, sm_scale=sm_scale)
    if block_mask is not None:
        _check_block_mask(block_mask, mask_mod, q, k)
        mask_mod = block_mask.mask_mod
    plan = cached_plan(score_mod, mask_mod)
    if block_mask is None:
        block_mask = create_block_mask(mask_mod or noop_mask, None, None, q.shape[2], k.shape[2], device=q.device)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    out, lse = FlexFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, block_mask, sm_scale)
    return (out, lse) if return_lse else out


# --- The modifiers of the chapter ------------------------------------------------------------------------------

def causal_mask(b, h, q_idx, kv_idx):
    """Causal attention of a self-attention layer: a query sees its own and earlier keys."""
    return q_idx >= kv_idx


def soft_cap(cap=50.0):
    """Gemma 2's logit soft-capping: score → cap · tanh(score / cap), a score_mod."""
    cap = float(cap)

    def soft_cap_score(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)

    return soft_cap_score


def alibi_slopes(heads):
    """ALiBi's head slopes 2^(−8(h+1)/H) (Press et al., 2022), float32 [heads]."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32)


def alibi(slopes):
    """ALiBi: score + slope[h] · (kv_idx − q_idx), a score_mod reading a captured tensor of slopes [H]."""
    slope = captured(slopes, "alibi_slopes")

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slope[h] * (kv_idx - q_idx)

    return alibi_score


def document_ids(lengths, device="cpu"):
    """The document id of each token of a packed sequence of documents of ``lengths``, int32 [Σ lengths]."""
    lengths = torch.as_tensor(lengths)
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths).to(device)


def document_mask(doc_ids, causal=True):
    """Document masking of a packed batch: a query sees keys of its own document (and, if causal, not later ones).

    ``doc_ids``: the document of each token, [S] (shared by the batch) or [B, S] (one packing per row).
    """
    doc = captured(doc_ids, "document_id")
    per_row = doc_ids.dim() == 2

    def same_document(b, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) if per_row else (doc[q_idx] == doc[kv_idx])

    def document_causal(b, h, q_idx, kv_idx):
        return same_document(b, q_idx, kv_idx) & (q_idx >= kv_idx)

    def document(b, h, q_idx, kv_idx):
        return same_document(b, q_idx, kv_idx)

    return document_causal if causal else document


def prefix_lm(prefix_length):
    """Prefix-LM: the first ``prefix_length`` tokens see each other both ways; the rest is causal."""
    prefix_length = int(prefix_length)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_length) | (q_idx >= kv_idx)

    return prefix_lm_mask


def window_with_globals(window, n_global):
    """A causal sliding window of ``window`` keys, plus ``n_global`` global tokens every query sees and that see
    every earlier token (Longformer's pattern, causal)."""
    window, n_global = int(window), int(n_global)

    def window_global(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        return causal & ((q_idx - kv_idx < window) | (kv_idx < n_global) | (q_idx < n_global))

    return window_global
