"""The static cost model (`python -m bench --static`) finds the loop and counts it right: on a
SASS snippet written by hand, and on hand-written kernels compiled for sm_90 (and for every arch of
bench/static/gpus.py: each read against its own GPU, an arch the compiler refuses named)."""

import subprocess
from pathlib import Path

import pytest
from sm90 import Launch, compile_for_hopper

from bench.static import HOPPER, ceilings, compile_env, compile_launches, cost, ctas_per_sm, table
from bench.static.gpus import ARCHS, GPUS
from bench.static.join import beside_measured
from bench.static.sass import access_bits, count_main_loop, loop_sizes, loops, parse_resources, parse_sass

HERE = Path(__file__).resolve().parent  # static_kernels.py, the hand-written kernels

SNIPPET = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                     /* 0x0 */
        /*0010*/              @!P0 BRA 0x100 ;                                /* 0x0 */
        /*0020*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;           /* 0x0 */
        /*0030*/                   MUFU.EX2 R5, R4 ;                          /* 0x0 */
        /*0040*/                   SHFL.BFLY PT, R6, R5, 0x1, 0x1f ;          /* 0x0 */
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;              /* 0x0 */
        /*0060*/                   STG.E.U16 desc[UR4][R2.64], R6 ;           /* 0x0 */
        /*0070*/                   NOP ;                                      /* 0x0 */
        /*0080*/               @P1 BRA 0x20 ;                                 /* 0x0 */
        /*0090*/                   EXIT ;                                     /* 0x0 */
        /*00a0*/                   BRA 0xa0;                                  /* 0x0 */
"""


def test_sass_snippet_counts():
    instructions = parse_sass(SNIPPET)
    assert len(instructions) == 10  # NOP left out
    assert loops(instructions) == [(0x20, 0x80)]  # the trap loop after EXIT is none
    counts = count_main_loop(instructions)
    assert counts.found_loop and counts.instructions == 6
    assert (counts.mufu, counts.barriers, counts.shuffles) == (1, 1, 1)
    assert (counts.widest_load, counts.widest_store, counts.load_bits, counts.store_bits) == (128, 16, 128, 16)
    assert [access_bits(op) for op in ("LDG.E", "LDG.E.64", "STG.E.U8.STRONG.GPU")] == [32, 64, 8]
    assert parse_resources(" REG:40 STACK:8 SHARED:16 LOCAL:4 CONSTANT[0]:600") == (40, 8, 16, 4)
    with pytest.raises(ValueError, match="REG"):
        parse_resources("garbage")


# nvdisasm's form of the snippet's loop: label targets, no encodings.
NVDISASM_SNIPPET = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0020*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   MUFU.EX2 R5, R4 ;
        /*0040*/               @P1 BRA `(.L_x_0) ;
.L_x_1:
        /*0050*/                   EXIT ;
"""


def test_nvdisasm_labels_become_the_addresses_they_mark():
    instructions = parse_sass(NVDISASM_SNIPPET)
    assert [i.operands.strip() for i in instructions if i.opcode == "BRA"] == ["0x0050", "0x0020"]
    assert loops(instructions) == [(0x20, 0x40)]
    assert count_main_loop(instructions).instructions == 3


# A longer loop of 64-bit loads (the backward's repeated-id matching) before the streamed loop of
# 128-bit loads and stores: the main loop is the streamed one.
TWO_LOOPS = """
        /*0000*/                   LDG.E.64 R2, desc[UR4][R8.64] ;            /* 0x0 */
        /*0010*/                   ISETP.NE.AND P0, PT, R2, R3, PT ;          /* 0x0 */
        /*0020*/                   FSEL R4, R5, RZ, !P0 ;                     /* 0x0 */
        /*0030*/                   SHFL.BFLY PT, R6, R4, 0x1, 0x1f ;          /* 0x0 */
        /*0040*/                   FADD R7, R7, R6 ;                          /* 0x0 */
        /*0050*/               @P1 BRA 0x0 ;                                  /* 0x0 */
        /*0060*/                   LDG.E.128 R12, desc[UR4][R10.64] ;         /* 0x0 */
        /*0070*/                   STG.E.128 desc[UR4][R14.64], R12 ;         /* 0x0 */
        /*0080*/               @P2 BRA 0x60 ;                                 /* 0x0 */
        /*0090*/                   EXIT ;                                     /* 0x0 */
"""


def test_the_main_loop_is_the_one_streaming_the_widest_accesses():
    instructions = parse_sass(TWO_LOOPS)
    assert loops(instructions) == [(0x0, 0x50), (0x60, 0x80)]
    counts = count_main_loop(instructions)
    assert (counts.instructions, counts.shuffles, counts.widest_load, counts.widest_store) == (3, 0, 128, 128)
    assert loop_sizes(instructions) == [6, 3]


def test_occupancy_from_registers_warps_and_shared_memory():
    assert ctas_per_sm(32, 8, 0) == 8  # 64 warps: 100%
    assert ctas_per_sm(40, 8, 0) == 6  # 40 regs x 256 threads: 6 CTAs, 75%
    assert ctas_per_sm(72, 8, 0) == 3
    assert ctas_per_sm(32, 8, 100 * 1024) == 2


def test_occupancy_and_ceilings_read_each_arch_against_its_own_gpu():
    assert ctas_per_sm(32, 8, 0, GPUS["sm_120"]) == 6  # 48 warps an SM on sm_120
    assert ctas_per_sm(32, 8, 100 * 1024, GPUS["sm_80"]) == 1  # 164 KB of shared memory on sm_80
    # Blackwell Ultra's ex2 unit is twice Blackwell's per SM and clock
    b200, b300 = (ceilings(2.0, 1.0, 4.0, GPUS[arch])["mufu_tbps"] for arch in ("sm_100", "sm_103"))
    assert b200 == pytest.approx(5.0e12 * 4 / 1e12, rel=0.01)  # 5 TeraExponentials/s, 4 bytes each
    assert b300 == pytest.approx(10.7e12 * 4 / 1e12, rel=0.01)
    for gpu in GPUS.values():
        assert gpu.copy_tbps <= gpu.memory_tbps and gpu.source


def test_the_copy_kernel_compiles_for_every_arch_and_an_unknown_one_is_named():
    """Each arch's row is its own compile (its own binder: no arch is served another's cubin); a
    target ptxas does not know gives an error record naming it, and the other archs still compile.
    An arch whose SASS the Triton's bundled disassembler cannot read (sm_103 on Triton 3.6) is named
    the same way, with the tool's message."""
    launch = Launch("copy", "static_kernels:launch_copy", {})
    records = compile_launches([launch], archs=(*ARCHS, "sm_990"), extra_path=[HERE])
    failed = {record["arch"]: record["error"] for record in records if "error" in record}
    assert "sm_990" in failed and all(record["label"] == "copy" for record in records)
    unreadable = {arch for arch, error in failed.items() if arch != "sm_990"}
    assert all("Cannot decode architecture" in failed[arch] for arch in unreadable), failed
    rows = [cost(record) for record in records if "error" not in record]
    assert [row["arch"] for row in rows] == [arch for arch in ARCHS if arch not in unreadable]
    assert unreadable <= {"sm_103"}
    for row in rows:
        assert row["local_bytes"] == 0 and row["widest_load_bits"] == row["widest_store_bits"] == 128
        assert row["ceiling_over_copy"] > 1 and row["gpu"] == GPUS[row["arch"]].name
    assert len({row["loop_instructions"] + str(row["registers"]) for row in rows}) > 1  # not one cubin five times


def test_ceiling_is_the_lower_of_issue_and_the_ex2_unit():
    lanes = 132 * 1.98e9
    # 2 instructions and 1 ex2 per 4-byte element: the ex2 unit (16 lanes/clock) runs out first
    bound = ceilings(2.0, 1.0, 4.0)
    assert bound["issue_tbps"] == pytest.approx(lanes * 128 / 2 * 4 / 1e12)
    assert bound["mufu_tbps"] == pytest.approx(lanes * 16 * 4 / 1e12)
    assert (bound["ceiling_tbps"], bound["bound"]) == (bound["mufu_tbps"], "ex2")
    # 16 instructions, no ex2: issue
    bound = ceilings(16.0, 0.0, 4.0)
    assert (bound["ceiling_tbps"], bound["bound"]) == (bound["issue_tbps"], "issue")


@pytest.fixture(scope="module")
def compiled():
    launches = [
        Launch("copy", "static_kernels:launch_copy", {}),
        Launch("copy, unrolled twice", "static_kernels:launch_copy_unrolled", {}),
        Launch("exp sum, reduced after the loop", "static_kernels:launch_exp_sum", {"reduce_in_loop": False}),
        Launch("exp sum, reduced in the loop", "static_kernels:launch_exp_sum", {"reduce_in_loop": True}),
    ]
    rows = compile_for_hopper(launches, extra_path=[HERE])
    print(table(rows))
    return {row["variant"]: row for row in rows}


def test_copy_kernel_is_two_128_bit_loads_and_stores_per_trip(compiled):
    copy = compiled["copy"]
    assert copy["loop"] and copy["local_bytes"] == 0
    assert copy["widest_load_bits"] == copy["widest_store_bits"] == 128
    assert copy["bytes_per_element"] == 8  # 4 read + 4 written
    assert copy["mufu_per_element"] == copy["barriers_per_element"] == copy["shuffles_per_element"] == 0
    assert copy["instructions_per_element"] < 2  # 2 loads, 2 stores, address and loop arithmetic
    assert copy["ceiling_tbps"] > 3 * HOPPER.copy_tbps


def test_elements_per_trip_come_from_the_launched_tile(compiled):
    """BLOCK = 1024 over 4 warps: 8 elements per thread per source trip, whatever the unrolling
    (ptxas unrolls the plain copy by itself); the copy unrolled twice in Triton covers an even
    number of source trips per SASS trip."""
    for row in (compiled["copy"], compiled["copy, unrolled twice"]):
        assert row["elements_per_thread"] == 8 * row["unrolled"]
        assert row["instructions_per_element"] < 4
    assert compiled["copy, unrolled twice"]["unrolled"] % 2 == 0
    assert compiled["copy"]["triton"]


def test_a_kernel_without_a_block_constexpr_is_refused():
    with pytest.raises(RuntimeError, match="no BLOCK"):
        compile_for_hopper([Launch("copy", "static_kernels:launch_copy_without_block", {})], extra_path=[HERE])


def test_reduction_placement_shows_in_barriers_and_shuffles(compiled):
    after = compiled["exp sum, reduced after the loop"]
    inside = compiled["exp sum, reduced in the loop"]
    for row in (after, inside):
        assert row["loop"] and row["mufu_per_element"] == 1.0  # one ex2 per element
        assert row["widest_load_bits"] == 128 and row["widest_store_bits"] == 0
    assert after["barriers_per_element"] == after["shuffles_per_element"] == 0
    assert inside["barriers_per_element"] > 0 and inside["shuffles_per_element"] > 0
    assert inside["instructions_per_element"] > after["instructions_per_element"]


def test_static_join_puts_the_ceiling_beside_the_measured_fused_rows():
    static = [
        dict(variant="token_stats forward bf16 J=1", op="token_stats", phase="fwd", dtype="bf16",
             ids_per_row="1", entropy="False", ceiling_tbps="9.31", instructions_per_element="7.2"),
        dict(variant="token_stats forward bf16 J=1 rows", op="token_stats", phase="fwd", dtype="bf16",
             ids_per_row="1", entropy="False", ceiling_tbps="1.0", instructions_per_element="99"),
    ]  # fmt: skip
    measured = dict(op="token_stats", phase="fwd", dtype="bf16", ids_per_row="1", entropy="False",
                    tokens="16384", vocab="151936", gbps="3900", copy_gbps="4300")  # fmt: skip
    lines = beside_measured(static, [dict(measured, subject="fused"), dict(measured, subject="eager")]).splitlines()
    assert len(lines) == 2
    assert lines[1].split() == ["fwd", "bf16", "T=16384", "V=151936", "J=1", "H=False", "3900", "4300", "9310", "7.2"]


def test_device_check_script_is_valid_bash():
    script = Path(__file__).resolve().parents[2] / ".ci" / "device-check"
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_compiling_reports_progress_on_stderr(capfd):
    compile_for_hopper([Launch("copy", "static_kernels:launch_copy", {})], extra_path=[HERE])
    captured = capfd.readouterr()
    assert "[1/1] compiled copy for sm_90; " in captured.err and captured.out == ""


def test_table_legend_gives_every_abbreviated_column_its_unit():
    row = dict(variant="v", arch="sm_90", kernel="k", triton="3.8.0", ceiling_over_copy=2.0, registers=32, local_bytes=0, occupancy=1.0,
               instructions_per_element=2.0, mufu_per_element=1.0, barriers_per_element=0.0,
               shuffles_per_element=0.0, widest_load_bits=128, widest_store_bits=0, ceiling_tbps=9.0, bound="issue")  # fmt: skip
    text = table([row])
    for column in ("local B", "ld bits", "st bits", "mufu/el", "ins/el"):
        assert column in text.splitlines()[0]
    assert "bits per thread" in text and "spill) bytes per thread" in text
    assert "not timings" in text and "sm_90: H200 SXM, 132 SMs" in text


def test_the_compiling_child_reads_tritons_own_tools(monkeypatch, tmp_path):
    """flashinfer.triton's import points TRITON_PTXAS_BLACKWELL_PATH at a CUDA 13 ptxas on PATH (it
    gave the draws' search kernel 8 bytes of stack on sm_100 where Triton's own has none): the
    child compiles without such overrides and without the interpreter, in the caller's cache."""
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", "/usr/local/bin/ptxas")
    monkeypatch.setenv("TRITON_LIBDEVICE_PATH", "/elsewhere/libdevice.10.bc")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    env = compile_env()
    assert not {"TRITON_PTXAS_BLACKWELL_PATH", "TRITON_LIBDEVICE_PATH", "TRITON_INTERPRET"} & set(env)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path)
