"""How captions become token ids, the way each text encoder's pipeline tokenises them.

A model folder's own tokenizer is called through :class:`PretrainedTokenizer`; a model built from
a config has no vocabulary, so :class:`HashTokenizer` stands in for it with the real
token-sequence shapes.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class TokenBatch:
    """Token ids of a batch of captions, padded to a common length."""

    input_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (B, L) int64, 1 = real token


class CaptionTokenizer(Protocol):
    """Turns captions into token ids the way a text encoder's pipeline does."""

    role: str
    max_length: int

    def __call__(self, captions: Sequence[str]) -> TokenBatch: ...


class HashTokenizer:
    """A deterministic stand-in for a real tokenizer, for models built from configs.

    A config has no vocabulary, and the step's cost does not depend on which ids the tokens
    carry, only on how many there are and how they are padded, so each word (or punctuation
    mark) becomes one id by a stable hash, framed and padded to ``max_length`` as the pipelines
    do: CLIP ``<bos> words <eos>`` padded with ``<eos>`` (the SD tokenizers' pad token); T5
    ``words </s>`` padded with 0; Qwen3 (Z-Image) the chat template's tokens around the words,
    padded to 512 (ZImagePipeline encodes the padded batch, then keeps the real tokens).
    """

    #: Chat-template tokens around a Z-Image prompt (enable_thinking=True adds no think block):
    #: "<|im_start|>", "user", "\n" before; "<|im_end|>", "\n", "<|im_start|>", "assistant",
    #: "\n" after.
    _QWEN_PREFIX = 3
    _QWEN_SUFFIX = 5

    def __init__(self, role: str, vocab_size: int, max_length: int) -> None:
        if vocab_size < 16:
            raise ValueError("vocab_size too small for a tokenizer")
        if max_length < self._QWEN_PREFIX + self._QWEN_SUFFIX + 1:
            raise ValueError("max_length too small for a tokenizer")
        self.role = role
        self.max_length = max_length
        self.vocab_size = vocab_size

    def _word_ids(self, caption: str) -> list[int]:
        words = _split_words(caption)
        # ids 3 .. vocab-3: clear of T5's pad/eos (0, 1) and CLIP's bos/eos (the last two ids).
        span = self.vocab_size - 5
        return [3 + zlib.crc32(w.lower().encode("utf-8")) % span for w in words]

    def _row(self, caption: str) -> tuple[list[int], int]:
        """The framed ids of one caption and the id its row is padded with."""
        words = self._word_ids(caption)
        length = self.max_length
        if self.role in ("clip_l", "clip_g"):
            eos = self.vocab_size - 1
            return [self.vocab_size - 2, *words[: length - 2], eos], eos
        if self.role == "t5":
            return [*words[: length - 1], 1], 0
        frame = self._QWEN_PREFIX + self._QWEN_SUFFIX
        return [4] * self._QWEN_PREFIX + words[: length - frame] + [5] * self._QWEN_SUFFIX, 0

    def __call__(self, captions: Sequence[str]) -> TokenBatch:
        ids = torch.zeros((len(captions), self.max_length), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, caption in enumerate(captions):
            row, pad = self._row(caption)
            ids[i] = pad
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        return TokenBatch(input_ids=ids, attention_mask=mask)


class PretrainedTokenizer:
    """A model folder's own tokenizer, called the way the family's pipeline calls it."""

    def __init__(self, role: str, tokenizer: Any, max_length: int) -> None:
        self.role = role
        self.max_length = max_length
        self._tokenizer = tokenizer

    def __call__(self, captions: Sequence[str]) -> TokenBatch:
        texts = list(captions)
        if self.role == "qwen3":
            texts = [
                self._tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    tokenize=False,
                    add_generation_prompt=True,
                    enable_thinking=True,
                )
                for text in texts
            ]
        encoded = self._tokenizer(
            texts,
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            return_tensors="pt",
        )
        return TokenBatch(
            input_ids=encoded["input_ids"].long(),
            attention_mask=encoded["attention_mask"].long(),
        )


def _split_words(caption: str) -> list[str]:
    words: list[str] = []
    current: list[str] = []
    for ch in caption:
        if ch.isalnum():
            current.append(ch)
            continue
        if current:
            words.append("".join(current))
            current = []
        if not ch.isspace():
            words.append(ch)
    if current:
        words.append("".join(current))
    return words


__all__ = ["CaptionTokenizer", "HashTokenizer", "PretrainedTokenizer", "TokenBatch"]
