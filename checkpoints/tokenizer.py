"""Tokenizer: byte-level BPE through HF `tokenizers`, chat templates through jinja2, streaming detokenisation.

Built either from GGUF metadata (vocabulary, merges, token types, pre-tokenizer name) or from HF files
(tokenizer.json + tokenizer_config.json). `save()` writes the HF files, so an Orbax checkpoint carries its
tokenizer without the GGUF.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from checkpoints.gemma_tokenizer import GEMMA_ARCHITECTURES, gemma_hf_tokenizer

_CONTROL = 3  # llama.cpp token type for control (special) tokens.
_USER_DEFINED = 4

# GGUF `tokenizer.ggml.pre` names whose pre-tokenisation splits every digit on its own (SmolLM2, StarCoder).
_INDIVIDUAL_DIGITS = ("smollm", "starcoder", "refact")


@dataclasses.dataclass
class Tokenizer:
    """Text <-> token ids, plus the model's chat template.

    Attributes:
      hf: the underlying `tokenizers.Tokenizer`.
      bos_token_id: beginning-of-sequence id or None.
      eos_token_ids: ids that end generation.
      add_bos: prepend BOS when encoding a prompt (SmolLM2: no).
      chat_template: jinja2 source of the chat template, or None.
    """

    hf: HFTokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: str | None = None

    # Construction ------------------------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta, eos_token_ids: Sequence[int]) -> Tokenizer:
        """Rebuilds a GGUF `gpt2`-model (byte-level BPE) tokenizer with its special tokens, or a Gemma
        SentencePiece one (checkpoints/gemma_tokenizer.py). The chat template is the file's own: a GGUF without one
        (Gemma 3 270M, a base model) gets none, so chat is refused rather than rendered with an instruct template."""
        if meta.tokenizer_model == "llama" and meta.architecture in GEMMA_ARCHITECTURES:
            return cls(
                hf=gemma_hf_tokenizer(meta.tokens, meta.token_types),
                bos_token_id=None if meta.bos_token_id is None else int(meta.bos_token_id),
                eos_token_ids=tuple(eos_token_ids),
                add_bos=meta.add_bos_token,
                chat_template=meta.chat_template,
            )
        if meta.tokenizer_model != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {meta.tokenizer_model!r} (byte-level BPE 'gpt2', or 'llama' for Gemma)"
            )
        vocab = {tok: i for i, tok in enumerate(meta.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.merges]
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if meta.pre_tokenizer in _INDIVIDUAL_DIGITS:
            hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            hf.pre_tokenizer = byte_level
        hf.decoder = decoders.ByteLevel()
        types = meta.token_types or [1] * len(meta.tokens)
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(meta.tokens, types)
            if ty in (_CONTROL, _USER_DEFINED)
        ]
        hf.add_special_tokens(special)
        bos = None if meta.bos_token_id is None else int(meta.bos_token_id)
        return cls(
            hf=hf,
            bos_token_id=bos,
            eos_token_ids=tuple(eos_token_ids),
            add_bos=meta.add_bos_token,
            chat_template=meta.chat_template,
        )

    @classmethod
    def from_hf_files(cls, tokenizer_json_path: str, tokenizer_config_json_path: str | None = None) -> Tokenizer:
        """Loads tokenizer.json (and, if given, tokenizer_config.json for template, BOS/EOS and add_bos).

        The chat template is tokenizer_config.json's `chat_template`, else the chat_template.jinja file that newer
        transformers save beside it; None when the checkpoint has neither (a base model: chat is refused).
        """
        if not os.path.isfile(tokenizer_json_path):
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_json_path}")
        hf = HFTokenizer.from_file(tokenizer_json_path)
        cfg: dict[str, Any] = {}
        if tokenizer_config_json_path and os.path.isfile(tokenizer_config_json_path):
            with open(tokenizer_config_json_path) as f:
                cfg = json.load(f)

        def token_id(value) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return None if value is None else hf.token_to_id(value)

        eos = cfg.get("eos_token_ids")
        if eos is None:
            eos_one = token_id(cfg.get("eos_token"))
            eos = [] if eos_one is None else [eos_one]
        template = cfg.get("chat_template")
        if isinstance(template, list):  # HF allows named templates; take the default one.
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        jinja = os.path.join(os.path.dirname(tokenizer_json_path), "chat_template.jinja")
        if not template and os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        return cls(
            hf=hf,
            bos_token_id=token_id(cfg.get("bos_token")),
            eos_token_ids=tuple(eos),
            add_bos=bool(cfg.get("add_bos_token", False)),
            chat_template=template,
        )

    @classmethod
    def load(cls, directory: str) -> Tokenizer:
        return cls.from_hf_files(
            os.path.join(directory, "tokenizer.json"), os.path.join(directory, "tokenizer_config.json")
        )

    def save(self, directory: str) -> None:
        """Writes tokenizer.json and tokenizer_config.json (HF-compatible) into `directory`."""
        os.makedirs(directory, exist_ok=True)
        self.hf.save(os.path.join(directory, "tokenizer.json"))
        cfg = {
            "bos_token": None if self.bos_token_id is None else self.hf.id_to_token(self.bos_token_id),
            "eos_token": self.hf.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None,
            "eos_token_ids": list(self.eos_token_ids),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=2)

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint carries a chat template (chat without one is refused: a base model)."""
        return bool(self.chat_template)

    # Encoding ----------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token strings in the text map to their ids. (encode_batch releases the
        GIL while it runs, encode does not: a long text tokenised on a server's worker thread must not stall its
        event loop.)"""
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    # Chat --------------------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """Renders messages with the model's template (as HF does: sandboxed jinja2, trim/lstrip blocks).

        `tools` (OpenAI tool definitions) go to a template that reads a `tools` variable as they are; a template
        without tool support (SmolLM2's) gets them through `inline_tools`: a system prompt in the Hermes format,
        assistant tool calls as `<tool_call>` text and tool results as `<tool_response>` user turns.
        """
        if tools and self.chat_template and "tools" not in self.chat_template:
            messages, tools = inline_tools(messages, tools), None
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if not messages:
            raise ValueError("messages must not be empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content'")
        return _compile_template(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_str(self.bos_token_id),
            eos_token=self._token_str(self.eos_token_ids[0] if self.eos_token_ids else None),
            **({"tools": list(tools)} if tools else {}),
        )

    def _token_str(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.hf.id_to_token(token_id) or "")

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are listed in <tools></tools>"
    " as JSON signatures:\n<tools>\n{tools}\n</tools>\nTo call a function, reply with a JSON object with the"
    ' function name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>,'
    ' "arguments": <args-json-object>}}\n</tool_call>'
)


def inline_tools(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template with no tool support: the tool list in the system prompt (Hermes format), assistant
    `tool_calls` as `<tool_call>` text, `tool` results as `<tool_response>` user turns."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = _TOOLS_PROMPT.format(tools=listing)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
    else:
        out.insert(0, {"role": "system", "content": prompt})
    for m in out:
        calls = m.pop("tool_calls", None)
        if m["role"] == "assistant" and calls:
            text = "".join(f"<tool_call>\n{json.dumps(_call_json(c), ensure_ascii=False)}\n</tool_call>" for c in calls)
            m["content"] = (m["content"] or "") + text
        elif m["role"] == "tool":
            m.pop("tool_call_id", None)
            m.update(role="user", content=f"<tool_response>\n{m['content']}\n</tool_response>")
    return out


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", {})
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return {"name": fn.get("name"), "arguments": args}


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _strftime_now(fmt: str) -> str:
    """Today's date / time in `fmt`, as transformers gives templates."""
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    if source not in _TEMPLATES:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now  # (gpt-oss's harmony template dates its system message)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Byte-level BPE can split one UTF-8 character across tokens, so decoding each token alone gives broken
    characters. We keep two offsets into the ids (vLLM's scheme):

        ids:  [ ... prefix_offset ... read_offset ... len(ids) ]
                    '-- context --'   '-- unread --'

    and emit `decode(ids[prefix:]) - decode(ids[prefix:read])` only once it no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, new_ids: Sequence[int]) -> str:
        """Appends ids; returns the newly completed text (possibly empty)."""
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self.ids[self._prefix :], self._skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emits whatever is left (a final incomplete character becomes U+FFFD)."""
        full = self._tok.decode(self.ids, self._skip)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        self._prefix = self._read = len(self.ids)
        return delta


class _NullDetokenizer:
    def __init__(self):
        self.ids: list[int] = []

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        return ""

    def flush(self) -> str:
        return ""


class NullTokenizer:
    """Stands in for a tokenizer when the weights are random (benchmarks at real shapes stream ids, not text)."""

    def detokenizer(self) -> _NullDetokenizer:
        return _NullDetokenizer()
