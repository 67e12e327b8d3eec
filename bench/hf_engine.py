"""HF transformers' `generate` (float32, greedy, KV cache) on the same checkpoint as ours: the peer
for bench/engine.py. Runs under the reference venv:

    /work/main/.venv-ref/bin/python bench/hf_engine.py '<json job>'

The job {"path": an HF directory or a .gguf file, "calls": [...]} runs each call {"prompts":
[[ids], ...], "new_tokens", "warmup": bool, "repeats"} (left-padded rows, an attention mask) and
prints one JSON line: per call, the median seconds of `repeats` generate calls (after one
untimed call when "warmup") and the new tokens of each row.
"""

import json
import os
import statistics
import sys
import time

import torch
import transformers


def load(path: str) -> torch.nn.Module:
    if path.endswith(".gguf"):
        folder, name = os.path.split(path)
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        ).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def main() -> None:
    job = json.loads(sys.argv[1])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = load(job["path"])

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, use_cache=True, pad_token_id=0,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        return seconds, out[:, width:].tolist()

    results = []
    with torch.inference_mode():
        for call in job["calls"]:
            if call.get("warmup"):
                generate(call["prompts"], call["new_tokens"])
            runs = [generate(call["prompts"], call["new_tokens"]) for _ in range(call["repeats"])]
            results.append(
                {"seconds": statistics.median(s for s, _ in runs), "tokens": runs[-1][1]}
            )
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
