"""What a rank's collectives over its EP group offer, as a protocol: the executors,
AUTO's forecasts and the tuner talk to it, and ``runtime.collective.Collectives`` (each
call under the session's deadline) is the one implementation a distributed call hands
them, so nothing below the runtime imports it."""

from __future__ import annotations

from typing import Protocol

import torch


class Collectives(Protocol):
    """This rank (``rank`` of ``world``) and the collectives of its group; every one is
    called by every rank, ``what`` names it in a stall report."""

    rank: int
    world: int

    def all_gather(self, tensor: torch.Tensor, what: str, publish: bool = True) -> torch.Tensor:
        """[world, *tensor.shape]: every rank's ``tensor``."""

    def all_reduce(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """``tensor`` summed over every rank, in place; returns it."""

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
                   in_splits: list[int] | None, what: str) -> None:
        """``all_to_all_single`` of ``inp`` into ``out`` (rows per peer; None: equal)."""

    def broadcast_bytes(self, data: bytes | None, what: str) -> bytes:
        """Group rank 0's ``data`` on every rank (the others pass None)."""
