"""What each task kind does on the device, as one row of int32 operand columns.

The device knows eight tile operations (``Op``); every ``TaskKind`` is one of them on
particular buffers.  ``DESCRIBE[kind](tasks, space)`` turns tasks of that kind into
their operand rows, vectorised — one function per kind, each the device twin of the
kind's torch kernel in ``regions.kernels`` / ``regions.backward_kernels``.

An operand is (buffer id, first row, first column) in a ``BufferSpace``; element (i, j)
of operand X is ``X[row + i, col + j]`` (``X[row + j, col + i]`` when transposed).

  GEMM        C[M, N] = A[M, K] @ B[K, N], fp32 accumulation; VARIANT says which of A
              and B is read transposed (NT: B is a [N, K] weight; NN; TN: A is [K, M]).
  COPY        C[i, :N] = A[i, :N] for M rows (a put: C lives in the peer's region).
  GATHER      C[i, :N] = A[I[i], :N], times W[i] in fp32 when W is given (permute);
              VARIANT 1: W[i] rides after the row instead (float32 at column KK).
  SWIGLU      C[i, j] = silu(A[i, j]) * A[i, N + j].
  SWIGLU_BWD  C = d(silu(gate) * up) from h = A and the output gradient B; VARIANT 1 (the
              routed experts, ``glu_router_backward``): B is d, the routing weight rides
              at column KK of W's rows, S = w * act(h) and the router gradient rides back
              at column KK of I's rows.
  SUM         C[i, :] = sum_j W[i, j] * A[I[i, j], :] over KK slots in order, in fp32
              (no W: weight 1), plus S[i, :] when given (unpermute).
  PICK        C[i, j] = the float32 riding at column B_COL of row I[i, j] of B, j < KK
              (the router gradient, back with its slot's row).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import numpy as np

from .buffers import BufferSpace
from .core import ROW_TAIL, TaskColumns, TaskGraph, TaskKind, deprecated, row_width


class Op(enum.IntEnum):
    GEMM = 0
    COPY = 1
    GATHER = 2
    SWIGLU = 3
    SWIGLU_BWD = 4
    SUM = 5
    PICK = 6


class Gemm(enum.IntEnum):
    """Which GEMM operands are read transposed."""

    NT = 0
    NN = 1
    TN = 2


COLUMNS = ("kind", "op", "variant", "m", "n", "k", "a_buf", "a_row", "a_col", "b_buf", "b_row", "b_col",
           "c_buf", "c_row", "c_col", "i_buf", "i_row", "w_buf", "w_row", "s_buf", "s_row", "kk")
COL = {name: i for i, name in enumerate(COLUMNS)}
NCOL = len(COLUMNS)




Describe = Callable[[TaskColumns, BufferSpace], dict[str, np.ndarray]]


class _Tasks:
    """What ``Tasks`` was: ``Tasks.of(graph, ids)``, the tasks ``ids``' columns."""

    @staticmethod
    def of(graph: TaskGraph, ids: np.ndarray) -> TaskColumns:
        return graph.select(ids)


def __getattr__(name: str) -> object:
    if name == "Tasks":  # retired: the columns are declared once, in ir.graph.TaskColumns
        deprecated("gpu.ops.Tasks", "TaskGraph.select(ids) gives an ir.graph.TaskColumns")
        return _Tasks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _op(op: Op, t: TaskColumns, sp: BufferSpace, **cols: object) -> dict[str, np.ndarray]:
    """Operand columns: buffers given as (field name, rank array) or as buffer ids, the
    rest as arrays; unnamed buffers are -1 (absent), unnamed numbers 0."""
    n = len(t.rank)
    out = {c: np.full(n, -1 if c.endswith("_buf") else 0, np.int64) for c in COLUMNS}
    out["op"] = np.full(n, int(op), np.int64)
    for name, value in cols.items():
        if name.endswith("_buf"):
            out[name] = value if isinstance(value, np.ndarray) else sp.ids(*value)
        else:
            out[name] = np.broadcast_to(np.asarray(value, np.int64), (n,))
    return out


def _dims(sp: BufferSpace) -> tuple[int, int, int, int, int, int]:
    return sp.dims


# ---------------------------------------------------------------------------- forward

def _permute(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
    h = _dims(sp)[2]
    return _op(Op.GATHER, t, sp, m=t.rows, n=h, a_buf=("x", t.rank), i_buf=("tok", t.rank), i_row=t.row0,
               c_buf=("send", t.rank), c_row=t.row0)


def _put(src: str, dst: str, width: str = "h") -> Describe:
    def describe(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
        d = dict(zip("tkhfsl", _dims(sp), strict=True))
        return _op(Op.COPY, t, sp, m=t.rows, n=_size(d, width), a_buf=(src, t.rank), a_row=t.row0,
                   c_buf=(dst, t.peer), c_row=t.dst_row0)
    return describe


def _read_row(t: TaskColumns, sp: BufferSpace) -> np.ndarray:
    """The expert row of its rank's weight buffer each task's expert reads (``BufferSpace.read``)."""
    return sp.read[t.rank, t.expert]


def _gemm_nt(a: str, w: str, c: str, depth: int, weight_rows: int | None) -> Describe:
    """C[rows, cols] = A[rows] @ W[e][cols].T (W rows of expert e start at its read row
    times weight_rows; None: a shared weight)."""
    def describe(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
        d = dict(zip("tkhfsl", _dims(sp), strict=True))
        wrow = t.col0 if weight_rows is None else _read_row(t, sp) * _size(d, weight_rows) + t.col0
        return _op(Op.GEMM, t, sp, variant=Gemm.NT, m=t.rows, n=t.cols, k=_size(d, depth),
                   a_buf=(a, t.rank), a_row=t.row0, b_buf=(w, t.rank), b_row=wrow,
                   c_buf=(c, t.rank), c_row=t.row0, c_col=t.col0)
    return describe


def _size(d: dict[str, int], code: int | str) -> int:
    """A dimension by code: 'h' hidden, 'f' FFN, '2f', 's' shared FFN, '2s', 'w' a
    travelling row's width (``row_width``); ints pass."""
    if isinstance(code, int):
        return code
    if code == "w":
        return row_width(d["h"])
    mult = 2 if code.startswith("2") else 1
    return mult * d[code[-1]]


def _swiglu(src: str, dst: str, width: str) -> Describe:
    def describe(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
        d = dict(zip("tkhfsl", _dims(sp), strict=True))
        return _op(Op.SWIGLU, t, sp, m=t.rows, n=_size(d, width), a_buf=(src, t.rank), a_row=t.row0,
                   c_buf=(dst, t.rank), c_row=t.row0)
    return describe


def _sum(src: str, weights: str | None, shared: str, dst: str) -> Describe:
    def describe(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
        _, k, h, _, fs, _ = _dims(sp)
        cols = {"w_buf": (weights, t.rank), "w_row": t.row0} if weights else {}
        if fs:
            cols.update(s_buf=(shared, t.rank), s_row=t.row0)
        return _op(Op.SUM, t, sp, m=t.rows, n=h, kk=k, a_buf=(src, t.rank), i_buf=("pos", t.rank),
                   i_row=t.row0, c_buf=(dst, t.rank), c_row=t.row0, **cols)
    return describe


# ---------------------------------------------------------------------------- backward

def _grad_permute(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
    """dy rows of the permuted slots, each with its routing weight riding."""
    h = _dims(sp)[2]
    return _op(Op.GATHER, t, sp, variant=1, m=t.rows, n=h, kk=_rider_col(h), a_buf=("dy", t.rank),
               i_buf=("tok", t.rank), i_row=t.row0, w_buf=("roww", t.rank), w_row=t.row0,
               c_buf=("gsend", t.rank), c_row=t.row0)


def _rider_col(h: int) -> int:
    """The column a travelling row's float32 rides at (``backward_kernels.rider``)."""
    return row_width(h) - ROW_TAIL


def _gemm_nn(a: str, w: str, c: str, depth: str, weight_rows: str | None) -> Describe:
    """C[rows, cols] = A[rows] @ W[e][:, cols] (W of expert e starts at its read row times
    weight_rows)."""
    def describe(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
        d = dict(zip("tkhfsl", _dims(sp), strict=True))
        wrow = 0 if weight_rows is None else _read_row(t, sp) * _size(d, weight_rows)
        return _op(Op.GEMM, t, sp, variant=Gemm.NN, m=t.rows, n=t.cols, k=_size(d, depth),
                   a_buf=(a, t.rank), a_row=t.row0, b_buf=(w, t.rank), b_row=wrow, b_col=t.col0,
                   c_buf=(c, t.rank), c_row=t.row0, c_col=t.col0)
    return describe


def _wgrad(g: str, x: str, c: str, width: str, weight_rows: str | None) -> Describe:
    """C[e][cols] = G[rows, cols].T @ X[rows] (one task holds the full reduction); C of
    expert e: its write row of C, or of the scratch ``C + "x"`` (``BufferSpace.write``)."""
    def describe(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
        d = dict(zip("tkhfsl", _dims(sp), strict=True))
        crow, cbuf = t.col0, sp.ids(c, t.rank)
        if weight_rows is not None:
            crow = sp.write[t.rank, t.expert] * _size(d, weight_rows) + t.col0
            cbuf = np.where(sp.scratch[t.rank, t.expert], sp.ids(c + "x", t.rank), cbuf)
        return _op(Op.GEMM, t, sp, variant=Gemm.TN, m=t.cols, n=_size(d, width), k=t.rows,
                   a_buf=(g, t.rank), a_row=t.row0, a_col=t.col0, b_buf=(x, t.rank), b_row=t.row0,
                   c_buf=cbuf, c_row=crow)
    return describe


def _swiglu_bwd(h: str, da: str, dh: str, width: str) -> Describe:
    def describe(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
        d = dict(zip("tkhfsl", _dims(sp), strict=True))
        return _op(Op.SWIGLU_BWD, t, sp, m=t.rows, n=_size(d, width), a_buf=(h, t.rank), a_row=t.row0,
                   b_buf=(da, t.rank), b_row=t.row0, c_buf=(dh, t.rank), c_row=t.row0)
    return describe


def _router_swiglu_bwd(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
    """The routed experts' SwiGLU backward: dh, aw and the router gradients riding in dxe,
    from d (in da), h and the routing weights riding in grecv."""
    rows = {"w_row": t.row0, "s_row": t.row0, "i_row": t.row0}
    return {**_swiglu_bwd("h", "da", "dh", "f")(t, sp), "variant": np.ones(len(t.rank), np.int64),
            "kk": np.full(len(t.rank), _rider_col(_dims(sp)[2]), np.int64),
            "w_buf": sp.ids("grecv", t.rank), "s_buf": sp.ids("aw", t.rank), "i_buf": sp.ids("dxe", t.rank),
            **rows}


def _router_grad(t: TaskColumns, sp: BufferSpace) -> dict[str, np.ndarray]:
    _, k, h, _, _, _ = _dims(sp)
    return _op(Op.PICK, t, sp, m=t.rows, kk=k, b_buf=("gcomb", t.rank), b_col=_rider_col(h),
               i_buf=("pos", t.rank), i_row=t.row0, c_buf=("dweights", t.rank), c_row=t.row0)


K = TaskKind
DESCRIBE: dict[TaskKind, Describe] = {
    K.PERMUTE: _permute, K.DISPATCH: _put("send", "recv"),
    K.GEMM_UP: _gemm_nt("recv", "w13", "h", "h", "2f"), K.SWIGLU: _swiglu("h", "a", "f"),
    K.GEMM_DOWN: _gemm_nt("a", "w2", "y", "f", "h"), K.COMBINE: _put("y", "comb"),
    K.UNPERMUTE: _sum("comb", "topk", "so", "out"), K.SHARED_UP: _gemm_nt("x", "sw13", "sh", "h", None),
    K.SHARED_SWIGLU: _swiglu("sh", "sa", "s"), K.SHARED_DOWN: _gemm_nt("sa", "sw2", "so", "s", None),
    K.GRAD_PERMUTE: _grad_permute, K.GRAD_DISPATCH: _put("gsend", "grecv", "w"),
    K.DGRAD_DOWN: _gemm_nn("grecv", "w2", "da", "h", "h"),
    K.WGRAD_DOWN: _wgrad("grecv", "aw", "dw2", "f", "h"),
    K.SWIGLU_BWD: _router_swiglu_bwd, K.DGRAD_UP: _gemm_nn("dh", "w13", "dxe", "2f", "2f"),
    K.WGRAD_UP: _wgrad("dh", "recv", "dw13", "h", "2f"), K.GRAD_COMBINE: _put("dxe", "gcomb", "w"),
    K.GRAD_UNPERMUTE: _sum("gcomb", None, "sdx", "dx"), K.ROUTER_GRAD: _router_grad,
    K.SHARED_DGRAD_DOWN: _gemm_nn("dy", "sw2", "sda", "h", None),
    K.SHARED_WGRAD_DOWN: _wgrad("dy", "sa", "dsw2", "s", None),
    K.SHARED_SWIGLU_BWD: _swiglu_bwd("sh", "sda", "sdh", "s"),
    K.SHARED_DGRAD_UP: _gemm_nn("sdh", "sw13", "sdx", "2s", None),
    K.SHARED_WGRAD_UP: _wgrad("sdh", "x", "dsw13", "h", None),
    K.SWIGLU_RECOMPUTE: _swiglu("sh", "sa", "s"),  # the shared experts' (routed: in SWIGLU_BWD)
}


# ---------------------------------------------------------------------------- alignment
# The device reads and writes an operand 16 bytes at a time, and software-pipelines the
# GEMM's K loop, only where it may assume alignment (device.py's ALIGNED): the structure
# (strides, first columns, contiguous extents) is checked once per program, the
# addresses per run.

ALIGN = 8  # elements: 16 bytes of bf16


def _hinted(tasks: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(buffer ids, first columns) of the operands the device hints as aligned: A, B and C
    of every task but PICK's float32 C [M, KK]."""
    op = tasks[:, COL["op"]]
    out = []
    for x in "abc":
        used = tasks[:, COL[f"{x}_buf"]] >= 0
        if x == "c":
            used &= op != Op.PICK
        out.append((tasks[used, COL[f"{x}_buf"]], tasks[used, COL[f"{x}_col"]]))
    return out


def aligned_layout(tasks: np.ndarray, space: BufferSpace) -> bool:
    """Whether every hinted operand's row stride and first column, N of every task, K of
    every NT / NN GEMM and M of every TN GEMM (the extents along contiguous dimensions) are
    multiples of ``ALIGN`` elements."""
    op, variant = tasks[:, COL["op"]], tasks[:, COL["variant"]]
    tn = (op == Op.GEMM) & (variant == Gemm.TN)
    extents = (tasks[:, COL["n"]], tasks[(op == Op.GEMM) & ~tn, COL["k"]], tasks[tn, COL["m"]])
    ld = space.ld.reshape(-1)
    return (not any((e % ALIGN).any() for e in extents)
            and not any((ld[b] % ALIGN).any() or (c % ALIGN).any() for b, c in _hinted(tasks)))


def aligned_addresses(tasks: np.ndarray, addresses: np.ndarray) -> bool:
    """Whether every hinted operand's buffer starts on a 16-byte boundary."""
    return not any((addresses[b] % 16).any() for b, _ in _hinted(tasks))


def describe(graph: TaskGraph, space: BufferSpace) -> np.ndarray:
    """[n, NCOL] int64 operand rows of every task of ``graph`` (column ``kind`` first)."""
    out = np.zeros((graph.num_tasks, NCOL), np.int64)
    for k in np.unique(graph.kind).tolist():
        kind = TaskKind(k)
        if kind not in DESCRIBE:
            raise ValueError(f"task kind {kind.name} has no device operation")
        ids = np.flatnonzero(graph.kind == k)
        cols = DESCRIBE[kind](graph.select(ids), space)
        cols["kind"] = np.full(len(ids), k, np.int64)
        out[ids] = np.stack([cols[c] for c in COLUMNS], axis=1)
    return out
