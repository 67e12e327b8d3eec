"""HF transformers' `generate` on the real SmolLM2-135M-Instruct weights (the GGUF, dequantized to
float32, greedy, KV cache): the peer for bench/engine.py. Runs under the reference venv:

    /work/main/.venv-ref/bin/python bench/hf_engine.py '<json job>'

The job {"gguf": path, "warmup_len", "lengths": [...], "new_tokens"} prints one JSON line: the
seconds of one generate call on each unseen prompt length, after one warm-up call on
`warmup_len`.
"""

import json
import os
import sys
import time

import torch
import transformers


def main() -> None:
    job = json.loads(sys.argv[1])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    folder, name = os.path.split(job["gguf"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()

    def generate(ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> float:
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, use_cache=True, pad_token_id=0,
        )  # fmt: skip
        assert out.shape[1] == ids.shape[1] + new_tokens
        return time.perf_counter() - start

    def ids(n: int) -> torch.Tensor:
        return torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(n))

    result = {}
    with torch.inference_mode():
        generate(ids(job["warmup_len"]), torch.ones(1, job["warmup_len"]), job["new_tokens"])
        result["latency_s"] = [
            generate(ids(n), torch.ones(1, n), job["new_tokens"]) for n in job["lengths"]
        ]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
