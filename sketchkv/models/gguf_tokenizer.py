"""A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as a `tokenizers.Tokenizer`, built directly.

Byte-level BPE only (`tokenizer.ggml.model = gpt2`: GPT-2, SmolLM, Llama 3, Qwen): the vocabulary and
merges as the file lists them, control tokens (type 3) as special added tokens, user-defined ones
(type 4) as plain added tokens, and the pre-tokenizer split that `tokenizer.ggml.pre` names, with
llama.cpp's regexes (an unknown name falls back to GPT-2's split, as llama.cpp does). The BOS token
is prepended by the post-processor when `add_bos_token` says so, as a tokenizer.json would.
"""
import logging

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from sketchkv.errors import CheckpointError
from sketchkv.models.gguf import field, open_gguf

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> llama.cpp's regex splits before byte-level BPE ([]: GPT-2's regex alone, in ByteLevel)
SPLITS = {
    "default": [], "gpt2": [], "mpt": [], "olmo": [],
    "smollm": [r"\p{N}"], "starcoder": [r"\p{N}"], "refact": [r"\p{N}"], "command-r": [r"\p{N}"],
    "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "llama-bpe": [_LLAMA3], "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2], "stablelm2": [_QWEN2],
}
# the splits that replace GPT-2's regex entirely (the others run before it)
_REPLACE_GPT2 = {_LLAMA3, _QWEN2}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _pre_tokenizer(pre: str | None):
    splits = SPLITS.get(pre or "default")
    if splits is None:
        log.warning("GGUF pre-tokenizer %r is not known to sketchkv; splitting text as GPT-2 does", pre)
        splits = []
    own_regex = not any(s in _REPLACE_GPT2 for s in splits)
    steps = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=own_regex))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _token(tokens: list[str], i: int | None) -> str | None:
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


def gguf_tokenizer(path: str) -> tuple[Tokenizer, str | None, str | None, str | None]:
    """(tokenizer, chat template, bos token, eos token) from the file's metadata."""
    r = open_gguf(path)
    kind = field(r, "tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise CheckpointError(f"{path}: GGUF tokenizer {kind!r} is not supported (sketchkv builds byte-level BPE, "
                              "tokenizer.ggml.model = 'gpt2')")
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    # tokens outside the byte alphabet (rare, e.g. a literal space) are respelled byte by byte
    respelled = [t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")) for t in tokens]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(respelled)}, merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(field(r, "tokenizer.ggml.pre", None))
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel: adding it would grow the vocab.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and set(t) <= alphabet])
    bos, eos = (_token(tokens, field(r, f"tokenizer.ggml.{k}_token_id", None)) for k in ("bos", "eos"))
    if field(r, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok, field(r, "tokenizer.chat_template", None), bos, eos
