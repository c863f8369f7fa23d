"""The token-statistics kernels compile to sm_90 cubins for every feature switch and dtype, and
the static cost model reads a main loop with 128-bit loads out of each."""

from sm90 import compile_for_hopper, shipped


def test_kernels_compile_for_hopper_with_a_streamed_main_loop():
    def corners(kwargs):  # every dtype with all switches off and all on
        return (kwargs["ids_per_row"], kwargs["entropy"], kwargs["rows"]) in [(1, False, False), (9, True, True)]

    rows = compile_for_hopper(shipped("token_stats", corners))
    assert len(rows) == 12
    for row in rows:
        assert row["loop"] and row["widest_load_bits"] == 128, row
