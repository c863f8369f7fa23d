"""Reading Hopper SASS: the main loop of a kernel and what one trip through it issues.

Pure text functions over `nvdisasm -c` (or `cuobjdump -sass`) and `cuobjdump -res-usage` output, so the cost model's
counting can be tested on hand-written kernels without a GPU. A loop is the address range of a
backward branch; the main loop is the one whose global accesses are the widest, the longest of
those if several (inner loops inside it are counted once per trip, as written). The compiler may
unroll the main loop, so one trip through the SASS loop can cover several trips of the source
loop; the cost model tells them apart
by the widest loads (bench/static/__init__.py). Widths come from the opcode suffix (LDG.E.128 = 128 bits,
LDG.E = 32, LDG.E.U16 = 16).
"""

import re
from typing import NamedTuple, Optional

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")
_LABEL = re.compile(r"^(\.L_x_\d+):\s*\n\s*/\*([0-9a-f]{4,})\*/", re.MULTILINE)
_LABEL_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_WIDTHS = {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}


class Instruction(NamedTuple):
    address: int
    opcode: str  # with its suffixes, e.g. "LDG.E.128"
    operands: str


class Resources(NamedTuple):
    registers: int
    stack: int
    shared: int
    local: int


class LoopCounts(NamedTuple):
    """What one trip through the SASS main loop issues, per thread."""

    found_loop: bool  # False: no loop touches global memory; the counts cover the whole kernel
    instructions: int
    mufu: int  # MUFU.EX2 and MUFU.LG2
    barriers: int  # BAR.*
    shuffles: int  # SHFL.*
    local_accesses: int  # LDL / STL: spills
    load_bits: int  # global bits loaded by all LDG of a trip
    store_bits: int
    widest_load: int  # bits of the widest single LDG (0 when none)
    widest_loads: int  # how many LDG of that width: the streamed input's loads
    widest_store: int


def parse_sass(text: str) -> list:
    """Every instruction of a single-kernel SASS listing, in address order, NOPs left out. Branch
    targets are addresses: nvdisasm's labels (`.L_x_3:` before an instruction, `(.L_x_3) as a
    target) are replaced by the address of the instruction they mark."""
    addresses = {m.group(1): m.group(2) for m in _LABEL.finditer(text)}
    found = [
        Instruction(int(m.group(1), 16), m.group(2), _LABEL_TARGET.sub(lambda t: "0x" + addresses[t.group(1)], m.group(3)))
        for m in _INSTRUCTION.finditer(text)
    ]
    return [inst for inst in found if inst.opcode != "NOP"]


def parse_resources(text: str) -> Resources:
    match = _RESOURCES.search(text)
    if match is None:
        raise ValueError(f"no 'REG:.. STACK:.. SHARED:.. LOCAL:..' line in resource usage: {text[:200]!r}")
    return Resources(*(int(group) for group in match.groups()))


def loops(instructions) -> list:
    """(first, last) address of every backward branch's range; a branch to itself (the trap after
    EXIT) is no loop."""
    found = []
    for inst in instructions:
        if inst.opcode.startswith("BRA"):
            target = _TARGET.search(inst.operands)
            if target and int(target.group(1), 16) < inst.address:
                found.append((int(target.group(1), 16), inst.address))
    return found


def loop_sizes(instructions) -> list:
    """Instructions of one trip through each loop, in address order (nested loops counted once,
    as written): with a loop's trip count, what a kernel issues beside its main loop."""
    return [sum(first <= i.address <= last for i in instructions) for first, last in sorted(loops(instructions))]


def access_bits(opcode: str) -> int:
    """Bits moved by one LDG/STG (32 unless the opcode says otherwise)."""
    return max([_WIDTHS[part] for part in opcode.split(".")[1:] if part in _WIDTHS], default=32)


def main_loop(instructions) -> Optional[tuple]:
    """The loop streaming the kernel's widest global accesses (the longest such loop), or None.

    Width first: a kernel can hold a longer loop over narrower accesses beside its streamed loop
    (the token-statistics backward matches repeated ids in chunks before it streams the row)."""

    def widest_access(span):
        first, last = span
        accesses = [i for i in instructions if first <= i.address <= last and i.opcode.startswith(("LDG", "STG"))]
        return max((access_bits(i.opcode) for i in accesses), default=0)

    touching = [span for span in loops(instructions) if widest_access(span)]
    return max(touching, key=lambda span: (widest_access(span), span[1] - span[0]), default=None)


def count_main_loop(instructions) -> LoopCounts:
    span = main_loop(instructions)
    body = instructions if span is None else [i for i in instructions if span[0] <= i.address <= span[1]]
    loads = [access_bits(i.opcode) for i in body if i.opcode.startswith("LDG")]
    stores = [access_bits(i.opcode) for i in body if i.opcode.startswith("STG")]
    return LoopCounts(
        found_loop=span is not None,
        instructions=len(body),
        mufu=sum(i.opcode.startswith(("MUFU.EX2", "MUFU.LG2")) for i in body),
        barriers=sum(i.opcode.startswith("BAR") for i in body),
        shuffles=sum(i.opcode.startswith("SHFL") for i in body),
        local_accesses=sum(i.opcode.startswith(("LDL", "STL")) for i in body),
        load_bits=sum(loads),
        store_bits=sum(stores),
        widest_load=max(loads, default=0),
        widest_loads=loads.count(max(loads, default=0)),
        widest_store=max(stores, default=0),
    )
