"""SentencePiece-style BPE vocabularies (Llama 2, Mistral, Mixtral, Gemma, Phi-3: pieces written
with "▁" for a space, byte fallback to `<0xNN>` tokens) as HF `tokenizers` objects, built from a
GGUF file's `tokenizer.ggml.*` metadata (llama.cpp's "llama" tokenizer model) the way
transformers builds them from the same metadata:

- the pipeline of transformers' `LlamaTokenizer` (no normalizer, `Metaspace("▁", "first")`, a
  decoder that turns "▁" back into spaces, bytes back into text and drops the first space);
- Gemma: spaces become "▁" by a normalizer, no prefix space, and pieces of spaces stored as real
  spaces are respelled; merges follow the file's token order;
- Phi-3: Llama's vocabulary with the prefix space added by a normalizer (`Prepend` + `Replace`);
- the merges from the file, or recovered from the vocabulary ranked by the pieces' scores
  (transformers' `generate_merges`).
"""

SPACE = "\u2581"  # "▁", SentencePiece's stand-in for a space


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a vocabulary implies: every split of a piece into two pieces of the
    vocabulary, best piece score first (ties: shorter left part first), as transformers'
    `generate_merges` orders them."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _pairs(merges: list) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def sentencepiece_bpe(
    tokens: list[str],
    scores: list[float] | None,
    merges: list | None,
    *,
    unk: str | None,
    family: str,
):
    """A `tokenizers.Tokenizer` for a SentencePiece-style BPE vocabulary (`tokens` in id order,
    their `scores`, the file's `merges` if it has them); `family` "llama" (Llama 2, Mistral,
    Mixtral), "gemma" or "phi3" picks the pipeline (module docstring)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    if family == "gemma":
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: i for i, token in enumerate(tokens)}
    if merges:
        pairs = _pairs(merges)
    elif family == "gemma":  # Gemma's scores do not follow its merges; its token order does
        pairs = generate_merges(vocab, {t: -float(i) for i, t in enumerate(tokens)})
    else:
        if scores is None:
            raise ValueError("a SentencePiece vocabulary without merges needs its token scores")
        pairs = generate_merges(vocab, dict(zip(tokens, scores, strict=True)))
    model = models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if family == "gemma":
        tokenizer.normalizer = normalizers.Replace(" ", SPACE)
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif family == "phi3":
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            SPACE, prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer
