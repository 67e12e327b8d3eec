"""The `eqx-zoo` command line (a console script declared in pyproject.toml): one command with
the subcommands train, finetune, sample, chat, merge, export, plan and bench (cli/commands.py),
one vocabulary of flags and defaults (cli/flags.py and training/args.py), and any model artifact
anywhere (training/artifacts.py). `python -m cli` is the same; `python train.py` is `train`."""
