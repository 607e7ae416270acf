"""The sm_90 build of the persistent kernel, read as PTX without a GPU (compile only):
the GEMM's K loop is software-pipelined in big blocks, waits poll with acquire
semantics, every signal is a release atomic behind a ``bar.sync``, nothing reads
through the non-coherent path, and the launch is cooperative.  ``ptx_guards`` itself is
checked on PTX that breaks each rule."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from hpmoe.gpu.hopper import compile_hopper, main, ptx_guards  # noqa: E402

GOOD = """
    @%p1 ld.global.gpu.acquire.b32 %r1, [ %rd1 + 0 ];
    cp.async.cg.shared.global [ %r2 + 0 ], [ %rd2 + 0 ], 0x10, %r3;
    st.global.b32 [ %rd3 + 0 ], { %r4 };
    bar.sync 0;
    ld.global.b32 { %r5 }, [ %rd4 + 0 ];
    @%p2 atom.global.gpu.release.add.u32 %r6, [ %rd5 + 0 ], %r7;
"""


@pytest.fixture(scope="module")
def build():
    return compile_hopper(torch.bfloat16)


def test_the_gemm_is_pipelined_in_big_blocks_and_every_guard_holds(build):
    r = build.report
    print(r.line())
    assert r.violations == ()
    assert r.aligned and r.async_copy > 0 and r.stages >= 3 and min(r.bm, r.bn) >= 128 and r.bk >= 64
    assert r.smem_bytes >= (r.stages - 1) * (r.bm + r.bn) * r.bk * 2
    assert r.wgmma and r.cooperative and r.warps == 8
    assert (r.bm, r.bn, r.bk) == (128, 256, 64)  # KernelConfig.for_dtype: bf16's measured-faster block


def test_an_unaligned_program_gets_the_unpipelined_build_with_the_same_ordering():
    r = compile_hopper(torch.bfloat16, aligned=False).report
    assert r.violations == () and r.async_copy == 0


def test_the_guards_pass_good_ptx_and_name_each_broken_rule():
    assert ptx_guards(GOOD, 98304, 32768) == []
    cases = {
        "acquire": GOOD.replace("ld.global.gpu.acquire", "ld.global"),
        "non-coherent": GOOD + "    ld.global.nc.b32 %r9, [ %rd9 + 0 ];\n",
        "not bar.sync": GOOD.replace("    bar.sync 0;\n", ""),
        "release atomic": GOOD.replace("atom.global.gpu.release", "atom.global.gpu.relaxed"),
        "not pipelined": GOOD.replace("cp.async.cg.shared.global", "ld.global.v4.b32"),
    }
    for words, ptx in cases.items():
        broken = ptx_guards(ptx, 98304, 32768)
        assert len(broken) == 1 and words in broken[0], (words, broken)
    assert "two stages" in ptx_guards(GOOD, 32768, 32768)[0]
    unaligned = GOOD.replace("cp.async.cg", "ld.global")
    assert ptx_guards(unaligned, None, 32768) == []  # an unaligned build owes no cp.async


def test_the_command_reports_json_and_writes_the_ptx(tmp_path, capsys):
    import json

    assert main(["--json", "--ptx", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    fields = {"async_copy", "stages", "smem_bytes", "bm", "bn", "bk", "warps", "cooperative", "wgmma"}
    assert fields <= set(report)
    assert "wgmma.mma_async" in (tmp_path / "taskflow_kernel-bf16.ptx").read_text()
    assert main(["--json", "--bn", "128"]) == 0  # a flag overrides one field of the dtype's block
    narrow = json.loads(capsys.readouterr().out)
    assert (narrow["bn"], narrow["bm"], narrow["stages"]) == (128, 128, 3) and narrow["violations"] == []


def test_the_slot_sums_load_a_whole_unrolled_step_before_adding(build, tmp_path):
    """SUM (unpermute and its gradient) gathers SLOTS_IN_FLIGHT slots' rows per step; the
    step must be one basic block of the machine code, or the slots' loads wait
    one after another (a branch per slot did that: on an H200 the unpermute stayed at
    1.5 ms).  A slot's 64 x 128 bf16 chunk is 4 16-byte loads a thread at 8 warps."""
    import triton

    from hpmoe.gpu.runner import KernelConfig, device_module
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        pytest.skip("triton ships no nvdisasm here")
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(build.cubin)
    done = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True)
    sass = done.stdout
    per_block = [len(re.findall(r"\bLDG\.E\.128\b", b)) for b in re.split(r"\n\s*\.L_x_\d+:", sass)]
    c = KernelConfig.for_dtype(torch.bfloat16)
    step = int(device_module(False).SLOTS_IN_FLIGHT) * c.br * c.bc * 2 // 16 // (32 * c.num_warps)
    assert step == 16
    assert sum(n >= step for n in per_block) >= 1, sorted(per_block)[-6:]


def test_kernel_by_kernels_combine_has_no_fma_and_gathers_whole_vectors():
    """The combine and its gradient must keep ``weighted_sum``'s (and its gradient's
    rows') bits: a product rounded before its add (no ``fma.rn.f32``; built with FMA
    contraction they have them), each slot's gathered row read in 16-byte vectors."""
    from hpmoe.gpu.hopper import compile_combine

    for backward in (False, True):
        ptx = compile_combine(torch.bfloat16, slots=8, backward=backward)
        assert not re.search(r"\bfma\.rn\.f32", ptx), backward
        assert len(re.findall(r"\bld\.global[.\w]*\.v4", ptx)) >= 8, backward  # a vector per slot at least
        fused = compile_combine(torch.bfloat16, slots=8, fp_fusion=True, backward=backward)
        assert re.search(r"\bfma\.rn\.f32", fused), backward


def test_kernel_by_kernels_other_phases_and_the_input_scan_build_for_sm90():
    """The permute, the gated activation and its gradient (no FMA: torch's bits), the
    input scan and its verdict compile for sm_90 as ``gpu.phases`` launches them."""
    from hpmoe.gpu.hopper import compile_phase
    from hpmoe.gpu.phases import BLOCK_COLS, BLOCK_ROWS, SCAN_COLS, SCAN_ROWS

    bf16, blocks = torch.bfloat16, {"BR": BLOCK_ROWS, "BC": BLOCK_COLS}
    sizes = {"m": "i32", "f": "i32"}
    glu = compile_phase("glu_kernel", {"h": "*bf16", "a": "*bf16", **sizes, "ld_h": "i32", "ld_a": "i32"},
                        {"DT": bf16, **blocks, "EMULATE": False})
    grad = compile_phase("glu_backward_kernel", {"h": "*bf16", "da": "*bf16", "dh": "*bf16", **sizes,
                                                 "ld_h": "i32", "ld_da": "i32", "ld_dh": "i32"},
                         {"DT": bf16, **blocks, "EMULATE": False})
    args = {"h": "*bf16", "d": "*bf16", "w": "*fp32", "dh": "*bf16", "aw": "*bf16", "ds": "*fp32", **sizes,
            "ld_h": "i32", "ld_d": "i32", "ld_dh": "i32", "ld_aw": "i32"}
    router = compile_phase("glu_router_backward_kernel", args,
                           {"WEIGHTED": True, "DT": bf16, **blocks, "EMULATE": False})
    for ptx in (glu, grad, router):
        assert not re.search(r"\bfma\.rn\.f32", ptx)
        assert re.search(r"\bld\.global[.\w]*\.v", ptx)  # vector loads
    rows = {"x": "*bf16", "order": "*i64", "rows": "*bf16", "t": "i32", "n": "i32", "ld_x": "i32",
            "ld_rows": "i32"}
    permute = compile_phase("permute_kernel", rows, {"K": 8, **blocks})
    assert re.search(r"\bld\.global[.\w]*\.v4", permute)
    scan = compile_phase("scan_kernel", {"x": "*bf16", "ids": "*i64", "w": "*fp32", "ids_out": "*i64",
                                         "facts": "*i64", "counts": "*i64", "n": "i32", "hidden": "i32",
                                         "ld_x": "i32", "experts": "i32"},
                         {"K": 8, "KP": 8, "BR": SCAN_ROWS, "BC": SCAN_COLS}, rows=("n",))
    assert re.search(r"\batom\.global[.\w]*\.min\.s64", scan)
    assert re.search(r"\batom\.global[.\w]*\.add", scan)
    verdict = compile_phase("verdict_kernel", {"facts": "*i64", "status": "*i64", "held": "*i64",
                                               "experts": "i32"}, {"MERGE": True})
    assert "st.global" in verdict


def test_the_slot_resolution_builds_for_sm90_without_atomics():
    """The routing's three slot launches (``gpu.phases.resolve_slots``) and the task
    table's entries (``SlotColumns.apply``) compile for sm_90 as launched, for 256
    experts, and write their integers with plain stores: no atomic, so their results do
    not depend on the programs' order."""
    from hpmoe.gpu.hopper import compile_phase
    from hpmoe.gpu.phases import SLOT_BLOCKS, SLOT_ENTRIES, SLOT_IDS, SLOT_SLOTS, SLOT_SUB, SLOT_ZERO

    ids = {"EP": 256, "B": SLOT_IDS, "SB": SLOT_SUB}
    count = compile_phase("slot_count_kernel", {"ids": "*i64", "hist": "*i64", "row_token": "*i64",
                                                "tok": "*i32", "n": "i32", "capacity": "i32"},
                          {**ids, "ZB": SLOT_ZERO, "INTO": True}, rows=("n", "capacity"))
    layout = compile_phase("slot_layout_kernel", {
        "hist": "*i64", "blocks": "i32", "counts": "*i64", "first": "*i64", "slot_expert": "*i64",
        "slot_rows": "*i64", "experts": "i32", "slots": "i32", "g": "i32"},
        {"EP": 256, "HB": SLOT_BLOCKS, "SS": SLOT_SLOTS}, rows=("blocks", "experts", "slots"))
    rows = compile_phase("slot_rows_kernel", {"ids": "*i64", "hist": "*i64", "first": "*i64", "pos": "*i64",
                                              "row_token": "*i64", "pos32": "*i32", "tok": "*i32", "n": "i32",
                                              "experts": "i32", "g": "i32"},
                         {"K": 8, **ids, "INTO": True}, rows=("n", "experts"))
    pointers = ("at", "task", "base", "per_row0", "per_rows", "per_read", "slot", "offset", "cap",
                "slot_row0", "expert", "read", "counts", "first", "slot_expert", "slot_rows")
    columns = compile_phase("slot_columns_kernel", {"tasks": "*i32", **dict.fromkeys(pointers, "*i64"),
                                                    "entries": "i32", "slot_tasks": "i32", "block": "i32"},
                            {"B": SLOT_ENTRIES}, rows=("entries", "slot_tasks"))
    for ptx in (count, layout, rows, columns):
        assert "st.global" in ptx and not re.search(r"\b(atom|red)\.global", ptx)
