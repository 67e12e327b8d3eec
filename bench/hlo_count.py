"""Kernels a compiled program launches, counted from its optimized HLO text
(`jax.jit(f).lower(...).compile().as_text()`), without running it.

After XLA's optimisation each remaining instruction of a program-level computation is one kernel
launch on a GPU (a fusion, a cuBLAS/cuDNN/Triton custom call, a copy, ...), except bookkeeping
(parameters, tuples, bitcasts) and control flow, whose bodies are counted instead. Fusion bodies
and reducers are parts of one kernel and are not counted. XLA's command buffers (CUDA graphs)
change how kernels are launched, not how many run: the count is the same with them on or off.
"""

import re

NOT_KERNELS = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "call",
        "while",
        "conditional",
        "after-all",
        "add-dependency",
        "opt-barrier",
        "partition-id",
        "replica-id",
        "domain",
        "async-start",
        "async-update",
        "async-done",
        "copy-start",
        "copy-done",
    }
)
_HEADER = re.compile(r"^(ENTRY )?%?([^\s(]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?\S+ = (?:\(.*?\)|\S+) ([\w-]+)\((.*)$")
# Computations an op runs as programs of their own (followed), by opcode; everything else an op
# names (a fusion's `calls=`, a reduce's `to_apply=`) runs inside that op's kernel.
_FOLLOWED = {
    "call": ("to_apply",),
    "while": ("condition", "body"),
    "conditional": ("true_computation", "false_computation", "branch_computations"),
    "async-start": ("calls",),
}


def _computations(hlo: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """{name: [(opcode, rest of the line)]} of every computation, and the entry's name."""
    computations: dict[str, list[tuple[str, str]]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (instruction := _INSTRUCTION.match(line)):
            current.append((instruction.group(1), instruction.group(2)))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text: pass compiled.as_text()")
    return computations, entry


def _called(opcode: str, rest: str) -> list[str]:
    names = []
    for attribute in _FOLLOWED.get(opcode, ()):
        if attribute == "branch_computations":
            found = re.search(r"branch_computations=\{([^}]*)\}", rest)
            names += re.findall(r"%?([\w.\-]+)", found.group(1)) if found else []
        else:
            names += re.findall(rf"\b{attribute}=%?([\w.\-]+)", rest)
    return names


def _count(computations, name: str) -> int:
    total = 0
    for opcode, rest in computations[name]:
        total += opcode not in NOT_KERNELS
        total += sum(_count(computations, called) for called in _called(opcode, rest))
    return total


def kernel_count(hlo: str, *, loop_body: bool = False) -> int:
    """Kernels launched by one run of the program, each loop body counted once; with
    `loop_body=True`, by one iteration of the entry's only while loop (its condition and body:
    e.g. one token of a decode loop). No such single loop is a ValueError."""
    computations, entry = _computations(hlo)
    if not loop_body:
        return _count(computations, entry)
    loops = [rest for opcode, rest in computations[entry] if opcode == "while"]
    if len(loops) != 1:
        raise ValueError(
            f"loop_body=True needs exactly one while loop in ENTRY, found {len(loops)}"
        )
    return sum(_count(computations, name) for name in _called("while", loops[0]))
