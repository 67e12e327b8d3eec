"""Sample a continuation of a prompt, streamed: `eqx-zoo sample` (cli/sample.py), every flag.

python -m examples.sample --model path/to/hf-dir-or.gguf --prompt "Once upon a time"
python -m examples.sample --model runs/default --prompt "def main("      # a train.py run
python -m examples.sample --model tiny-llama --prompt 1,2,3              # ids, no tokenizer
"""

from cli.sample import main
from shard.xla_flags import set_default_xla_flags

if __name__ == "__main__":
    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    main(prog="python -m examples.sample")
