"""Reference numbers from HF transformers, run by the tests in the reference venv (.venv-ref:
Python 3.11, CPU torch, transformers, gguf, tokenizers; no JAX). One call does one job:

    python hf_reference.py tiny JOB.json     # tiny random models -> save_pretrained + logits,
                                             # and logits of dirs written by zoo.save_pretrained;
                                             # parameter counts of JOB["meta"] configs
    python hf_reference.py smollm2 JOB.json  # the SmolLM2 GGUF: logits, greedy text, token ids
    python hf_reference.py chat JOB.json     # apply_chat_template: rendered text and token ids
    python hf_reference.py peft JOB.json     # a tiny Llama + PEFT LoRA adapter: both saved,
                                             # logits; logits of adapters written by the zoo

JOB.json holds the inputs; results go to JOB["out"] as .npz / .json files.
"""

import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers

os.environ["HF_HUB_OFFLINE"] = "1"
torch.set_grad_enabled(False)


def logits(model, tokens: list[list[int]]) -> np.ndarray:
    return model(torch.tensor(tokens)).logits.float().numpy()


def randomize(model: torch.nn.Module) -> None:
    """HF init leaves norm scales at 1 and biases at 0, which would hide a mis-mapped norm or bias:
    perturb every 1-D parameter so each one matters."""
    for param in model.parameters():
        if param.ndim == 1:
            param.add_(0.1 * torch.randn_like(param))


def tiny(job: dict) -> None:
    build(job)
    reload(job)
    if job.get("meta"):
        count(job)


def count(job: dict) -> None:
    """Each of job["meta"] ({name: config.json dict}) built on torch's meta device (no memory,
    no init): its parameter count to out/meta.json."""
    counts = {}
    for name, hf in job["meta"].items():
        hf = {k: v for k, v in hf.items() if k not in ("architectures", "dtype")}
        config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        counts[name] = sum(p.numel() for p in model.parameters())
    with open(os.path.join(job["out"], "meta.json"), "w") as f:
        json.dump(counts, f)


def build(job: dict) -> None:
    """Each model: random init (seeded), save_pretrained to out/name, logits to out/name.npz.
    A spec with "fused": true then overwrites the weights with the model's own state dict, which
    in transformers >= 5 stacks MoE experts (`mlp.experts.gate_up_proj`) where save_pretrained
    writes them one by one."""
    for spec in job["models"]:
        torch.manual_seed(spec.get("seed", 0))
        config = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        randomize(model)
        path = os.path.join(job["out"], spec["name"])
        model.save_pretrained(path, max_shard_size=spec.get("max_shard_size", "5GB"))
        if spec.get("fused"):
            from safetensors.torch import save_file

            state = {name: w.contiguous() for name, w in model.state_dict().items()}
            save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        np.savez(path + ".npz", logits=logits(model, job["tokens"]))


def reload(job: dict) -> None:
    """Each directory written by zoo.save_pretrained: load in transformers, dump logits."""
    for name in job["dirs"]:
        path = os.path.join(job["out"], name)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        np.savez(path + ".npz", logits=logits(model.eval(), job["tokens"]))


# llama.cpp's "smollm" pre-tokenizer splits digits one by one before the GPT-2 regex, as the
# original SmolLM2 tokenizer.json does. transformers' GGUF conversion drops that step, so the
# reference puts it back (tokenizer_plain.json keeps transformers' conversion as it is).
SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


def smollm2(job: dict) -> None:
    """The GGUF through transformers' own reader (which dequantizes and un-permutes Q/K)."""
    from tokenizers import Tokenizer

    folder, name = os.path.split(job["gguf"])
    out = job["out"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf_tokenizer.save_pretrained(os.path.join(out, "plain"))
    with open(os.path.join(out, "plain", "tokenizer.json")) as f:
        tokenizer_json = json.load(f)
    os.makedirs(os.path.join(out, "smollm"), exist_ok=True)
    tokenizer_json["pre_tokenizer"] = SMOLLM_PRE_TOKENIZER
    with open(os.path.join(out, "smollm", "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json, f)
    plain = Tokenizer.from_file(os.path.join(out, "plain", "tokenizer.json"))
    smollm = Tokenizer.from_file(os.path.join(out, "smollm", "tokenizer.json"))
    ids = {
        "plain": [plain.encode(t, add_special_tokens=False).ids for t in job["texts"]],
        "smollm": [smollm.encode(t, add_special_tokens=False).ids for t in job["texts"]],
    }
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    prompt = smollm.encode(job["prompt"], add_special_tokens=False).ids
    greedy = model.generate(
        torch.tensor([prompt]), max_new_tokens=job["new_tokens"], do_sample=False
    )[0].tolist()
    with open(os.path.join(out, "smollm2.json"), "w") as f:
        json.dump({"ids": ids, "prompt": prompt, "greedy": greedy}, f)
    np.savez(os.path.join(out, "smollm2.npz"), logits=logits(model, [prompt]))


def chat(job: dict) -> None:
    """transformers' own `apply_chat_template` on each tokenizer directory: for each conversation,
    without and with the generation prompt, the rendered text and the ids, or the error it raises;
    and the ids of plain texts (`encode`, no special tokens added). The job's directories come
    with two made here from the SmolLM2 GGUF (transformers' GGUF reader, SmolLM2's own digit-
    splitting pre-tokenizer put back): "smollm2" as save_pretrained writes it (the template in
    chat_template.jinja), and "smollm2-unnamed", where <|im_start|> is neither an added token nor
    a named one, so that transformers encodes it as ordinary text."""
    from tokenizers import pre_tokenizers

    folder, name = os.path.split(job["gguf"])
    gguf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    smollm2_dir = os.path.join(job["out"], "smollm2")
    gguf_tokenizer.save_pretrained(smollm2_dir)
    unnamed_dir = os.path.join(job["out"], "smollm2-unnamed")
    shutil.copytree(smollm2_dir, unnamed_dir, dirs_exist_ok=True)
    edit_json(
        os.path.join(unnamed_dir, "tokenizer.json"),
        lambda spec: spec["added_tokens"].remove(
            next(t for t in spec["added_tokens"] if t["content"] == "<|im_start|>")
        ),
    )
    edit_json(
        os.path.join(unnamed_dir, "tokenizer_config.json"),
        lambda config: config.update(bos_token="<|endoftext|>"),
    )
    dirs = {"smollm2": smollm2_dir, "smollm2-unnamed": unnamed_dir, **job["dirs"]}
    results = {}
    for dir_name, path in dirs.items():
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        cases = {}
        for conversation_name, messages in job["conversations"].items():
            for prompt in (False, True):
                cases[f"{conversation_name}-{prompt}"] = render_chat(tokenizer, messages, prompt)
        texts = [tokenizer.encode(text, add_special_tokens=False) for text in job["texts"]]
        results[dir_name] = {"dir": path, "cases": cases, "texts": texts}
    with open(os.path.join(job["out"], "chat.json"), "w") as f:
        json.dump(results, f)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> dict:
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, return_dict=False
        )
    except Exception as error:  # the template's raise_exception: the test expects it too
        return {"error": f"{type(error).__name__}: {error}"}
    return {"text": text, "ids": ids}


def peft(job: dict) -> None:
    """With job["config"] (a Llama config) and no "dirs": a random Llama saved to out/base, a
    PEFT LoRA on job["targets"] (r=4, alpha=8) with random A and B saved to out/adapter, their
    logits to out/adapter.npz. With "dirs": each adapter directory loaded onto out/base by
    PeftModel.from_pretrained, logits to out/NAME.npz."""
    from peft import LoraConfig, PeftModel, get_peft_model

    out = job["out"]
    base_dir = os.path.join(out, "base")
    if job.get("dirs"):
        for name in job["dirs"]:
            base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            model = PeftModel.from_pretrained(base, os.path.join(out, name)).eval()
            np.savez(os.path.join(out, name + ".npz"), logits=logits(model, job["tokens"]))
        return
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **job["config"])
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    randomize(model)
    model.save_pretrained(base_dir)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=job["targets"])
    model = get_peft_model(model, lora).eval()
    for name, param in model.named_parameters():
        if "lora_" in name:  # B starts at zero, which would hide a mis-mapped adapter
            param.normal_(0.0, 0.2)
    model.save_pretrained(os.path.join(out, "adapter"))
    np.savez(os.path.join(out, "adapter.npz"), logits=logits(model, job["tokens"]))


def edit_json(path: str, edit) -> None:
    with open(path) as f:
        value = json.load(f)
    edit(value)
    with open(path, "w") as f:
        json.dump(value, f)


if __name__ == "__main__":
    command, job_file = sys.argv[1:]
    with open(job_file) as f:
        {"tiny": tiny, "smollm2": smollm2, "chat": chat, "peft": peft}[command](json.load(f))
