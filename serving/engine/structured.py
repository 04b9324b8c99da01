"""Structured output: constraints compiled by llguidance against the model's vocabulary, one matcher per request,
and the packed token bitmask that the sampler applies on the device.

    add_request    Constraint --(cache: (kind, spec) -> compiled matcher, never advanced)--> deep copy per request
                   a constraint that does not compile (bad syntax, a schema that admits nothing): ValueError
    _sample        each constrained row's mask filled on the host (llguidance's executor, rows in parallel) while
                   the forward pass runs on the device; unconstrained and padding rows all ones ->
                   sample_rows_masked: logits of disallowed tokens -> -inf before penalties' results are filtered
                   a row left with no token it may emit (dead end) -> the request finishes with 'error'
    _postprocess   every token the scheduler accepted advances the request's matcher; when the grammar can take
                   no more text the request finishes with 'stop' (no extra step for EOS); a refused token -> 'error'

Masks are int32 words [B, ceil(V/32)], token t allowed when bit t % 32 of word t // 32 is set (llguidance's
layout, unpacked on device by model.sampling.unpack_bitmask). EOS is in a mask only where the grammar accepts.
A constrained row needs the host between tokens, so decode loops skip batches that hold one (decode_loop.py).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Sequence

import jax
import numpy as np

from model.sampling import sample
from serving.core.request import Constraint, Request

# JSON is generated compactly, with the separators models usually write; runs of whitespace cannot loop. A
# schema's own "x-guidance" options override these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError as e:
        raise ValueError("structured output needs the llguidance package: pip install '.[serve]'") from e
    return llguidance


def tokenizer_json(tokenizer) -> str:
    """The HF `tokenizers` JSON of our Tokenizer (checkpoints/tokenizer.py) or of a wrapped HF tokenizer."""
    for hf in (getattr(tokenizer, "hf", None), getattr(tokenizer, "inner", None), tokenizer):
        if hf is not None and hasattr(hf, "to_str"):
            return hf.to_str()
    raise ValueError(
        "structured output needs a byte-level BPE tokenizer from the HF `tokenizers` library "
        f"(checkpoints/tokenizer.py); this engine has a {type(tokenizer).__name__}"
    )


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar of a constraint (raises ValueError for a grammar that cannot be converted)."""
    llg = _llguidance()
    if c.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
    if c.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(c.spec, defaults=JSON_DEFAULTS)
    return llg.grammar_from(c.kind, c.spec)  # regex | grammar (Lark or GBNF) | choice


class StructuredOutputs:
    """Compiled constraints and the live matchers of one engine's constrained requests.

    Args:
      tokenizer: the engine's tokenizer (its HF `tokenizers` object describes the vocabulary to llguidance).
      vocab_size: the model's vocabulary (logits width); the masks have ceil(vocab_size / 32) words.
      eos_token_ids: the model's EOS ids, allowed where the grammar accepts.
      cache_size: compiled constraints kept (least recently used dropped).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self.eos_token_ids = tuple(eos_token_ids)
        self._cache: collections.OrderedDict[Constraint, object] = collections.OrderedDict()
        self._cache_size = cache_size
        self._matchers: dict[str, object] = {}
        self._lock = threading.Lock()  # the server compiles on worker threads too (serving/api/guided.py)
        self.num_compiled = 0

    @functools.cached_property
    def ll_tokenizer(self):
        """llguidance's view of the vocabulary (built once, about a second for a 49k vocabulary)."""
        llg = _llguidance()
        with self._lock:
            return llg.LLTokenizer(
                tokenizer_json(self._tokenizer), n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
            )

    @functools.cached_property
    def _executor(self):
        return _llguidance().LLExecutor()

    # Requests ----------------------------------------------------------------------------------------------------

    def compile(self, c: Constraint):
        """The compiled matcher of a constraint (cached; callers deep-copy it). Raises ValueError if it fails.

        Thread-safe: the server compiles a request's constraint on a worker thread before submitting it, so the
        engine thread finds it cached (a large grammar can take a second to compile)."""
        with self._lock:
            template = self._cache.get(c)
            if template is not None:
                self._cache.move_to_end(c)
                return template
        llg = _llguidance()
        try:
            text = grammar_text(c)
        except ValueError as e:
            raise ValueError(f"constraint {c.kind} does not compile: {e}") from None
        template = llg.LLMatcher(self.ll_tokenizer, text, log_level=0)  # releases the GIL while it compiles
        if template.is_error():
            raise ValueError(f"constraint {c.kind} does not compile: {template.get_error().strip()}")
        self._probe(c, template)
        with self._lock:
            self.num_compiled += 1
            self._cache[c] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def _probe(self, c: Constraint, template) -> None:
        """Refuses a constraint whose first mask the grammar itself would not accept: every token the mask allows
        at the start must be consumable. (llguidance 1.9 compiles a regex of astral-plane literals, e.g.
        "\U0007e458", to a first mask that allows only the literal's second UTF-8 byte, then refuses that token;
        without this probe such a request failed mid-generation with a server error.)"""
        probe = template.deep_copy()
        mask = np.zeros((1, self.num_words), np.int32)
        _llguidance().numpy.fill_next_token_bitmask(probe, mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size]
        allowed = np.flatnonzero(bits)
        bad = [int(t) for t in allowed[:64] if not template.deep_copy().consume_token(int(t))]
        if bad:
            raise ValueError(
                f"constraint {c.kind} cannot be enforced with this tokenizer: the grammar's first mask allows "
                f"token(s) {bad[:5]} that it then refuses"
            )

    def add(self, request_id: str, c: Constraint) -> None:
        self._matchers[request_id] = self.compile(c).deep_copy()

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    # Masks -------------------------------------------------------------------------------------------------------

    def bitmask(self, reqs: Sequence[Request], s: int, banned: np.ndarray) -> tuple[np.ndarray | None, dict]:
        """Masks for the first len(reqs) of s rows, and {request_id: message} for rows at a dead end.

        Args:
          reqs: the rows' requests; those without a matcher get all ones (as do the padding rows).
          s: rows of the sampler's bucket.
          banned: [s, n] -1-padded ids each row may not produce this step (EOS before min_tokens).

        Returns:
          (int32 [s, num_words], or None when no row is constrained; the dead ends).
        """
        rows = [(self._matchers[r.request_id], i) for i, r in enumerate(reqs) if r.request_id in self._matchers]
        if not rows:
            return None, {}
        mask = np.full((s, self.num_words), -1, np.int32)
        if len(rows) == 1:  # no thread pool for one row (its idle workers would compete with the device's threads)
            _llguidance().numpy.fill_next_token_bitmask(rows[0][0], mask, rows[0][1])
        else:
            _llguidance().numpy.fill_next_token_bitmask_par(self._executor, rows, mask)
        dead = {}
        for matcher, i in rows:
            message = self._dead_end(matcher, mask[i], banned[i], reqs[i])
            if message is not None:
                dead[reqs[i].request_id] = message
        return mask, dead

    def _dead_end(self, matcher, words: np.ndarray, banned_ids: np.ndarray, req: Request) -> str | None:
        if matcher.is_error():
            return f"structured output failed: {matcher.get_error().strip()}"
        left = words.view(np.uint32).copy()
        for t in banned_ids[banned_ids >= 0]:
            left[t >> 5] &= ~np.uint32(1 << (int(t) & 31))
        if left.any():
            return None
        return (
            f"structured output reached a dead end after {req.num_output_tokens} tokens: the grammar allows no "
            f"token the request may emit here (min_tokens={req.sampling_params.min_tokens} bans EOS until then)"
        )

    def advance(self, req: Request, token_ids: Sequence[int]) -> str | None:
        """Feeds a request's newly accepted tokens to its matcher. Returns None (go on), 'stop' (the grammar can
        take no more text) or an error message (a token the grammar refused, or the grammar ending the output
        before min_tokens)."""
        matcher = self._matchers.get(req.request_id)
        if matcher is None or not token_ids:
            return None
        for t in token_ids:
            if not matcher.consume_token(int(t)):
                reason = matcher.get_error().split("\n<state>", 1)[0].strip()  # without llguidance's state dump
                return f"structured output failed: token {int(t)} refused ({reason})"
        if not matcher.is_stopped():
            return None
        if req.num_output_tokens < req.sampling_params.min_tokens:
            return (
                f"structured output reached a dead end: the grammar ends the output after {req.num_output_tokens} "
                f"tokens, before min_tokens={req.sampling_params.min_tokens}"
            )
        return "stop"


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample_rows_masked(logits, st, output_ids, prompt_ids, banned, bitmask, num_logprobs: int = 0):
    """sampler.sample_rows with a packed allowed-token bitmask [S, ceil(V/32)] per row."""
    n = st.temperature.shape[0]
    return sample(
        logits[:n], st, output_ids, prompt_ids, banned, num_logprobs=num_logprobs, allowed_bitmask_bw=bitmask[:n]
    )
