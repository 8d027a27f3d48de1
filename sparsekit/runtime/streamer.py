"""``TokenStreamer``: generated text out as each token arrives, not word by word.

transformers' ``TextStreamer`` holds text back until a space: a reply without spaces (code, a long
number, Chinese without its punctuation, byte tokens) showed nothing until its end, and an interrupt
lost it. This one decodes the tokens since the last line break after each token and passes on all
the new text but what could still change: trailing whitespace (tokenizers clean up a space before
punctuation, ``"word ,"`` -> ``"word,"``) and a trailing U+FFFD (half of a character whose other bytes
come with the next token). ``end()`` passes on the rest.
"""
from __future__ import annotations

from transformers import TextStreamer

_PENDING = " \t\ufffd"


class TokenStreamer(TextStreamer):
    """A ``TextStreamer`` (same constructor, ``on_finalized_text``, ``end``) that streams per token."""

    def put(self, value) -> None:
        if len(value.shape) > 1:
            if value.shape[0] > 1:
                raise ValueError("TokenStreamer only supports batch size 1")
            value = value[0]
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.token_cache.extend(value.tolist())
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        if text.endswith("\n"):
            printable = text[self.print_len:]
            self.token_cache, self.print_len = [], 0
        else:
            printable = text[self.print_len: max(self.print_len, len(text.rstrip(_PENDING)))]
            self.print_len += len(printable)
        if printable:
            self.on_finalized_text(printable)
