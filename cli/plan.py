"""`eqx-zoo plan`: training.plan's sharding plan, on paper, with its verdict for a device."""

from cli import commands


def parser(prog: str = "eqx-zoo plan"):
    from training.plan import parser as plan_parser

    p = plan_parser(prog)
    p.epilog = f"{p.epilog} {commands.epilog(prog)}."
    return p


def main(argv: list[str] | None = None, prog: str = "eqx-zoo plan"):
    from training.plan import main as plan_main

    return plan_main(argv, prog=prog)
