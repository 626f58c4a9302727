"""Tokenizer from tokenizer.json (+ tokenizer_config.json for special tokens and the chat template), or from
a GGUF file's metadata (gguf_tokenizer.py)."""
import json
import os

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from sketchkv.errors import CheckpointError, RequestError
from sketchkv.models.gguf import is_gguf


def _token_str(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    def __init__(self, path: str):
        if is_gguf(path):
            from sketchkv.models.gguf_tokenizer import gguf_tokenizer
            self.tok, self.chat_template, self.bos_token, self.eos_token = gguf_tokenizer(path)
        else:
            self.tok, self.chat_template, self.bos_token, self.eos_token = _from_dir(path)
        self.eos_token_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self.tok.get_vocab_size()
        self.special_ids = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt. add_special_tokens: what the tokenizer's post-processor adds (the BOS of a
        Llama tokenizer.json, of a GGUF with add_bos_token), as transformers and vLLM do for a raw prompt; off for a
        rendered chat template, which writes its own special tokens."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise RequestError("this model's tokenizer has no chat template; use the completions API")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _from_dir(path: str) -> tuple[HFTokenizer, str | None, str | None, str | None]:
    """(tokenizer, chat template, bos token, eos token) of a Hugging Face model directory."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing (sketchkv needs a fast-tokenizer tokenizer.json)")
    try:
        tok = HFTokenizer.from_file(file)
    except Exception as e:
        raise CheckpointError(f"{file}: cannot load ({e})") from None
    cfg = {}
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            cfg = json.load(f)
    template = cfg.get("chat_template")
    tmpl_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(tmpl_file):
        with open(tmpl_file) as f:
            template = f.read()
    return tok, template, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))


def _raise(msg: str):
    raise RequestError(f"chat template: {msg}")
