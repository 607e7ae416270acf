"""The agreement that opens every region: each rank's fingerprint of what it is
about to run, and its verdict on its own input, exchanged in one small all-gather.

A rank whose input is bad does not raise at once: it joins the all-gather with a
flag and its reason (first 256 bytes), so every rank learns of it in the same
collective and raises ``InputRejected`` ("rank 1 rejected its input: x has NaN at
row 17").  Otherwise any field on which ranks differ (dtype, tokens, hidden size,
experts, tiles, region kind, the digests of the tuning history and of the expert
placement, and the weight checksum when it is on) ends every rank
with ``MismatchError`` naming the field and each rank's value.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from ..regions.base import RegionKind
from ..spec import TileSpec
from ..weights import ExpertWeights
from .collective import Collectives

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
UNCHECKED = -1  # weights_crc when the checksum is off
REASON_BYTES = 256  # of a rejection's reason, carried in the exchange itself


class MismatchError(ValueError):
    """Ranks disagree on what the region is (every rank raises the same message)."""


class InputRejected(ValueError):
    """A rank rejected its input (every rank raises the same message)."""


@dataclass(frozen=True)
class Fingerprint:
    """What one rank is about to run.  weights_crc: CRC-32 of every weight tensor's
    bytes, or ``UNCHECKED``."""

    region: int
    dtype: int
    tokens: int
    hidden: int
    experts: int
    top_k: int
    tile_rows: int
    gemm_rows: int
    gemm_cols: int
    weights_crc: int = UNCHECKED
    tuning: int = 0  # digest of the layer's tuning history (``schedule.tuner.Tuner.digest``)
    placement: int = 0  # digest of the layer's expert placement (``Placement.digest``; 0: none)
    backward: int = 0  # 1: the forward records a backward, a collective every rank must then run

    @staticmethod
    def of(kind: RegionKind, weights: ExpertWeights, tokens: int, tiles: TileSpec,
           checksum: bool, tuning: int = 0, placement: int = 0, backward: bool = False) -> Fingerprint:
        s = weights.spec
        return Fingerprint(region=_KINDS.index(kind) + 1, dtype=dtype_code(s.dtype), tokens=tokens,
                           hidden=s.hidden, experts=s.experts, top_k=s.top_k, tile_rows=tiles.rows,
                           gemm_rows=tiles.gemm_rows, gemm_cols=tiles.gemm_cols,
                           weights_crc=weights_checksum(weights) if checksum else UNCHECKED, tuning=tuning,
                           placement=placement, backward=int(backward))


_FIELDS = fields(Fingerprint)
_KINDS = list(RegionKind)


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def _show(name: str, value: int) -> str:
    if name == "dtype":
        return str(_DTYPES[value - 1]).removeprefix("torch.") if 0 < value <= len(_DTYPES) else "other"
    if name == "region" and 0 < value <= len(_KINDS):
        return _KINDS[value - 1].value
    if name == "backward":
        return "records a backward" if value else "records none (no_grad, or nothing requires a gradient)"
    if name == "weights_crc":
        return "unchecked" if value == UNCHECKED else f"{value:08x}"
    return str(value)


def weights_checksum(weights: ExpertWeights) -> int:
    """CRC-32 of the bytes of every tensor of ``weights`` (router, experts, shared)."""
    crc = 0
    for f in fields(weights):
        t = getattr(weights, f.name)
        if isinstance(t, torch.Tensor):
            crc = zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy(), crc)
    return crc


def mismatch(prints: list[Fingerprint]) -> str | None:
    """``field: rank 0 bfloat16, rank 1 float32`` for the first field ranks differ on."""
    for f in fields(Fingerprint):
        values = [getattr(p, f.name) for p in prints]
        if len(set(values)) > 1:
            each = ", ".join(f"rank {r} {_show(f.name, v)}" for r, v in enumerate(values))
            return f"{f.name} differs: {each}"
    return None


def agree(coll: Collectives, what: str, mine: Fingerprint, error: BaseException | None,
          figures: Sequence[int] = ()) -> np.ndarray:
    """Exchange fingerprints and verdicts (collective, under the deadline); raise
    ``InputRejected`` or ``MismatchError`` on every rank when any rank objects.
    ``figures``: numbers ranks may differ on (their token counts, their times of the
    last call), returned as [world, len(figures)] int64."""
    n, m = len(_FIELDS), len(figures)
    row = np.zeros(1 + m + n + REASON_BYTES // 8, np.int64)
    row[0], row[1:1 + m], row[1 + m:1 + m + n] = error is not None, figures, [getattr(mine, f.name)
                                                                             for f in _FIELDS]
    if error is not None:
        reason = str(error).encode()[:REASON_BYTES]
        row[1 + m + n:].view(np.uint8)[:len(reason)] = np.frombuffer(reason, np.uint8)
    table = coll.all_gather(torch.from_numpy(row), what).numpy()
    if table[:, 0].any():
        reasons = [f"rank {r} rejected its input: {_reason(table[r, 1 + m + n:])}"
                   for r in np.flatnonzero(table[:, 0])]
        raise InputRejected("; ".join(reasons)) from error
    prints = table[:, 1 + m:1 + m + n]
    if (prints != prints[0]).any():
        diff = mismatch([Fingerprint(*prints[r].tolist()) for r in range(coll.world)])
        raise MismatchError(f"ranks disagree on '{what}': {diff}")
    return table[:, 1:1 + m]


def _reason(tail: np.ndarray) -> str:
    return tail.tobytes().rstrip(b"\0").decode(errors="replace")
