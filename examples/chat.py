"""Chat with an instruction-tuned model, offline: `eqx-zoo chat` (cli/chat.py), every flag.

python -m examples.chat                                   # SmolLM2-135M-Instruct (GGUF)
python -m examples.chat --model runs/finetune             # a fine-tuned run
python -m examples.chat --message "What is the capital of France?" --message "And of Italy?"
"""

from cli.chat import main
from shard.xla_flags import set_default_xla_flags

if __name__ == "__main__":
    set_default_xla_flags()
    main(prog="python -m examples.chat")
