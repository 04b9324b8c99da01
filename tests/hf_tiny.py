"""The tiny random-weight HF checkpoints of tests/data/hf_tiny, made servable: `LLM(path)` serves a model with its
tokenizer, and the fixtures are token-id only, so a served copy gets a word-level tokenizer of its ids."""

from __future__ import annotations

import json
import os

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_tiny")


def served_copy(name: str, directory) -> str:
    """`directory` holding fixture `name`'s config and weights (linked) and a tokenizer.json whose words "t0",
    "t1", ... are its token ids, split on whitespace; returns the directory as a string."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    for fn in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(DATA, name, fn), os.path.join(directory, fn))
    with open(os.path.join(DATA, name, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    return directory
