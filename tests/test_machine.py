"""The machine a figure came from, and the dtype a CPU run defaults to."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import torch

from hpmoe.cli.common import dtype_choice
from hpmoe.machine import default_cpu_dtype, machine, native_bf16


def test_the_machine_names_its_cpu_capability_cores_and_versions() -> None:
    m = machine()
    assert m.capability == torch.backends.cpu.get_cpu_capability() and m.torch == torch.__version__
    assert m.cores >= 1 and m.cpu
    assert m.capability in m.line() and f"{m.cores} cores" in m.line()
    assert set(m.to_json()) == {f.name for f in dataclasses.fields(m)}


def test_auto_is_bf16_only_where_the_cpu_computes_it_natively() -> None:
    m = machine()
    native, emulated = (dataclasses.replace(m, native_bf16=b) for b in (True, False))
    assert default_cpu_dtype(native)[0] is torch.bfloat16
    dtype, why = default_cpu_dtype(emulated)
    assert dtype is torch.float32 and m.capability in why and "no native bf16" in why


def test_dtype_choice_keeps_an_explicit_dtype_and_says_why_only_for_auto_on_this_cpu() -> None:
    assert dtype_choice("bf16", on_this_cpu=True) == ("bf16", None)
    assert dtype_choice("fp32", on_this_cpu=False) == ("fp32", None)
    assert dtype_choice("auto", on_this_cpu=False) == ("bf16", None)  # a modelled accelerator
    name, why = dtype_choice("auto", on_this_cpu=True)
    assert name == ("bf16" if machine().native_bf16 else "fp32") and why == default_cpu_dtype()[1]


def test_native_bf16_needs_the_instructions_and_on_x86_torchs_avx512_kernels() -> None:
    assert native_bf16({"avx512_bf16"}, "AVX512", x86=True)
    assert not native_bf16({"avx512_bf16"}, "AVX2", x86=True)  # ATEN_CPU_CAPABILITY=avx2
    assert not native_bf16({"avx2"}, "AVX2", x86=True)
    assert native_bf16({"bf16"}, "DEFAULT", x86=False)  # arm64 FEAT_BF16


def test_a_capped_capability_reads_as_no_native_bf16() -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    code = "from hpmoe.machine import machine; m = machine(); print(m.capability, m.native_bf16)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["AVX2", "False"]
