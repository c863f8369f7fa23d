"""The GPUs the static cost model reads each kernel against: one per architecture RL users train on.

Per-SM limits (warps, CTAs, shared memory, registers) are compute-capability facts from the CUDA
C++ Programming Guide's "Technical Specifications per Compute Capability" table; the ex2/lg2 unit
is 16 lanes per SM per clock from sm_80 to sm_120 (the Guide's arithmetic-instruction throughput
table) and 32 on sm_103 (Blackwell Ultra doubles it: 10.7 against Blackwell's 5 TeraExponentials/s,
NVIDIA's "Inside NVIDIA Blackwell Ultra" blog, 2025). SMs, clock and memory bandwidth are product
facts, each GPU's `source` naming where they come from. The copy bandwidth is the device-to-device
copy a GPU run measured where one did (H200, .ci/device-check); elsewhere it is assumed at the
H200's measured share of its specification (4.3 of 4.8 TB/s) and `copy_measured` says so.
"""

from typing import NamedTuple

ISSUE_PER_CLOCK = 4  # warp-instructions an SM issues per clock: 4 schedulers, sm_80 to sm_120
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256
SHARED_RESERVED_PER_CTA = 1024
MEASURED_COPY_SHARE = 4.3 / 4.8  # H200: measured device-to-device copy over the specification


class Gpu(NamedTuple):
    arch: str  # "sm_90": what --arch takes
    capability: int  # 90: Triton's GPUTarget arch
    name: str
    sms: int
    clock_hz: float  # boost clock
    ex2_lanes_per_clock: int  # of one SM's ex2/lg2 unit
    memory_tbps: float  # the specification's memory bandwidth
    copy_tbps: float  # what a device-to-device copy reaches: the line a ceiling is compared to
    copy_measured: bool
    max_warps_per_sm: int
    max_ctas_per_sm: int
    shared_per_sm: int  # bytes
    source: str

    @property
    def ex2_per_second(self) -> float:
        return self.sms * self.clock_hz * self.ex2_lanes_per_clock


def _assumed_copy(memory_tbps: float) -> float:
    return round(memory_tbps * MEASURED_COPY_SHARE, 2)


GPUS = {
    gpu.arch: gpu
    for gpu in (
        Gpu("sm_80", 80, "A100 SXM4 80GB", 108, 1.41e9, 16, 2.039, _assumed_copy(2.039), False, 64, 32, 164 * 1024,
            "NVIDIA A100 Tensor Core GPU Architecture whitepaper (108 SMs, 1410 MHz boost); A100 datasheet (2039 GB/s)"),
        Gpu("sm_90", 90, "H200 SXM", 132, 1.98e9, 16, 4.8, 4.3, True, 64, 32, 228 * 1024,
            "NVIDIA H100 Tensor Core GPU Architecture whitepaper (132 SMs, 1.98 GHz boost); H200 datasheet (4.8 TB/s); "
            "copy measured by .ci/device-check"),
        Gpu("sm_100", 100, "B200 (GB200)", 148, 2.11e9, 16, 8.0, _assumed_copy(8.0), False, 64, 32, 228 * 1024,
            "148 SMs; the clock at which 148 SMs x 16 lanes give the 5 TeraExponentials/s NVIDIA's Blackwell Ultra "
            "blog states for Blackwell; GB200 NVL72 datasheet (8 TB/s per GPU)"),
        Gpu("sm_103", 103, "B300 (GB300)", 160, 2.09e9, 32, 8.0, _assumed_copy(8.0), False, 64, 32, 228 * 1024,
            "NVIDIA's Inside NVIDIA Blackwell Ultra blog (160 SMs, 10.7 TeraExponentials/s, so the clock at which "
            "160 SMs x 32 lanes give it; 8 TB/s)"),
        Gpu("sm_120", 120, "GeForce RTX 5090", 170, 2.407e9, 16, 1.792, _assumed_copy(1.792), False, 48, 32, 100 * 1024,
            "NVIDIA RTX Blackwell GPU Architecture whitepaper (170 SMs, 2407 MHz boost, 1792 GB/s)"),
    )
}  # fmt: skip
ARCHS = tuple(GPUS)


def parse_archs(text: str) -> tuple:
    """"sm_80,sm_90" as a tuple of known archs; ValueError naming an unknown one and the choices."""
    archs = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [arch for arch in archs if arch not in GPUS]
    if unknown or not archs:
        raise ValueError(f"unknown arch {', '.join(unknown) or repr(text)}; choose from {','.join(ARCHS)}")
    return archs
