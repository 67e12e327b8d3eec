"""`eqx-zoo bench NAME`: bench/__main__.py's benchmarks (predicted vs measured tables)."""

import argparse

from cli import commands


def parser(prog: str = "eqx-zoo bench") -> argparse.ArgumentParser:
    from bench.__main__ import parser as bench_parser

    p = bench_parser(prog)
    p.epilog = commands.epilog(prog)
    return p


def main(argv: list[str] | None = None, prog: str = "eqx-zoo bench"):
    from bench.__main__ import main as bench_main

    return bench_main(argv, prog=prog)
