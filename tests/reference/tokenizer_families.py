"""Tokenizers of each family's shape, built offline, and transformers' ids for them.

Two small vocabularies are trained here with HF `tokenizers` on the Python standard library's own
source: a SentencePiece-style BPE ("▁" for a space, byte-fallback `<0xNN>` pieces) and a
byte-level BPE. From them the reference job (tests/reference/hf_reference.py `tokenizers`) builds
each family's tokenizer with transformers' own class and saves it, as a checkpoint's would be:

- SentencePiece style: Llama 2 (`LlamaTokenizer`, legacy=False: Metaspace, prefix space on the
  first piece), Mistral/Mixtral (`LlamaTokenizer`, legacy=true in tokenizer_config.json as on
  the hub: a prefix space on every piece),
  Gemma (`GemmaTokenizer`), Phi-3 (its tokenizer.json as the hub has it: a SentencePiece
  normalizer, read as written since transformers treats phi3's tokenizer class as generic);
- byte-level: GPT-2 (`GPT2Tokenizer`), Llama 3 (a generic fast tokenizer with Llama 3's regex),
  Qwen (`Qwen2Tokenizer`: NFC, Qwen's regex);
- GGUF files written here with the `gguf` package for both of llama.cpp's kinds: "llama"
  (SentencePiece-style; the llama, gemma2 and phi3 architectures, which transformers builds
  differently) with scores and no merges, and "gpt2" (byte-level, Qwen's pre-tokenizer).

The job loads each with `AutoTokenizer.from_pretrained` (a GGUF with `gguf_file=`) and records
the ids and decoded text of TEXTS.
"""

import json
import sysconfig
from pathlib import Path

import pytest

from tests.reference.runner import run_reference

TEXTS = [
    "Hello world",
    " leading space",
    "  two spaces",
    "trailing ",
    "tabs\tand\nnew lines\n\n",
    "Numbers 12345 and 3.14159; x  1  22",
    "café naïve Øresund 東京 🙂 \x04 é",
    "<s>after special</s> and <|endoftext|> then <|im_end|>x and <eos>",
    "",
    " ",
    "def f(x):\n    return x  # comment",
    "<start_of_turn>user\nHi<end_of_turn>",
]
SENTENCEPIECE_SPECIALS = {
    "llama2": ["<unk>", "<s>", "</s>"],
    "mistral": ["<unk>", "<s>", "</s>"],
    "phi3": ["<unk>", "<s>", "</s>"],
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
}
BYTE_LEVEL_SPECIALS = {
    "gpt2": ["<|endoftext|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}
DIRS = [*SENTENCEPIECE_SPECIALS, *BYTE_LEVEL_SPECIALS]
GGUFS = {"gguf-llama": "llama", "gguf-gemma2": "gemma2", "gguf-phi3": "phi3", "gguf-qwen2": "qwen2"}


def corpus() -> list[str]:
    """Lines of a few standard-library modules: real text that every machine has."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for name in ("textwrap.py", "string.py", "calendar.py"):
        lines += [line for line in (lib / name).read_text().splitlines() if line.strip()]
    return [*lines, "café naïve Øresund 東京 12345", "x  1  22\t3.14159"]


def sentencepiece_vocab(specials: list[str]) -> tuple[list[str], list[float], list[list[str]]]:
    """(pieces in id order, scores, merges): `specials`, the 256 byte pieces, then the trained
    pieces in merge order, each scored by its rank (SentencePiece's BPE scores)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    trained = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *trained]
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(trained))]
    return pieces, scores, model["merges"]


def byte_level_vocab(specials: list[str]) -> tuple[dict[str, int], list[list[str]]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return model["vocab"], model["merges"]


def write_phi3(folder: Path, pieces: list[str], merges: list[list[str]]) -> None:
    """Phi-3's tokenizer.json shape (the hub's): SentencePiece normalizer, no pre-tokenizer,
    <|user|>/<|end|>/<|assistant|> special added tokens; config.json says model_type phi3."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {p: i for i, p in enumerate(pieces)}
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=[tuple(m) for m in merges], unk_token="<unk>",
                   fuse_unk=True, byte_fallback=True)
    )  # fmt: skip
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|end|>", "<|assistant|>"]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "<|end|>",
              "unk_token": "<unk>", "legacy": False}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"model_type": "phi3"}))


def write_gguf(path: Path, arch: str, vocab: dict) -> None:
    """A GGUF holding a tokenizer alone (no tensors) of llama.cpp's "llama" kind (pieces,
    scores, token types; no merges) or, for qwen2, of its "gpt2" kind (pieces, merges)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    if arch == "qwen2":
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(vocab["tokens"])
        writer.add_token_merges([" ".join(m) for m in vocab["merges"]])
        writer.add_token_types([3 if t in vocab["specials"] else 1 for t in vocab["tokens"]])
        writer.add_eos_token_id(vocab["tokens"].index("<|im_end|>"))
    else:
        specials = vocab["specials"]
        writer.add_tokenizer_model("llama")
        writer.add_token_list(vocab["tokens"])
        writer.add_token_scores(vocab["scores"])
        types = [2 if t == "<unk>" else 3 if t in specials else 6 if t.startswith("<0x") else 1
                 for t in vocab["tokens"]]  # fmt: skip
        writer.add_token_types(types)
        writer.add_unk_token_id(vocab["tokens"].index("<unk>"))
        writer.add_bos_token_id(vocab["tokens"].index("<bos>" if "<bos>" in specials else "<s>"))
        writer.add_eos_token_id(vocab["tokens"].index("<eos>" if "<eos>" in specials else "</s>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def tokenizer_reference(tmp_path_factory) -> dict:
    """Per name in DIRS and GGUFS: "path" (a directory, or a .gguf file), "ids" of TEXTS (no
    special tokens added) and "decoded" (transformers' decode of those ids)."""
    out = tmp_path_factory.getbasetemp() / "tokenizer-reference"
    if not (out / "tokenizers.json").is_file():
        vocabularies = {}
        for name, specials in SENTENCEPIECE_SPECIALS.items():
            pieces, scores, merges = sentencepiece_vocab(specials)
            vocabularies[name] = {"tokens": pieces, "scores": scores, "merges": merges,
                                  "specials": specials}  # fmt: skip
        for name, specials in BYTE_LEVEL_SPECIALS.items():
            vocab, merges = byte_level_vocab(specials)
            vocabularies[name] = {"vocab": vocab, "merges": merges, "specials": specials}
        write_phi3(out / "phi3", vocabularies["phi3"]["tokens"], vocabularies["phi3"]["merges"])
        ggufs = {}
        for name, arch in GGUFS.items():
            source = {"llama": "llama2", "gemma2": "gemma", "phi3": "phi3", "qwen2": "qwen2"}[arch]
            vocab = dict(vocabularies[source])
            if "vocab" in vocab:
                vocab["tokens"] = [t for t, _ in sorted(vocab["vocab"].items(), key=lambda i: i[1])]
            ggufs[name] = str(out / f"{name}.gguf")
            write_gguf(out / f"{name}.gguf", arch, vocab)
        job = {"vocabularies": vocabularies, "ggufs": ggufs, "texts": TEXTS}
        run_reference("tokenizers", job, out)
    return json.loads((out / "tokenizers.json").read_text())
