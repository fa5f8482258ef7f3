#!/usr/bin/env python3
"""sass_hot.py: static instruction counts of the loops of bnb8's update kernels, from their SASS.

    cuobjdump --dump-sass BUILD/bench_gpu > k.sass
    python3 dev/bench/sass_hot.py k.sass [MODE ...]

For each update kernel at 2 rows, blocks pass (bnb8_update_kernel<2, AdamW, MODE, 0>), prints each
loop of 200 instructions or more: its instructions, the "hot" ones (every instruction but the
forward-branch skips that hold a subroutine call: the IEEE square root's and division's slow paths,
the exact fallbacks) and the hot ones per element at 8 elements per lane (a 2-row chunk), with the
count of some opcodes. A rare path without a call (the 4-bit lookup's search of a bucket with two
thresholds, the sum of squares when cfg.sum_squares is off: about 13 per element) counts as hot,
and so does every alternative of a loop that branches at run time (the general chunks), so the
numbers bound the executed count from above; they compare the straight fast loops best.

cuobjdump is on the GPU machines; on a machine without it, PyPI's nvidia-cuda-cuobjdump has one.
"""
import collections
import re
import sys

KERNEL = "_Z18bnb8_update_kernelILi2ELi0ELi{mode}ELi0EEvP16bnb8_step_headerPK15bnb8_gpu_tensorPKdPyPj"
LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
SHOWN = ["LDS", "LDG", "STG", "LDL", "STL", "MUFU", "SHFL", "CCTL"]


def instructions(path, name):
    """(address, predicate, opcode, operands) of function name's SASS."""
    out, inside = [], False
    for line in open(path):
        if "Function :" in line:
            inside = line.split("Function :")[1].strip() == name
        elif inside:
            m = LINE.match(line)
            if m:
                out.append((int(m.group(1), 16), m.group(2) or "", m.group(3), m.group(4)))
    return out


def target(operands):
    m = re.search(r"0x([0-9a-f]+)", operands)
    return int(m.group(1), 16) if m else None


def loops(code):
    """[start, end] of each backward branch."""
    return [(target(args), a) for a, _, op, args in code
            if op.startswith("BRA") and target(args) is not None and target(args) < a]


def hot_count(code, start, end):
    body = [x for x in code if start <= x[0] <= end]
    cold = set()
    for i, (a, pred, op, args) in enumerate(body):
        to = target(args) if op.startswith("BRA") and pred else None
        if to is None or to <= a:
            continue
        skipped = [k for k in range(i + 1, len(body)) if body[k][0] < to]
        if len(skipped) < 40 and any(body[k][2].startswith("CALL") for k in skipped):
            cold.update(skipped)
    ops = collections.Counter(body[k][2].split(".")[0] for k in range(len(body)) if k not in cold)
    return len(body), len(body) - len(cold), ops


def main():
    path, modes = sys.argv[1], sys.argv[2:] or ["0", "1", "2", "3", "4", "5", "6"]
    for mode in modes:
        code = instructions(path, KERNEL.format(mode=mode))
        if not code:
            print(f"mode {mode}: no such kernel in {path}")
            continue
        for start, end in loops(code):
            total, hot, ops = hot_count(code, start, end)
            if total < 200 or total > 5000:   # the chunk loops, not the grab loop around them all
                continue
            shown = " ".join(f"{k} {ops[k]}" for k in SHOWN)
            print(f"mode {mode} loop {start:x}-{end:x}: {total} instructions, {hot} hot, {hot / 8:.1f} per element; {shown}")


if __name__ == "__main__":
    main()
