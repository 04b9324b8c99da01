"""Gemma's SentencePiece-BPE tokenizer rebuilt from GGUF metadata, and Gemma 3's chat template.

A Gemma GGUF (`tokenizer.ggml.model = "llama"`) stores the vocabulary and token types but no merges. We rebuild
the tokenizer exactly as HF transformers does for the same file (integrations/gguf `gemma_tokenizer` +
`GemmaTokenizer`), so ids match the oracle fixture made with it (tools/make_oracle_gemma3.py):

    tokens  --"  " (runs of spaces) respelled "▁▁"-->  vocab {token: id}
    merges  every split (left, right) of a token into two vocabulary pieces, ranked by the token's position
            in the file (earlier = merged first), then by the pieces' lengths
    model   BPE with byte fallback (<0x..> tokens), unknown <unk>; normalizer " " -> "▁", no prefix space
    added   control tokens (type 3) special; user-defined ones (type 4, e.g. "\\n") plain added tokens

GEMMA3_CHAT_TEMPLATE is Gemma 3's chat template (the tokenizer_config.json of the instruction-tuned releases). The
base 270M GGUF carries none and gets none (chat on it is refused); pass this one to an instruction-tuned Gemma 3 whose
file lacks it.
"""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

_CONTROL = 3
_USER_DEFINED = 4
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""


def merges_from_vocab(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary whose file order is the merge order (HF's `generate_merges` with
    scores -position): every two-piece split of every token, best (earliest) token first, ties by piece lengths
    (longer first) and, within one token, by the pieces' ids."""
    merges = []
    seen = set()
    for token in tokens:
        if token in seen:  # a repeated spelling keeps its first place (dict order) with the last score
            continue
        seen.add(token)
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((-vocab[token], left, right) for left, right in local)
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in merges]


def gemma_hf_tokenizer(tokens: list[str], token_types: list[int]) -> HFTokenizer:
    """The `tokenizers.Tokenizer` of a Gemma GGUF vocabulary (see the module docstring)."""
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(respelled)}
    model = models.BPE(
        vocab=vocab,
        merges=merges_from_vocab(respelled, vocab),
        fuse_unk=True,
        unk_token="<unk>",
        byte_fallback=True,
    )
    hf = HFTokenizer(model)
    hf.normalizer = normalizers.Replace(" ", "\u2581")
    hf.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    types = token_types or [1] * len(tokens)
    hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    )
    # As in HF: a user-defined token is added only under its spelling in the (respelled) vocabulary.
    hf.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and t in vocab
        ]
    )
    return hf
