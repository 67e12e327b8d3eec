"""HF transformers' `generate` (KV cache, greedy, float32) on random-weight models: the peer for
bench/decode.py. Runs under the reference venv (torch + transformers, no JAX):

    /work/main/.venv-ref/bin/python bench/hf_decode.py '<json list of cases>'

Each case {"arch": "gpt2"|"llama", "config": {...}, "batch", "prompt_len", "new_tokens",
"repeats"} prints one JSON line with the median seconds of generate(1 new token) (prefill) and
generate(new_tokens) (prefill + decode).
"""

import json
import statistics
import sys
import time

import torch
import transformers


def build(arch: str, config: dict) -> torch.nn.Module:
    cls = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig}[arch]
    model_cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}
    return model_cls[arch](cls(**config)).to(torch.float32).eval()


def seconds(model, ids: torch.Tensor, new_tokens: int, repeats: int) -> float:
    def run():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
        assert out.shape[1] == ids.shape[1] + new_tokens
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for case in json.loads(sys.argv[1]):
        torch.manual_seed(0)
        model = build(case["arch"], case["config"])
        ids = torch.randint(1, case["config"]["vocab_size"], (case["batch"], case["prompt_len"]))
        with torch.inference_mode():
            t1 = seconds(model, ids, 1, case["repeats"])
            tn = seconds(model, ids, case["new_tokens"], case["repeats"])
        print(json.dumps({**case, "prefill_s": t1, "generate_s": tn}), flush=True)


if __name__ == "__main__":
    main()
