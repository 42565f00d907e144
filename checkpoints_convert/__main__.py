"""Command line: `python -m checkpoints_convert {hf,gguf} SRC DST [--dtype D] [--overwrite]`."""

from __future__ import annotations

import argparse

from checkpoints_convert import DTYPES, convert_gguf, convert_hf
from clusterkv_jax import CONVERT_INTERRUPTED
from clusterkv_jax.commands import exit_now, run_reporting_errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints_convert", description="Convert a checkpoint to the clusterkv format."
    )
    commands = parser.add_subparsers(dest="format", required=True)
    hf = commands.add_parser("hf", help="an HF directory with config.json and safetensors weights")
    hf.add_argument("src", help="HF checkpoint directory")
    hf.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    hf.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="parameter dtype (default bfloat16)")
    gguf = commands.add_parser("gguf", help="a llama.cpp GGUF file (llama or qwen2; dequantized)")
    gguf.add_argument("src", help="GGUF file")
    gguf.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    gguf.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype (default float32)")
    for command in (hf, gguf):
        command.add_argument(
            "--overwrite", action="store_true", help="replace an existing output directory (an earlier conversion)"
        )
        command.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = parser.parse_args(argv)

    convert = convert_hf if args.format == "hf" else convert_gguf

    def run() -> int:
        print(convert(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite))
        return 0

    return run_reporting_errors(run, debug=args.debug, prefix="", error_code=1,
                                interrupted=CONVERT_INTERRUPTED)


if __name__ == "__main__":
    exit_now(main())
