"""Compile Triton IR (TTIR) files to PTX and cubin for NVIDIA targets, with no GPU. Imports `triton` only.

    PYTHON_WITH_TRITON pallas_kernels/ttir_to_ptx.py --arch 80,90 NAME=WARPS/STAGES=FILE.ttir ...

Run by `python -m pallas_kernels.check_lowering --ptx PYTHON_WITH_TRITON` in a separate interpreter (one that
has the PyPI `triton` package; the project environment does not need it, and two MLIR builds are better kept
out of one process). For each file and architecture it prints the shared memory, the number of tensor-core
instructions (mma.sync on sm80, wgmma on sm90) and ptxas's register and spill report. Exits 1 on any failure.
The TTIR comes from jaxlib's bundled Triton; a PyPI Triton of another version may not parse it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,90")
    parser.add_argument("kernels", nargs="+", help="NAME=WARPS/STAGES=PATH")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    warnings.filterwarnings("ignore")
    import triton
    from triton.backends.compiler import GPUTarget

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # The newest ptxas bundled: Triton's PTX ISA version may be newer than the default one accepts.
    ptxas = next(
        (p for p in (os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")) if os.path.exists(p)), None
    )
    print(f"triton {triton.__version__}, ptxas {ptxas}")
    ok = True
    for spec in args.kernels:
        name, launch, path = spec.rsplit("=", 2)  # the name may contain "="
        warps, stages = map(int, launch.split("/"))
        for cc in map(int, args.arch.split(",")):
            tag = f"{name:38s} sm{cc} warps={warps} stages={stages}"
            try:
                kernel = triton.compile(
                    path, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "num_stages": stages}
                )
                ptx = kernel.asm["ptx"]
                mma = len(re.findall(r"\bmma\.sync\S*", ptx)) + len(re.findall(r"\bwgmma\.mma_async\S*", ptx))
                report = ""
                if ptxas is not None:
                    with tempfile.TemporaryDirectory() as tmp:
                        src = os.path.join(tmp, "k.ptx")
                        with open(src, "w") as f:
                            f.write(ptx)
                        arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
                        out = subprocess.run(
                            [ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                            capture_output=True,
                            text=True,
                        )
                    if out.returncode != 0:
                        raise RuntimeError(f"ptxas failed: {out.stderr.strip()[:600]}")
                    regs = re.search(r"Used (\d+) registers", out.stderr)
                    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
                    report = f", {regs.group(1) if regs else '?'} registers"
                    if spills:
                        report += f", spills {spills.group(1)}/{spills.group(2)} B"
                print(f"{tag}: OK  shared {kernel.metadata.shared} B, tensor-core instrs {mma}{report}")
            except Exception as e:  # noqa: BLE001 - report every failure
                ok = False
                print(f"{tag}: FAILED {type(e).__name__}: {str(e)[:800]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
