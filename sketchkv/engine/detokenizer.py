"""Incremental detokenization: one sequence's output text, token by token, in constant time per token.

Decoding all output tokens every step costs O(length) per step (O(n^2) per request). As in vLLM and
TGI, each token decodes only a short window instead: the tokens from `prefix` (context, so
tokenizers that drop a leading space see the same neighbours they see in a full decode) to the end;
the text beyond what the first `read` window tokens decode to is new. It becomes part of `text` only
once it no longer ends in U+FFFD: byte-level BPE splits a multi-byte UTF-8 character across tokens,
and its first tokens decode to U+FFFD until the last byte arrives. Until then it is `pending`.

For byte-level tokenizers `text + pending == tokenizer.decode(all ids)` after every token, and
`text` is always a prefix of the final text: it only ever ends on a whole character.
"""
from sketchkv.models.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"  # what a decoder gives for bytes of a character not yet complete


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Skipped tokens decode to nothing: kept out of the window, so a run of them (an ignore_eos
        # generation repeating EOS) cannot grow it.
        self.skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self.window: list[int] = []  # the tokens from `prefix` on (older ones are in `text` for good)
        self.read = 0                # window[:read] is context already in `text`; window[read:] is new
        self.read_len = 0            # len(decode(window[:read]))
        self.text = ""               # the stable text: ends on a whole character
        self.pending = ""            # text of window[read:] while it ends in an incomplete character
        self.searched = 0            # len(text) when find_stop last ran

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Take the next token; return the text it made stable ("" while a character is incomplete)."""
        if token_id in self.skipped:
            return ""
        self.window.append(token_id)
        decoded = self._decode(self.window)
        if len(decoded) <= self.read_len or decoded.endswith(INCOMPLETE):
            self.pending = decoded[self.read_len:]
            return ""
        new = decoded[self.read_len:]
        self.text += new
        self.pending = ""
        del self.window[:self.read]  # the new tokens become the context of the next ones
        self.read = len(self.window)
        self.read_len = len(self._decode(self.window))
        return new

    def finish(self) -> str:
        """The sequence ended: an incomplete character stays U+FFFD, as a full decode gives it."""
        self.text += self.pending
        self.pending = ""
        return self.text

    def find_stop(self, stops: list[str]) -> str | None:
        """The first of `stops` present in the text that changed since the last call. An occurrence
        may start up to len(stop) - 1 characters before it (one that spans tokens is found); the
        pending tail is included, so a stop string is seen as soon as its last character is."""
        longest = max(len(s) for s in stops)
        tail = self.text[max(0, self.searched - longest + 1):] + self.pending
        self.searched = len(self.text)  # the pending tail may still change: searched again next time
        return next((s for s in stops if s in tail), None)
