"""The device side: eight tile operations and the persistent worker loop, in Triton
(and kernel by kernel's combine, ``combine_kernel``, a plain launch).

Program q of ``taskflow_kernel`` walks worker queue q of a ``PackedProgram``:

    wait (acquire) -> run the task's tile operation -> barrier -> release-add signals

and nothing else: no policy, no MoE knowledge — order and placement came from the
schedule, operands from ``ops.describe``.  Two modes share the loop:

* BLOCKING (a GPU): a wait spins on an acquire load until its counter reaches the
  task's threshold or ``deadline_ns`` of the global timer pass; a late wait writes
  (flag, task, event, counter) to its program's row of ``errors`` and the program ends.
* rounds (the Triton interpreter, which runs programs one after another): a wait polls
  once; when unsatisfied the program stores its cursor and returns, and the host
  launches the grid again until every queue is done.

Column indices below mirror ``ops.COLUMNS`` and op codes ``ops.Op`` (checked by a test).
"""

from __future__ import annotations

import triton
import triton.language as tl

C_OP = tl.constexpr(1)
C_VARIANT = tl.constexpr(2)
C_M = tl.constexpr(3)
C_N = tl.constexpr(4)
C_K = tl.constexpr(5)
C_A = tl.constexpr(6)  # a_buf, a_row, a_col
C_B = tl.constexpr(9)  # b_buf, b_row, b_col
C_C = tl.constexpr(12)  # c_buf, c_row, c_col
C_I = tl.constexpr(15)  # i_buf, i_row
C_W = tl.constexpr(17)  # w_buf, w_row
C_S = tl.constexpr(19)  # s_buf, s_row
C_KK = tl.constexpr(21)
NCOL = tl.constexpr(22)

OP_GEMM = tl.constexpr(0)
OP_COPY = tl.constexpr(1)
OP_GATHER = tl.constexpr(2)
OP_SWIGLU = tl.constexpr(3)
OP_SWIGLU_BWD = tl.constexpr(4)
OP_SUM = tl.constexpr(5)
OP_PICK = tl.constexpr(6)

# Slots a SUM takes per unrolled step: their gathered rows are loaded together,
# so one chunk waits for memory slots / SLOTS_IN_FLIGHT times instead of once per slot
# (each slot's additions keep their order: the bits do not change).  The step has no
# branch inside (an unweighted SUM multiplies by 1.0, exactly): the compiler does not
# move a load above a branch, and a branch per slot put each slot's loads in a block of
# their own (the sm_90 build's SASS; on an H200 the unpermute did not move).
SLOTS_IN_FLIGHT = tl.constexpr(4)


# ---------------------------------------------------------------------------- operands

@triton.jit
def _base(row, col: tl.constexpr, addr, lds, DT: tl.constexpr, ALIGNED: tl.constexpr = False):
    """(pointer to element (0, 0), row stride) of the operand at ``row[col:col + 3]``;
    an absent buffer (-1) reads buffer 0's address and must not be dereferenced.
    ALIGNED: the host checked that the address is 16-byte aligned and the stride a multiple
    of 8 elements.  The hints are applied here, not by the caller: a hint on the result of
    a jit function call is lost when the call is inlined."""
    buf = tl.maximum(tl.load(row + col), 0)
    ld = tl.load(lds + buf).to(tl.int64)
    ptr = tl.load(addr + buf).to(tl.pointer_type(DT))
    ptr = ptr + tl.load(row + col + 1).to(tl.int64) * ld + tl.load(row + col + 2)
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
        ld = tl.multiple_of(ld, 8)
    return ptr, ld


@triton.jit
def _extent(row, col: tl.constexpr, ALIGNED: tl.constexpr):
    """The task's extent at ``row[col]``; ALIGNED: the host checked it is a multiple of 8
    (loaded and hinted here: the hint survives inlining on the load itself)."""
    v = tl.load(row + col)
    if ALIGNED:
        v = tl.multiple_of(v, 8)
    return v


@triton.jit
def _base2(row, col: tl.constexpr, addr, lds, DT: tl.constexpr):
    """As ``_base`` for a (buffer, row) operand without a column."""
    buf = tl.maximum(tl.load(row + col), 0)
    ld = tl.load(lds + buf).to(tl.int64)
    ptr = tl.load(addr + buf).to(tl.pointer_type(DT))
    return ptr + tl.load(row + col + 1).to(tl.int64) * ld, ld


# ---------------------------------------------------------------------------- tile operations
# Only core builtins and functions of this module: the standard library's jit functions
# (tl.zeros, tl.sum, ...) are bound to one mode when triton is imported, and the
# interpreted copy of this module must not call compiled ones.

@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _to(x, DT: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``x`` rounded to ``DT`` to nearest even.  The interpreter truncates when it
    narrows to bfloat16, so there (EMULATE) the rounding is done on the bits."""
    if EMULATE and DT == tl.bfloat16:  # noqa: SIM300 (DT is a constexpr: it must come first)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True).to(DT)
    else:
        y = x.to(DT)
    return y


@triton.jit
def gemm_tile(row, addr, lds, DT: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
              ALIGNED: tl.constexpr):
    """C[M, N] = A[M, K] @ B[K, N] in BM x BN blocks, fp32 accumulation over BK slices.

    ALIGNED: the host checked that every operand's address, row stride and column offset,
    and the extents along contiguous dimensions (K of A and B^T, M of A^T, N of B and C)
    are multiples of 8 elements; the hints let every load and store be 16 bytes wide and
    the K loop be software-pipelined (asynchronous copies, ``num_stages`` deep)."""
    m = _extent(row, C_M, ALIGNED and A_T)
    n = _extent(row, C_N, ALIGNED)
    k = _extent(row, C_K, ALIGNED and not A_T)
    a, lda = _base(row, C_A, addr, lds, DT, ALIGNED)
    b, ldb = _base(row, C_B, addr, lds, DT, ALIGNED)
    c, ldc = _base(row, C_C, addr, lds, DT, ALIGNED)
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    for m0 in range(0, m, BM):
        im = m0 + rm
        for n0 in range(0, n, BN):
            jn = n0 + rn
            acc = tl.full((BM, BN), 0.0, tl.float32)
            for k0 in range(0, k, BK):
                kk = k0 + rk
                if A_T:
                    pa = a + kk[None, :].to(tl.int64) * lda + im[:, None]
                else:
                    pa = a + im[:, None].to(tl.int64) * lda + kk[None, :]
                if B_T:
                    pb = b + jn[None, :].to(tl.int64) * ldb + kk[:, None]
                else:
                    pb = b + kk[:, None].to(tl.int64) * ldb + jn[None, :]
                x = tl.load(pa, mask=(im[:, None] < m) & (kk[None, :] < k), other=0.0)
                y = tl.load(pb, mask=(kk[:, None] < k) & (jn[None, :] < n), other=0.0)
                if UPCAST:
                    x = x.to(tl.float32)
                    y = y.to(tl.float32)
                acc = tl.dot(x, y, acc, input_precision=PREC)
            pc = c + im[:, None].to(tl.int64) * ldc + jn[None, :]
            tl.store(pc, _to(acc, DT, UPCAST), mask=(im[:, None] < m) & (jn[None, :] < n))


@triton.jit
def copy_tile(row, addr, lds, DT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ALIGNED: tl.constexpr):
    """C[i, :N] = A[i, :N] for M rows: a put into the peer's region, or a local copy."""
    m = tl.load(row + C_M)
    n = _extent(row, C_N, ALIGNED)
    a, lda = _base(row, C_A, addr, lds, DT, ALIGNED)
    c, ldc = _base(row, C_C, addr, lds, DT, ALIGNED)
    for r0 in range(0, m, BR):
        ir = r0 + tl.arange(0, BR)
        for c0 in range(0, n, BC):
            jc = c0 + tl.arange(0, BC)
            mask = (ir[:, None] < m) & (jc[None, :] < n)
            v = tl.load(a + ir[:, None].to(tl.int64) * lda + jc[None, :], mask=mask)
            tl.store(c + ir[:, None].to(tl.int64) * ldc + jc[None, :], v, mask=mask)


@triton.jit
def gather_tile(row, addr, lds, DT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, EMULATE: tl.constexpr,
                ALIGNED: tl.constexpr):
    """C[i, :N] = A[I[i], :N], scaled by W[i] in fp32 when W is given; VARIANT 1
    (carry): not scaled, W[i] riding after the row instead (float32 at column KK)."""
    m = tl.load(row + C_M)
    n = _extent(row, C_N, ALIGNED)
    carry = tl.load(row + C_VARIANT) == 1
    weighted = tl.load(row + C_W) >= 0
    scaled = weighted & (tl.load(row + C_VARIANT) != 1)
    a, lda = _base(row, C_A, addr, lds, DT, ALIGNED)
    c, ldc = _base(row, C_C, addr, lds, DT, ALIGNED)
    ip, ldi = _base2(row, C_I, addr, lds, tl.int32)
    wp, ldw = _base2(row, C_W, addr, lds, tl.float32)
    for r0 in range(0, m, BR):
        ir = r0 + tl.arange(0, BR)
        src = tl.load(ip + ir.to(tl.int64) * ldi, mask=ir < m, other=0).to(tl.int64)
        w = tl.load(wp + ir.to(tl.int64) * ldw, mask=(ir < m) & weighted, other=1.0)
        for c0 in range(0, n, BC):
            jc = c0 + tl.arange(0, BC)
            mask = (ir[:, None] < m) & (jc[None, :] < n)
            v = tl.load(a + src[:, None] * lda + jc[None, :], mask=mask)
            if scaled:
                v = _to(v.to(tl.float32) * w[:, None], DT, EMULATE)
            tl.store(c + ir[:, None].to(tl.int64) * ldc + jc[None, :], v, mask=mask)
        if carry:
            tl.store(_rider(c, ir, ldc, tl.load(row + C_KK)), w, mask=ir < m)


@triton.jit
def _rider(base, ir, ld, col):
    """float32 pointers to the value riding at column ``col`` of rows ``ir`` of ``base``."""
    return (base + ir.to(tl.int64) * ld + col).to(tl.pointer_type(tl.float32))


@triton.jit
def swiglu_tile(row, addr, lds, DT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, EMULATE: tl.constexpr,
                ALIGNED: tl.constexpr):
    """C[i, j] = silu(A[i, j]) * A[i, N + j], rounded as torch rounds (silu, then product)."""
    m = tl.load(row + C_M)
    n = _extent(row, C_N, ALIGNED)
    a, lda = _base(row, C_A, addr, lds, DT, ALIGNED)
    c, ldc = _base(row, C_C, addr, lds, DT, ALIGNED)
    for r0 in range(0, m, BR):
        ir = r0 + tl.arange(0, BR)
        for c0 in range(0, n, BC):
            jc = c0 + tl.arange(0, BC)
            mask = (ir[:, None] < m) & (jc[None, :] < n)
            pa = a + ir[:, None].to(tl.int64) * lda + jc[None, :]
            g = tl.load(pa, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(pa + n, mask=mask, other=0.0).to(tl.float32)
            tl.store(c + ir[:, None].to(tl.int64) * ldc + jc[None, :], _swiglu(g, u, DT, EMULATE), mask=mask)


@triton.jit
def _swiglu(g, u, DT: tl.constexpr, EMULATE: tl.constexpr):
    """silu(g) * u of fp32 g, u in DT, rounded as torch rounds it (silu, then the product)."""
    s = _to(g / (1.0 + tl.exp(-g)), DT, EMULATE).to(tl.float32)
    return _to(s * u, DT, EMULATE)


@triton.jit
def swiglu_bwd_tile(row, addr, lds, DT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                    EMULATE: tl.constexpr, ALIGNED: tl.constexpr):
    """dh = d(silu(gate) * up) given h = A and da = B, as autograd rounds it.  VARIANT 1
    (the routed experts, ``glu_router_backward``): B holds d (the rows' unweighted output
    gradient times W2) and each row's routing weight w rides at column KK of W's rows;
    then da = w * d rounded, S = w * act(h) rounded (the down projection's weight-gradient
    operand) and the row's router gradient <d, act(h)> (fp32) rides at column KK of I's
    rows."""
    m = tl.load(row + C_M)
    n = _extent(row, C_N, ALIGNED)
    weighted = tl.load(row + C_VARIANT) == 1
    kk = tl.load(row + C_KK)
    a, lda = _base(row, C_A, addr, lds, DT, ALIGNED)
    b, ldb = _base(row, C_B, addr, lds, DT, ALIGNED)
    c, ldc = _base(row, C_C, addr, lds, DT, ALIGNED)
    wb, ldw = _base2(row, C_W, addr, lds, DT)
    sb, lds_ = _base2(row, C_S, addr, lds, DT)
    ib, ldi = _base2(row, C_I, addr, lds, DT)
    for r0 in range(0, m, BR):
        ir = r0 + tl.arange(0, BR)
        w = tl.load(_rider(wb, ir, ldw, kk), mask=(ir < m) & weighted, other=1.0)
        acc = tl.full((BR,), 0.0, tl.float32)
        for c0 in range(0, n, BC):
            jc = c0 + tl.arange(0, BC)
            mask = (ir[:, None] < m) & (jc[None, :] < n)
            pa = a + ir[:, None].to(tl.int64) * lda + jc[None, :]
            g = tl.load(pa, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(pa + n, mask=mask, other=0.0).to(tl.float32)
            d = tl.load(b + ir[:, None].to(tl.int64) * ldb + jc[None, :], mask=mask, other=0.0).to(tl.float32)
            if weighted:
                act = _swiglu(g, u, DT, EMULATE).to(tl.float32)
                acc += tl.reduce(d * act, 1, _add)
                ps = sb + ir[:, None].to(tl.int64) * lds_ + jc[None, :]
                tl.store(ps, _to(act * w[:, None], DT, EMULATE), mask=mask)
                d = _to(d * w[:, None], DT, EMULATE).to(tl.float32)
            dgate, dup = _swiglu_grad(g, u, d, DT, EMULATE)
            pc = c + ir[:, None].to(tl.int64) * ldc + jc[None, :]
            tl.store(pc, dgate, mask=mask)
            tl.store(pc + n, dup, mask=mask)
        if weighted:
            tl.store(_rider(ib, ir, ldi, kk), acc, mask=ir < m)


@triton.jit
def _swiglu_grad(g, u, d, DT: tl.constexpr, EMULATE: tl.constexpr):
    """(d gate, d up) in DT of silu(g) * u given its gradient d (fp32 g, u, d), as
    autograd rounds them (d * u rounded first, then silu's backward; d times silu(g))."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    t = _to(d * u, DT, EMULATE).to(tl.float32)
    dgate = t * sig * (1.0 + g * (1.0 - sig))
    dup = d * _to(g * sig, DT, EMULATE).to(tl.float32)
    return _to(dgate, DT, EMULATE), _to(dup, DT, EMULATE)


@triton.jit
def sum_tile(row, addr, lds, DT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, EMULATE: tl.constexpr,
             ALIGNED: tl.constexpr):
    """C[i, :] = sum over slots j in order of W[i, j] * A[I[i, j], :] (fp32) + S[i, :]."""
    m = tl.load(row + C_M)
    n = _extent(row, C_N, ALIGNED)
    slots = tl.load(row + C_KK)
    weighted = tl.load(row + C_W) >= 0
    shared = tl.load(row + C_S) >= 0
    a, lda = _base(row, C_A, addr, lds, DT, ALIGNED)
    c, ldc = _base(row, C_C, addr, lds, DT, ALIGNED)
    ip, ldi = _base2(row, C_I, addr, lds, tl.int32)
    wp, ldw = _base2(row, C_W, addr, lds, tl.float32)
    sp, lds_ = _base2(row, C_S, addr, lds, DT)
    for r0 in range(0, m, BR):
        ir = r0 + tl.arange(0, BR)
        for c0 in range(0, n, BC):
            jc = c0 + tl.arange(0, BC)
            acc = _gather_sum(a, lda, ip, ldi, wp, ldw, sp, lds_, ir, jc, m, n, slots, weighted, shared,
                              BR, BC)
            mask = (ir[:, None] < m) & (jc[None, :] < n)
            tl.store(c + ir[:, None].to(tl.int64) * ldc + jc[None, :], _to(acc, DT, EMULATE), mask=mask)


@triton.jit
def _gather_sum(a, lda, ip, ldi, wp, ldw, sp, lds_, ir, jc, m, n, slots, weighted, shared,
                BR: tl.constexpr, BC: tl.constexpr):
    """fp32 [BR, BC]: rows ir < m, columns jc < n of sum over slots j in order of
    W[i, j] * A[I[i, j], :] (W read only where ``weighted``, else 1.0: exact) + S[i, :]
    (where ``shared``), from 0; SLOTS_IN_FLIGHT slots' rows loaded per step."""
    mask = (ir[:, None] < m) & (jc[None, :] < n)
    acc = tl.full((BR, BC), 0.0, tl.float32)
    for j0 in range(0, slots, SLOTS_IN_FLIGHT):
        for u in tl.static_range(SLOTS_IN_FLIGHT):
            j = j0 + u
            live = (ir < m) & (j < slots)
            src = tl.load(ip + ir.to(tl.int64) * ldi + j, mask=live, other=0).to(tl.int64)
            v = tl.load(a + src[:, None] * lda + jc[None, :], mask=mask & live[:, None], other=0.0)
            v = v.to(tl.float32)
            w = tl.load(wp + ir.to(tl.int64) * ldw + j, mask=live & weighted, other=1.0)
            acc = acc + w[:, None] * v
    if shared:
        s = tl.load(sp + ir[:, None].to(tl.int64) * lds_ + jc[None, :], mask=mask, other=0.0)
        acc = acc + s.to(tl.float32)
    return acc


@triton.jit
def pick_tile(row, addr, lds, DT: tl.constexpr, BR: tl.constexpr):
    """C[i, j] = the float32 riding at column B_COL of row I[i, j] of B, j < KK (C is
    float32): each slot's router gradient, back with its row."""
    m = tl.load(row + C_M)
    slots = tl.load(row + C_KK)
    col = tl.load(row + C_B + 2)
    b, ldb = _base2(row, C_B, addr, lds, DT)
    c, ldc = _base2(row, C_C, addr, lds, tl.float32)
    ip, ldi = _base2(row, C_I, addr, lds, tl.int32)
    for r0 in range(0, m, BR):
        ir = r0 + tl.arange(0, BR)
        for j in range(0, slots):
            live = ir < m
            src = tl.load(ip + ir.to(tl.int64) * ldi + j, mask=live, other=0)
            v = tl.load(_rider(b, src, ldb, col), mask=live, other=0.0)
            tl.store(c + ir.to(tl.int64) * ldc + j, v, mask=live)


@triton.jit
def run_task(row, addr, lds, DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             BR: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
             ALIGNED: tl.constexpr):
    """Dispatch one task (its operand row) to its tile operation."""
    op = tl.load(row + C_OP)
    if op == OP_GEMM:
        variant = tl.load(row + C_VARIANT)
        if variant == 0:
            gemm_tile(row, addr, lds, DT, False, True, BM, BN, BK, PREC, UPCAST, ALIGNED)
        elif variant == 1:
            gemm_tile(row, addr, lds, DT, False, False, BM, BN, BK, PREC, UPCAST, ALIGNED)
        else:
            gemm_tile(row, addr, lds, DT, True, False, BM, BN, BK, PREC, UPCAST, ALIGNED)
    elif op == OP_COPY:
        copy_tile(row, addr, lds, DT, BR, BC, ALIGNED)
    elif op == OP_GATHER:
        gather_tile(row, addr, lds, DT, BR, BC, UPCAST, ALIGNED)
    elif op == OP_SWIGLU:
        swiglu_tile(row, addr, lds, DT, BR, BC, UPCAST, ALIGNED)
    elif op == OP_SWIGLU_BWD:
        swiglu_bwd_tile(row, addr, lds, DT, BR, BC, UPCAST, ALIGNED)
    elif op == OP_SUM:
        sum_tile(row, addr, lds, DT, BR, BC, UPCAST, ALIGNED)
    else:
        pick_tile(row, addr, lds, DT, BR)


# ---------------------------------------------------------------------------- the worker loop

@triton.jit
def globaltimer():
    """Nanoseconds of the GPU's global timer (compiled mode only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def nanosleep(ns):
    """Suspend the warp for about ``ns`` nanoseconds (compiled mode only): a waiting
    program backs off instead of polling L2 flat out."""
    return tl.inline_asm_elementwise("nanosleep.u32 $1;\n mov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _now(clock, STAMP: tl.constexpr):
    """A time stamp: the global timer (STAMP 2) or a logical clock ticking once per stamp (1)."""
    if STAMP == 2:  # noqa: SIM108 (a constexpr branch: only one side is traced)
        t = globaltimer()
    else:
        t = tl.atomic_add(clock, 1).to(tl.int64)
    return t


@triton.jit
def wait_event(t, q, wait_event_, wait_threshold, counters, errors, deadline_ns, BLOCKING: tl.constexpr):
    """True when task t may run: its event reached its threshold (acquire; every call
    starts its counters from zero).  BLOCKING spins until then or the deadline,
    recording a late wait; the spin backs off (``nanosleep``, 32 ns doubling to 1 us
    between polls)."""
    ev = tl.load(wait_event_ + t)
    ok = ev < 0
    if ev >= 0:
        need = tl.load(wait_threshold + t)
        seen = tl.atomic_add(counters + ev, 0, sem="acquire", scope="gpu")
        ok = seen >= need
        if BLOCKING:
            start = globaltimer()
            late = start < 0
            pause = tl.full((), 32, tl.int32)
            while (ok == 0) & (late == 0):
                nanosleep(pause)
                pause = tl.minimum(pause * 2, 1024)
                seen = tl.atomic_add(counters + ev, 0, sem="acquire", scope="gpu")
                ok = seen >= need
                late = globaltimer() - start > deadline_ns
            if ok == 0:
                tl.store(errors + 4 * q, 1)
                tl.store(errors + 4 * q + 1, t)
                tl.store(errors + 4 * q + 2, ev)
                tl.store(errors + 4 * q + 3, seen)
    return ok


@triton.jit
def taskflow_kernel(tasks, wait_event_, wait_threshold, sig_ptr, sig_event, queue_ptr, queue_task,
                    addr, lds, counters, cursor, errors, stamps, clock, delays, deadline_ns,
                    DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    BR: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCKING: tl.constexpr, STAMP: tl.constexpr, DELAY: tl.constexpr, ALIGNED: tl.constexpr):
    """Program q runs worker queue q from its saved cursor: wait, run, barrier, signal."""
    q = tl.program_id(0)
    lo = tl.load(queue_ptr + q)
    hi = tl.load(queue_ptr + q + 1)
    i = lo + tl.load(cursor + q)
    if DELAY:
        t0 = globaltimer()
        pause = tl.load(delays + q)
        now = t0
        while now - t0 < pause:
            now = globaltimer()
    go = i < hi
    while go:
        t = tl.load(queue_task + i)
        ok = wait_event(t, q, wait_event_, wait_threshold, counters, errors, deadline_ns, BLOCKING)
        if ok:
            if STAMP:
                tl.store(stamps + 2 * t, _now(clock, STAMP))
            run_task(tasks + t.to(tl.int64) * NCOL, addr, lds, DT, BM, BN, BK, BR, BC, PREC, UPCAST, ALIGNED)
            tl.debug_barrier()
            if STAMP:
                end = _now(clock, STAMP)
            for s in range(tl.load(sig_ptr + t), tl.load(sig_ptr + t + 1)):
                tl.atomic_add(counters + tl.load(sig_event + s), 1, sem="release", scope="gpu")
            if STAMP:  # stored after the signals: the barrier must be the last ordering before them
                tl.store(stamps + 2 * t + 1, end)
            i += 1
        go = ok & (i < hi)
    tl.store(cursor + q, i - lo)


# ---------------------------------------------------------------------------- kernel by kernel

@triton.jit
def combine_kernel(rows, pos, w, extra, out, t, n, ld_rows, ld_extra, ld_out,
                   K: tl.constexpr, WEIGHTED: tl.constexpr, EXTRA: tl.constexpr, DT: tl.constexpr,
                   BR: tl.constexpr, BC: tl.constexpr, EMULATE: tl.constexpr):
    """Kernel by kernel's combine on a GPU, one launch: the SUM tile's block sum
    (``_gather_sum``) over pos [t, K] int64 and w [t, K] fp32 (read where WEIGHTED) plus
    extra (where EXTRA), rounded to DT once; each program a (BR, BC) block.  The products
    and sums are ``weighted_sum`` / ``slot_sum``'s in their order (launched without FMA
    contraction), so the values are theirs bit for bit (a weighted sum of negative zeros
    alone comes out +0 here, -0 there)."""
    ir = tl.program_id(0) * BR + tl.arange(0, BR)
    jc = tl.program_id(1) * BC + tl.arange(0, BC)
    wp = w.to(tl.pointer_type(tl.float32), bitcast=True)  # pos's address where not WEIGHTED: unread
    acc = _gather_sum(rows, ld_rows, pos, K, wp, K, extra, ld_extra, ir, jc, t, n, K, WEIGHTED, EXTRA, BR, BC)
    mask = (ir[:, None] < t) & (jc[None, :] < n)
    tl.store(out + ir[:, None].to(tl.int64) * ld_out + jc[None, :], _to(acc, DT, EMULATE), mask=mask)


@triton.jit
def combine_backward_kernel(rows, pos, w, g, dw, drows, t, n, ld_rows, ld_g, ld_drows,
                            K: tl.constexpr, KP: tl.constexpr, DT: tl.constexpr, BR: tl.constexpr,
                            BC: tl.constexpr, EMULATE: tl.constexpr):
    """The gradients of ``combine_kernel`` (weighted, g [T, H] the output's, read in fp32), one
    launch: dw[i, j] = sum_c rows[pos[i, j], c] * g[i, c] in fp32 (the products rounded,
    summed block of columns by block) and drows[pos[i, j], :] = g[i, :] * w[i, j]
    rounded to DT once, as ``weighted_sum_backward``: drows with its bits, dw in another
    order of the same sum (deterministic).  Each program a block of BR rows, every column;
    KP: K rounded up to a power of two."""
    ir = tl.program_id(0) * BR + tl.arange(0, BR)
    live = ir < t
    ju = tl.arange(0, KP)
    acc = tl.full((BR, KP), 0.0, tl.float32)  # column j: slot j's dot product
    for c0 in range(0, n, BC):
        jc = c0 + tl.arange(0, BC)
        mask = live[:, None] & (jc[None, :] < n)
        gb = tl.load(g + ir[:, None].to(tl.int64) * ld_g + jc[None, :], mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            dst = tl.load(pos + ir.to(tl.int64) * K + j, mask=live, other=0)
            v = tl.load(rows + dst[:, None] * ld_rows + jc[None, :], mask=mask, other=0.0).to(tl.float32)
            part = tl.reduce(v * gb, 1, _add)
            acc = tl.where(ju[None, :] == j, acc + part[:, None], acc)
            wj = tl.load(w + ir.to(tl.int64) * K + j, mask=live, other=0.0)
            scaled = _to(gb * wj[:, None], DT, EMULATE)
            tl.store(drows + dst[:, None] * ld_drows + jc[None, :], scaled, mask=mask)
    tl.store(dw + ir[:, None].to(tl.int64) * K + ju[None, :], acc, mask=live[:, None] & (ju[None, :] < K))


@triton.jit
def permute_kernel(x, order, rows, t, n, ld_x, ld_rows, K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """rows[i, :] = x[order[i] // K, :] for the t sorted (token, slot) rows, one launch:
    each program a (BR, BC) block."""
    ir = tl.program_id(0) * BR + tl.arange(0, BR)
    jc = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (ir[:, None] < t) & (jc[None, :] < n)
    src = tl.load(order + ir.to(tl.int64), mask=ir < t, other=0) // K
    v = tl.load(x + src[:, None].to(tl.int64) * ld_x + jc[None, :], mask=mask)
    tl.store(rows + ir[:, None].to(tl.int64) * ld_rows + jc[None, :], v, mask=mask)


@triton.jit
def glu_kernel(h, a, m, f, ld_h, ld_a, DT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
               EMULATE: tl.constexpr):
    """a[i, j] = silu(h[i, j]) * h[i, f + j] (``_swiglu``) for m rows, one launch: each
    program a (BR, BC) block."""
    ir = tl.program_id(0) * BR + tl.arange(0, BR)
    jc = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (ir[:, None] < m) & (jc[None, :] < f)
    ph = h + ir[:, None].to(tl.int64) * ld_h + jc[None, :]
    g = tl.load(ph, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(ph + f, mask=mask, other=0.0).to(tl.float32)
    tl.store(a + ir[:, None].to(tl.int64) * ld_a + jc[None, :], _swiglu(g, u, DT, EMULATE), mask=mask)


@triton.jit
def glu_backward_kernel(h, da, dh, m, f, ld_h, ld_da, ld_dh, DT: tl.constexpr, BR: tl.constexpr,
                        BC: tl.constexpr, EMULATE: tl.constexpr):
    """dh [m, 2f] = the gradient of ``glu_kernel``'s output given da [m, f]
    (``_swiglu_grad``), one launch: each program a (BR, BC) block."""
    ir = tl.program_id(0) * BR + tl.arange(0, BR)
    jc = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (ir[:, None] < m) & (jc[None, :] < f)
    ph = h + ir[:, None].to(tl.int64) * ld_h + jc[None, :]
    g = tl.load(ph, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(ph + f, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(da + ir[:, None].to(tl.int64) * ld_da + jc[None, :], mask=mask, other=0.0).to(tl.float32)
    dgate, dup = _swiglu_grad(g, u, d, DT, EMULATE)
    pd = dh + ir[:, None].to(tl.int64) * ld_dh + jc[None, :]
    tl.store(pd, dgate, mask=mask)
    tl.store(pd + f, dup, mask=mask)


@triton.jit
def glu_router_backward_kernel(h, d, w, dh, aw, ds, m, f, ld_h, ld_d, ld_dh, ld_aw, WEIGHTED: tl.constexpr,
                               DT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, EMULATE: tl.constexpr):
    """The experts' backward between their GEMMs, one launch (``exec.phases.
    glu_router_backward``): per row, a = silu(gate) * up recomputed from h [m, 2f] (rounded
    as the forward), ds = sum_c d * a in fp32 (the routing weight's gradient), da =
    w * d rounded, dh = the gated activation's gradient of da (``_swiglu_grad``) and
    aw = w * a rounded; without WEIGHTED w is 1 (da = d, aw = a) and ds is not written.
    Each program BR rows, every column."""
    ir = tl.program_id(0) * BR + tl.arange(0, BR)
    live = ir < m
    wr = tl.load(w + ir.to(tl.int64), mask=live, other=1.0) if WEIGHTED else tl.full((BR,), 1.0, tl.float32)
    acc = tl.full((BR,), 0.0, tl.float32)
    for c0 in range(0, f, BC):
        jc = c0 + tl.arange(0, BC)
        mask = live[:, None] & (jc[None, :] < f)
        ph = h + ir[:, None].to(tl.int64) * ld_h + jc[None, :]
        g = tl.load(ph, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(ph + f, mask=mask, other=0.0).to(tl.float32)
        dd = tl.load(d + ir[:, None].to(tl.int64) * ld_d + jc[None, :], mask=mask, other=0.0).to(tl.float32)
        a = _swiglu(g, u, DT, EMULATE).to(tl.float32)
        acc += tl.reduce(dd * a, 1, _add)
        da = _to(dd * wr[:, None], DT, EMULATE).to(tl.float32) if WEIGHTED else dd
        dgate, dup = _swiglu_grad(g, u, da, DT, EMULATE)
        pd = dh + ir[:, None].to(tl.int64) * ld_dh + jc[None, :]
        tl.store(pd, dgate, mask=mask)
        tl.store(pd + f, dup, mask=mask)
        tl.store(aw + ir[:, None].to(tl.int64) * ld_aw + jc[None, :], _to(a * wr[:, None], DT, EMULATE),
                 mask=mask)
    if WEIGHTED:
        tl.store(ds + ir.to(tl.int64), acc, mask=live)


# ---------------------------------------------------------------------------- a call's input scan

BIG = tl.constexpr(1 << 62)  # above every row key and expert id: "nothing found"


@triton.jit
def scan_kernel(x, ids, w, ids_out, facts, counts, n, hidden, ld_x, experts, K: tl.constexpr,
                KP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """The facts of a call's input, each program BR tokens, one launch: facts[0] = min
    over x's non-finite rows r of 2r + (0 for a NaN in the row, 1 for inf alone) (BIG:
    none); facts[1], facts[2] = min and max expert id; facts[3] = 1 for a non-finite
    routing weight.  Also the ids clamped into [0, experts) (``ids_out``) and their rows
    per expert added into ``counts``.  facts and counts start at (BIG, BIG, -BIG, 0) and
    zeros; KP: K rounded up to a power of two."""
    ir = tl.program_id(0) * BR + tl.arange(0, BR)
    live = ir < n
    bad = tl.full((BR,), 0, tl.int32)
    nan = tl.full((BR,), 0, tl.int32)
    for c0 in range(0, hidden, BC):
        jc = c0 + tl.arange(0, BC)
        mask = live[:, None] & (jc[None, :] < hidden)
        v = tl.load(x + ir[:, None].to(tl.int64) * ld_x + jc[None, :], mask=mask, other=0.0).to(tl.float32)
        isnan = v != v
        notfinite = isnan | (v == float("inf")) | (v == float("-inf"))
        bad = tl.maximum(bad, tl.reduce(notfinite.to(tl.int32), 1, _max))
        nan = tl.maximum(nan, tl.reduce(isnan.to(tl.int32), 1, _max))
    key = tl.where(live & (bad > 0), ir.to(tl.int64) * 2 + (1 - nan).to(tl.int64), BIG)
    tl.atomic_min(facts, tl.reduce(key, 0, _min))
    ju = tl.arange(0, KP)
    im = live[:, None] & (ju[None, :] < K)
    at = ir[:, None].to(tl.int64) * K + ju[None, :]
    e = tl.load(ids + at, mask=im, other=0).to(tl.int64)
    tl.atomic_min(facts + 1, tl.reduce(tl.reduce(tl.where(im, e, BIG), 1, _min), 0, _min))
    tl.atomic_max(facts + 2, tl.reduce(tl.reduce(tl.where(im, e, -BIG), 1, _max), 0, _max))
    clamped = tl.minimum(tl.maximum(e, 0), experts - 1)
    tl.store(ids_out + at, clamped, mask=im)
    tl.atomic_add(counts + clamped, tl.full((BR, KP), 1, tl.int64), mask=im)
    wv = tl.load(w + at, mask=im, other=0.0)
    wbad = ((wv != wv) | (wv == float("inf")) | (wv == float("-inf"))).to(tl.int64)
    tl.atomic_max(facts + 3, tl.reduce(tl.reduce(wbad, 1, _max), 0, _max))


@triton.jit
def verdict_kernel(facts, status, held, experts, MERGE: tl.constexpr):
    """One program: the call's ``InputFault`` status (fault, row, value) from
    ``scan_kernel``'s facts, in ``routing.input_status``'s order (x, ids, weights); with
    MERGE also into ``held`` unless it holds a fault already (the first one is kept)."""
    key = tl.load(facts)
    lo = tl.load(facts + 1)
    hi = tl.load(facts + 2)
    wbad = tl.load(facts + 3)
    xbad = key < BIG
    idbad = (lo < 0) | (hi >= experts)
    fault = tl.where(xbad, 1 + key % 2, tl.where(idbad, 3, tl.where(wbad > 0, 4, 0)))
    row = tl.where(xbad, key // 2, 0)
    value = tl.where(~xbad & idbad, tl.where(lo < 0, lo, hi), 0)
    tl.store(status, fault)
    tl.store(status + 1, row)
    tl.store(status + 2, value)
    if MERGE:
        keep = tl.load(held) != 0
        tl.store(held, tl.where(keep, tl.load(held), fault))
        tl.store(held + 1, tl.where(keep, tl.load(held + 1), row))
        tl.store(held + 2, tl.where(keep, tl.load(held + 2), value))


# ---------------------------------------------------------------------------- a routing's slots


@triton.jit
def slot_count_kernel(ids, hist, row_token, tok, n, capacity, EP: tl.constexpr, B: tl.constexpr,
                      SB: tl.constexpr, ZB: tl.constexpr, INTO: tl.constexpr):
    """Program b: hist[b, e] = ids of block b (B flat ids) routed to expert e; it also
    zeroes its share of ``row_token`` (``capacity`` rows over the programs, ZB at a time),
    and (INTO) of its int32 copy ``tok``."""
    b = tl.program_id(0)
    e = tl.arange(0, EP)
    seen = tl.full((EP,), 0, tl.int64)
    for s0 in range(0, B, SB):
        i = b * B + s0 + tl.arange(0, SB)
        v = tl.load(ids + i, mask=i < n, other=-1)
        seen += tl.reduce((v[:, None] == e[None, :]).to(tl.int64), 0, _add)
    tl.store(hist + b * EP + e, seen)
    share = (capacity + tl.num_programs(0) - 1) // tl.num_programs(0)
    for z0 in range(0, share, ZB):
        r = b * share + z0 + tl.arange(0, ZB)
        mine = (r < capacity) & (z0 + tl.arange(0, ZB) < share)
        tl.store(row_token + r, tl.full((ZB,), 0, tl.int64), mask=mine)
        if INTO:
            tl.store(tok + r, tl.full((ZB,), 0, tl.int32), mask=mine)


@triton.jit
def slot_layout_kernel(hist, blocks, counts, first, slot_expert, slot_rows, experts, slots, g,
                       EP: tl.constexpr, HB: tl.constexpr, SS: tl.constexpr):
    """One program: hist's rows become each block's first rank per expert (an exclusive
    prefix over blocks, HB blocks at a time); then counts, each expert's first slot
    (the exclusive cumsum of ceil(count / g)), and each slot's expert (the first whose
    slots end past it, the last for unused slots) and live rows, SS slots at a time."""
    e = tl.arange(0, EP)
    run = tl.full((EP,), 0, tl.int64)
    for h0 in range(0, blocks, HB):
        hb = h0 + tl.arange(0, HB)
        at = hb[:, None] * EP + e[None, :]
        h = tl.load(hist + at, mask=hb[:, None] < blocks, other=0)
        inclusive = tl.associative_scan(h, 0, _add)
        tl.store(hist + at, inclusive - h + run[None, :], mask=hb[:, None] < blocks)
        run += tl.reduce(h, 0, _add)
    own = e < experts
    nslots = tl.where(own, (run + g - 1) // g, 0)
    last = tl.associative_scan(nslots, 0, _add)
    start = last - nslots
    tl.store(counts + e, run, mask=own)
    tl.store(first + e, start, mask=own)
    for s0 in range(0, slots, SS):
        s = s0 + tl.arange(0, SS)
        ended = own[None, :] & (last[None, :] <= s[:, None].to(tl.int64))
        se = tl.minimum(tl.reduce(ended.to(tl.int64), 1, _add), experts - 1)
        pick = (e[None, :] == se[:, None]).to(tl.int64)
        into = s.to(tl.int64) - tl.reduce(pick * start[None, :], 1, _add)  # slots into its expert's
        live = tl.reduce(pick * run[None, :], 1, _add) - into * g
        tl.store(slot_expert + s, se, mask=s < slots)
        tl.store(slot_rows + s, tl.minimum(tl.maximum(live, 0), g), mask=s < slots)


@triton.jit
def slot_rows_kernel(ids, hist, first, pos, row_token, pos32, tok, n, experts, g, K: tl.constexpr,
                     EP: tl.constexpr, B: tl.constexpr, SB: tl.constexpr, INTO: tl.constexpr):
    """Program b: each of its B flat ids' row in the slot layout, the stable sort's order
    (expert e's rows by flat index from row first[e] * g): its block's first rank for e,
    plus the earlier ids of the block routed to e; pos[i] = row, row_token[row] = i // K,
    and (INTO) the same in int32 into ``pos32`` and ``tok``."""
    b = tl.program_id(0)
    e = tl.arange(0, EP)
    base = tl.load(hist + b * EP + e)
    start = tl.load(first + e, mask=e < experts, other=0)
    for s0 in range(0, B, SB):
        i = b * B + s0 + tl.arange(0, SB)
        v = tl.load(ids + i, mask=i < n, other=-1)
        hot = (v[:, None] == e[None, :]).to(tl.int64)
        earlier = tl.associative_scan(hot, 0, _add) - hot
        row = tl.reduce(hot * (start[None, :] * g + base[None, :] + earlier), 1, _add)
        tl.store(pos + i, row, mask=i < n)
        tl.store(row_token + row, (i // K).to(tl.int64), mask=i < n)
        if INTO:
            tl.store(pos32 + i, row.to(tl.int32), mask=i < n)
            tl.store(tok + row, (i // K).to(tl.int32), mask=i < n)
        base += tl.reduce(hot, 0, _add)


@triton.jit
def slot_columns_kernel(tasks, at, task, base, per_row0, per_rows, per_read, slot, offset, cap, slot_row0,
                        expert, read, counts, first, slot_expert, slot_rows, entries, slot_tasks, block,
                        B: tl.constexpr):
    """Program p: B of a call's task-table entries (``slots.SlotColumns``), each
    ``base + per_row0 * row0 + per_rows * rows + per_read * read[expert]`` of its task,
    stored as int32 at its flat index ``at``.  A slot task (``task`` < ``slot_tasks``)
    has its static first row and ``clip(slot_rows[slot] - offset, 0, cap)`` rows of its
    slot's expert; an expert task j the rows of expert[j] from ``first * block``."""
    z = tl.program_id(0) * B + tl.arange(0, B)
    live = z < entries
    t = tl.load(task + z, mask=live, other=0)
    on_slot = live & (t < slot_tasks)
    ts = tl.where(on_slot, t, 0)
    e = tl.load(expert + tl.where(on_slot, 0, t - slot_tasks), mask=live & (t >= slot_tasks), other=0)
    s = tl.load(slot + ts, mask=on_slot, other=0)
    held = tl.load(slot_rows + s) - tl.load(offset + ts, mask=on_slot, other=0)
    held = tl.minimum(tl.maximum(held, 0), tl.load(cap + ts, mask=on_slot, other=0))
    rows = tl.where(on_slot, held, tl.load(counts + e))
    row0 = tl.where(on_slot, tl.load(slot_row0 + ts, mask=on_slot, other=0), tl.load(first + e) * block)
    reads = tl.load(read + tl.where(on_slot, tl.load(slot_expert + s), e))
    value = tl.load(base + z, mask=live, other=0) + tl.load(per_row0 + z, mask=live, other=0) * row0
    value += tl.load(per_rows + z, mask=live, other=0) * rows
    value += tl.load(per_read + z, mask=live, other=0) * reads
    tl.store(tasks + tl.load(at + z, mask=live, other=0), value.to(tl.int32), mask=live)
