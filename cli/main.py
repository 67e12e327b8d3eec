"""`eqx-zoo COMMAND [flags]`: the dispatcher. `eqx-zoo --help` lists the commands with what
each does and how long it takes; `eqx-zoo COMMAND --help` shows a command's flags with their
defaults. A bad setting exits with status 2 and `eqx-zoo COMMAND: error: ...` (argparse's
convention); a failure the command reports (a missing file, a model that cannot do what was asked)
with status 1 and the same prefix, never a traceback."""

import sys
import textwrap

from cli.commands import BY_NAME, COMMANDS


def usage(width: int = 100) -> str:
    name_width = max(len(c.name) for c in COMMANDS)
    indent = " " * (name_width + 4)
    lines = [
        "usage: eqx-zoo COMMAND [flags]     (eqx-zoo COMMAND --help: its flags and defaults)",
        "",
        "A typed Equinox model zoo for transformer LLMs: train, fine-tune, sample, chat, export.",
        "",
        "commands:",
    ]
    for c in COMMANDS:
        text = f"{c.summary} ({c.duration})"
        lines += textwrap.wrap(
            text, width, initial_indent=f"  {c.name:{name_width}s}  ", subsequent_indent=indent
        )
    models = (
        "A model is named the same way everywhere (--model): a zoo preset, an HF directory, a "
        ".gguf file or a train.py run directory, plus --adapter for a PEFT adapter."
    )
    lines += ["", *textwrap.wrap(models, width)]
    return "\n".join(lines)


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return None
    name, rest = argv[0], argv[1:]
    if name not in BY_NAME:
        sys.exit(f"eqx-zoo: error: unknown command {name!r}; commands: {', '.join(BY_NAME)}")
    from shard.compile_cache import use_compile_cache
    from shard.xla_flags import set_default_xla_flags

    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    use_compile_cache()  # a second start reads its programs back instead of compiling them
    from layers.kernels.cpu import KernelNotBuilt  # says how to build it

    try:
        return BY_NAME[name].run(rest)
    except (ValueError, FloatingPointError, OSError, KernelNotBuilt) as error:
        sys.exit(f"eqx-zoo {name}: error: {error}")
