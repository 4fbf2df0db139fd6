"""The tokenizer: whitespace-split words, ids in a fixed vocabulary.

Exact rule: a token is a maximal run of characters that are not Unicode White_Space (Rust's
char::is_whitespace: U+0009-U+000D, U+0020, U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028,
U+2029, U+202F, U+205F, U+3000). Token ids: index in VOCAB, 0 ([UNK]) for any other word.
Hugging Face's WordLevel model with the WhitespaceSplit pre-tokenizer counts the same:
`python3 -m sim --write-tokenizer DIR` writes that tokenizer.json (and a tokenizer_config.json).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# The vocabulary is [UNK] and the words the simulated model writes (reply.py).
UNK = "[UNK]"
OUTPUT_WORDS = (
    "the", "model", "runs", "on", "a", "ring", "of", "sparks", "and", "each", "node",
    "holds", "one", "shard", "while", "tokens", "stream", "through", "its", "decode",
    "step", "with", "cache", "memory", "for", "every", "layer", "in", "order", "as",
    "experts", "route", "their", "weights", "over", "links", "to", "next", "rank",
)  # fmt: skip
THINK_WORDS = ("let", "me", "think", "about", "this", "question", "carefully", "first")
VOCAB = (UNK, *dict.fromkeys(OUTPUT_WORDS + THINK_WORDS))
VOCAB_IDS = {word: i for i, word in enumerate(VOCAB)}

WHITESPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
SPLIT = re.compile(f"[{WHITESPACE}]+")


def tokenize(text: str) -> list[str]:
    """The tokens of a text: runs of non-whitespace characters."""
    return [t for t in SPLIT.split(text) if t]


def token_ids(words: list[str]) -> list[int]:
    """Vocabulary ids of tokens ([UNK] = 0 for words outside VOCAB)."""
    return [VOCAB_IDS.get(w, 0) for w in words]


def tokenizer_json() -> dict:
    """A Hugging Face tokenizer.json (WordLevel + WhitespaceSplit) that counts as the server."""
    # No added tokens: a literal "[UNK]" in a text is a word like any other, as here.
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": VOCAB_IDS, "unk_token": UNK},
    }


def write_tokenizer(folder: Path, max_model_len: int) -> None:
    """tokenizer.json and tokenizer_config.json for peer harnesses (no model hub here)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(), indent=1) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
        "model_max_length": max_model_len,
        # Contents joined by newlines: the same token count as the server's chat prompt.
        "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
