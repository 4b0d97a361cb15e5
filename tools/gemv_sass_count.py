"""Counts the SASS instructions per 16-byte weight load in the main loop of each GPTQ GEMV kernel (no GPU needed).

Compiles csrc/cuda/{gptq,gptq_wide,gptq_lean}.cu for one architecture with nvcc (-O3 -cubin), disassembles them
with cuobjdump (the CUDA toolkit's, or the `nvidia-cuda-cuobjdump` wheel's), and for each kernel instantiation
prints the loop (a backward branch) with the most `LDG.E.128` weight loads: its instruction count divided by
those loads, and its most common opcodes. The lean kernel's loop also holds a bounds-checked copy of the loads
that only the last batch runs; so that the figure is the steady-state path, gptq_lean.cu is compiled from a
copy whose check `r0 + kBatch <= rows` is replaced by `true` (the path every batch but the last takes).
The GGML GEMVs (csrc/cuda/ggml.cu: eight weights per loop step, ggml_q8.cu: 32) are compiled from copies whose
main loop is not unrolled (`#pragma unroll 1`), so one loop iteration is one step; their figure is instructions
per 32 weights and per 16 bytes of that type's blocks (M = 1 activation row; loop overhead included); ggml_q8.cu's
`Repacked<T>` instantiations (rows re-laid out at load, the same bytes) are labelled "<type> R".
Usage: `python tools/gemv_sass_count.py --nvcc /usr/local/cuda-13.0/bin/nvcc --cuobjdump PATH [--arch 90]`.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("gptq.cu", "gptq_wide.cu", "gptq_lean.cu", "ggml.cu", "ggml_q8.cu")
# GGML sources: the main loop's unroll pragma -> weights per (not unrolled) loop step.
GGML_LOOPS = {"ggml.cu": ("#pragma unroll 4\n    for (int f = lane", 8),
              "ggml_q8.cu": ("#pragma unroll 4\n    for (int st = lane", 32)}
# ggml type id -> (name, block bytes per 32 weights).
GGML_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 6: ("Q5_0", 22), 7: ("Q5_1", 24), 8: ("Q8_0", 34),
              12: ("Q4_K", 18), 13: ("Q5_K", 22), 14: ("Q6_K", 26.25)}
TAIL_CHECK = "if (r0 + kBatch <= rows) {"
Instruction = Tuple[int, str]


def functions(sass: str) -> Dict[str, List[Instruction]]:
    """Kernel name -> (address, instruction text) in order."""
    out: Dict[str, List[Instruction]] = {}
    current = None
    for line in sass.splitlines():
        head = re.search(r"Function : (\S+)", line)
        if head:
            current = head.group(1)
            out[current] = []
            continue
        ins = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if ins and current is not None:
            out[current].append((int(ins.group(1), 16), ins.group(2).strip()))
    return out


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def main_loop(body: List[Instruction]) -> Tuple[int, int, List[Tuple[str, int]]]:
    """(instructions, 16-byte global loads, top opcodes) of the loop with the most 16-byte loads."""
    index = {address: i for i, (address, _) in enumerate(body)}
    best = (0, 0, [])
    for i, (address, text) in enumerate(body):
        target = re.search(r"BRA\s+(?:`\()?.*?0x([0-9a-f]+)", text)
        if not target or int(target.group(1), 16) > address or int(target.group(1), 16) not in index:
            continue
        loop = body[index[int(target.group(1), 16)]:i + 1]
        loads = sum(1 for _, t in loop if "LDG" in t and ".128" in t)
        if loads > best[1]:
            best = (len(loop), loads, collections.Counter(opcode(t) for _, t in loop).most_common(8))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("--cuobjdump", default="cuobjdump")
    parser.add_argument("--arch", default="90")
    args = parser.parse_args()
    src = ROOT / "csrc"
    with tempfile.TemporaryDirectory() as tmp:
        for name in SOURCES:
            cubin = Path(tmp) / (name + ".cubin")
            source = src / "cuda" / name
            if name == "gptq_lean.cu":
                text = source.read_text()
                if TAIL_CHECK not in text:
                    print(f"{name}: `{TAIL_CHECK}` not found; update TAIL_CHECK", file=sys.stderr)
                    return 1
                source = Path(tmp) / name
                source.write_text(text.replace(TAIL_CHECK, "if (true) {"))
            if name in GGML_LOOPS:
                text = source.read_text()
                pragma = GGML_LOOPS[name][0]
                if pragma not in text:
                    print(f"{name}: `{pragma}` not found; update GGML_LOOPS", file=sys.stderr)
                    return 1
                source = Path(tmp) / name
                source.write_text(text.replace(pragma, pragma.replace("unroll 4", "unroll 1")))
            subprocess.run([args.nvcc, "-O3", "-std=c++17", f"-arch=sm_{args.arch}", "-cubin", "-I",
                            str(src / "include"), "-I", str(src / "cuda"), "-o", str(cubin), str(source)], check=True)
            sass = subprocess.run([args.cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                                  text=True).stdout
            for kernel, body in functions(sass).items():
                count, loads, top = main_loop(body)
                # ggml.cu: <type, M>; ggml_q8.cu: <Stored<type> or Repacked<type> (the re-laid-out rows), M>
                ggml_kernel = re.search(r"(ggml_gemv\w*kernel)I(?:N\w*?(Stored|Repacked)ILi(\d+)EEE|Li(\d+)E)Li(\d+)E",
                                        kernel)
                if loads and ggml_kernel:
                    if ggml_kernel.group(5) != "1":
                        continue
                    type_name, bytes32 = GGML_TYPES[int(ggml_kernel.group(3) or ggml_kernel.group(4))]
                    type_name += " R" if ggml_kernel.group(2) == "Repacked" else ""
                    per32 = count * 32 / GGML_LOOPS[name][1]
                    print(f"{name:<13} {ggml_kernel.group(1)}<{type_name}, M=1>  {per32:6.1f} instructions / 32 weights"
                          f" = {per32 * 16 / bytes32:6.1f} / 16 weight bytes  {', '.join(f'{o} {n}' for o, n in top)}")
                elif loads:
                    short = re.search(r"(gemv\w*kernel)I((?:Li\d+E)+)", kernel)
                    label = kernel
                    if short:
                        label = short.group(1) + "<" + ",".join(re.findall(r"Li(\d+)E", short.group(2))) + ">"
                    print(f"{name:<13} {label:<24} {count:5d} instructions / {loads:2d} "
                          f"loads = {count / loads:6.1f}  {', '.join(f'{o} {n}' for o, n in top)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
