"""Reference numbers from HF transformers, run by the tests in the reference venv (.venv-ref:
Python 3.11, CPU torch, transformers, gguf, tokenizers; no JAX). One call does one job:

    python hf_reference.py tiny JOB.json     # tiny random models -> save_pretrained + logits,
                                             # and logits of dirs written by zoo.save_pretrained;
                                             # parameter counts of models built on torch's meta
                                             # device (JOB["count"], optional)
    python hf_reference.py families JOB.json # as tiny, plus logits of .gguf files (transformers'
                                             # own GGUF reader)
    python hf_reference.py smollm2 JOB.json  # the SmolLM2 GGUF: logits, greedy text, token ids
    python hf_reference.py chat JOB.json     # apply_chat_template: rendered text and token ids
    python hf_reference.py peft JOB.json     # a tiny Llama + PEFT LoRA adapter: both saved,
                                             # logits; logits of adapters written by the zoo
    python hf_reference.py tokenizers JOB.json  # each family's tokenizer built with its
                                             # transformers class and saved; ids of texts
    python hf_reference.py first_day JOB.json  # tiny Gemma 2/3, Mistral, Phi-3 checkpoints
                                             # with their tokenizers; then as export
    python hf_reference.py export JOB.json   # directories (e.g. written by eqx-zoo merge):
                                             # AutoTokenizer ids, AutoModelForCausalLM logits
                                             # and greedy continuation of a chat

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
    perturb every 1-D parameter so each one matters, and DeepSeek-V3's router balancing bias (a
    buffer, zero at init) so that it changes which experts are chosen."""
    for param in model.parameters():
        if param.ndim == 1:
            param.add_(0.1 * torch.randn_like(param))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.add_(0.1 * torch.randn_like(buffer))


def tiny(job: dict) -> None:
    build(job)
    reload(job)
    count(job)


def count(job: dict) -> None:
    """Each JOB["count"] spec built on torch's meta device (no memory): its parameters plus
    DeepSeek-V3's router bias buffers (weights of the checkpoint, a leaf of ours), in
    out/counts.json by name."""
    counts = {}
    for spec in job.get("count", []):
        config = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        n = sum(p.numel() for p in model.parameters())
        n += sum(b.numel() for name, b in model.named_buffers() if "e_score_correction" in name)
        counts[spec["name"]] = n
    with open(os.path.join(job["out"], "counts.json"), "w") as f:
        json.dump(counts, f)


def families(job: dict) -> None:
    tiny(job)
    for path in job["gguf"]:
        read_gguf(path, job["tokens"])


def read_gguf(path: str, tokens: list[list[int]]) -> None:
    """A .gguf file through transformers' own GGUF reader: logits to the path with .npz."""
    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    np.savez(path.removesuffix(".gguf") + ".npz", logits=logits(model.eval(), tokens))


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


def tokenizers(job: dict) -> None:
    """Each family's tokenizer built by its own transformers class from the job's vocabularies
    (tests/reference/tokenizer_families.py) and saved to out/NAME, and the job's GGUF files read
    by transformers' GGUF reader; then each loaded back with AutoTokenizer: ids of the job's
    texts (no special tokens added) and their decoded text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    out, vocabularies = job["out"], job["vocabularies"]

    def pieces(name):
        v = vocabularies[name]
        return {t: i for i, t in enumerate(v["tokens"])}, [tuple(m) for m in v["merges"]]

    def byte_level(name):
        v = vocabularies[name]
        return v["vocab"], [tuple(m) for m in v["merges"]]

    built = {
        "llama2": lambda: transformers.LlamaTokenizer(*pieces("llama2"), legacy=False),
        "mistral": lambda: transformers.LlamaTokenizer(*pieces("mistral"), legacy=True),
        "gemma": lambda: transformers.GemmaTokenizer(*pieces("gemma")),
        "gpt2": lambda: transformers.GPT2Tokenizer(*byte_level("gpt2")),
        "qwen2": lambda: transformers.Qwen2Tokenizer(*byte_level("qwen2")),
    }
    for name, make in built.items():
        tokenizer = make()
        extra = [t for t in vocabularies[name]["specials"] if t not in tokenizer.get_vocab()]
        tokenizer.add_special_tokens({"additional_special_tokens": extra})
        tokenizer.save_pretrained(os.path.join(out, name))
    # Mistral's hub files say legacy=true (a prefix space on every piece), which
    # save_pretrained leaves out: put it back, as the checkpoint has it.
    edit_json(
        os.path.join(out, "mistral", "tokenizer_config.json"), lambda c: c.update(legacy=True)
    )
    # Llama 3: a generic fast tokenizer (as its tokenizer_config.json says) with its regex.
    vocab, merges = byte_level("llama3")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in vocabularies["llama3"]["specials"]]
    )
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    ).save_pretrained(os.path.join(out, "llama3"))
    loaded = {name: transformers.AutoTokenizer.from_pretrained(os.path.join(out, name))
              for name in [*built, "llama3", "phi3"]}  # fmt: skip
    results = {name: {"path": os.path.join(out, name)} for name in loaded}
    for name, path in job["ggufs"].items():
        folder, file = os.path.split(path)
        loaded[name] = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
        results[name] = {"path": path}
    for name, tokenizer in loaded.items():
        ids = [tokenizer.encode(text, add_special_tokens=False) for text in job["texts"]]
        results[name] |= {
            "class": type(tokenizer).__name__,
            "ids": ids,
            "decoded": [tokenizer.decode(i) for i in ids],
        }
    with open(os.path.join(out, "tokenizers.json"), "w") as f:
        json.dump(results, f)


# Llama 3's pre-tokenizer regex (its tokenizer.json's Split).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def first_day(job: dict) -> None:
    """Tiny checkpoints as a user downloads them: for each of job["models"] (name, model_type,
    config fields, tokenizer kind), a random model and a tokenizer built by the family's own
    transformers class from job["vocab"] (a SentencePiece-style vocabulary: pieces, merges) with
    the family's chat template, both saved to out/NAME; then `export`'s measurements of them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(job["vocab"]["tokens"])}
    merges = [tuple(m) for m in job["vocab"]["merges"]]
    for spec in job["models"]:
        path = os.path.join(job["out"], spec["name"])
        turn = spec["turn_tokens"]
        if spec["tokenizer"] == "gemma":
            tokenizer = transformers.GemmaTokenizer(vocab=dict(vocab), merges=merges)
        elif spec["tokenizer"] == "llama":
            tokenizer = transformers.LlamaTokenizer(vocab=dict(vocab), merges=merges, legacy=True)
        else:  # phi3: its hub tokenizer.json, read as written
            backend = Tokenizer(
                models.BPE(vocab=dict(vocab), merges=merges, unk_token="<unk>", fuse_unk=True,
                           byte_fallback=True)
            )  # fmt: skip
            backend.normalizer = normalizers.Sequence(
                [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
            )
            backend.decoder = decoders.Sequence(
                [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                 decoders.Strip(" ", 1, 0)]
            )  # fmt: skip
            backend.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in ["<unk>", "<s>", "</s>"]]
            )
            tokenizer = transformers.PreTrainedTokenizerFast(
                tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
            )
        tokenizer.add_special_tokens({"additional_special_tokens": turn})
        tokenizer.chat_template = spec["template"]
        if "eos_token" in spec:
            tokenizer.eos_token = spec["eos_token"]
        tokenizer.save_pretrained(path)
        torch.manual_seed(0)
        ids = {
            f"{name}_token_id": getattr(tokenizer, f"{name}_token_id")
            for name in ("bos", "eos", "pad")
        }
        config = transformers.AutoConfig.for_model(
            spec["model_type"], vocab_size=len(tokenizer), **ids, **spec["config"]
        )
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        randomize(model)
        model.save_pretrained(path)
    export({**job, "dirs": [os.path.join(job["out"], m["name"]) for m in job["models"]]})


def export(job: dict) -> None:
    """Each directory of job["dirs"] (a checkpoint, or one eqx-zoo merge/export wrote) loaded
    by AutoTokenizer and AutoModelForCausalLM: the ids of job["texts"], the chat ids of
    job["conversation"] (with the generation prompt), the logits on them and the greedy
    continuation of job["new_tokens"] tokens (stopping where generation_config says), in
    out/export.json by directory."""
    results = {}
    for path in job["dirs"]:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        chat = tokenizer.apply_chat_template(
            job["conversation"], add_generation_prompt=True, return_dict=False
        )
        out = model.generate(
            torch.tensor([chat]), max_new_tokens=job["new_tokens"], do_sample=False,
            attention_mask=torch.ones(1, len(chat), dtype=torch.long),
        )  # fmt: skip
        results[path] = {
            "texts": [tokenizer.encode(t, add_special_tokens=False) for t in job["texts"]],
            "chat": chat,
            "logits": logits(model, [chat])[0, -1].tolist(),
            "greedy": out[0, len(chat) :].tolist(),
            "eos": model.generation_config.eos_token_id,
        }
    with open(os.path.join(job["out"], "export.json"), "w") as f:
        json.dump(results, f)


def edit_json(path: str, edit) -> None:
    with open(path) as f:
        value = json.load(f)
    edit(value)
    with open(path, "w") as f:
        json.dump(value, f)


JOBS = {
    "tiny": tiny,
    "families": families,
    "smollm2": smollm2,
    "chat": chat,
    "peft": peft,
    "tokenizers": tokenizers,
    "first_day": first_day,
    "export": export,
}

if __name__ == "__main__":
    command, job_file = sys.argv[1:]
    with open(job_file) as f:
        JOBS[command](json.load(f))
