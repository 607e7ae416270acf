"""The torch peers the default path is timed against: they compute the layer (checked
against the dense reference), and the comparison runs them on the same inputs."""

from __future__ import annotations

import pytest
import torch

from hpmoe import refs
from hpmoe.bench.torch_peers import (
    Peer,
    alternating_ms,
    default_against_grouped,
    device_inputs,
    eager_forward,
    grouped_forward,
    grouped_mm_unavailable,
)
from hpmoe.spec import preset

CPU = torch.device("cpu")


@pytest.mark.parametrize("forward", [eager_forward, grouped_forward])
def test_each_peer_computes_the_dense_reference(forward) -> None:
    spec = preset("tiny", torch.float32)
    x, w, routing, _ = device_inputs(spec, 48, CPU)
    out = forward(x, w.w13, w.w2, w.shared_w13, w.shared_w2, routing.weights, Peer.of(routing, spec), spec)
    torch.testing.assert_close(out, refs.dense_moe(x, w, routing))


def test_the_default_and_grouped_mm_run_the_same_inputs_forward_and_backward() -> None:
    t = default_against_grouped(preset("tiny", torch.float32), 64, CPU, reps=2, warmup=1)
    assert t.max_abs_diff < 1e-5
    assert t.default_ms > 0 and t.grouped_ms > 0 and t.speedup == t.grouped_ms / t.default_ms


def test_alternating_calls_take_turns_and_bad_counts_are_named() -> None:
    seen: list[str] = []
    ms = alternating_ms({"a": lambda: seen.append("a"), "b": lambda: seen.append("b")}, reps=2, warmup=1,
                        device=CPU)
    assert seen == ["a", "b", "b", "a", "a", "b"] and set(ms) == {"a", "b"}
    with pytest.raises(ValueError, match="reps=0 must be >= 1"):
        alternating_ms({}, reps=0, warmup=0, device=CPU)


def test_a_torch_without_grouped_mm_is_named(monkeypatch) -> None:
    assert grouped_mm_unavailable(CPU, torch.float32) is None

    def missing(*args: object, **kwargs: object) -> None:
        raise NotImplementedError("no kernel for this device\nmore")

    monkeypatch.setattr(torch, "_grouped_mm", missing)
    assert grouped_mm_unavailable(CPU, torch.float32) == ("torch._grouped_mm does not run here: "
                                                          "NotImplementedError: no kernel for this device")
