"""Real clients against the real server (SmolLM2 on CPU, uvicorn on a loopback port): the official `openai`
package on every endpoint and streaming mode, the project's bounded soak (tools/soak.py) bursting at 2x the
queue limit with 0 lost requests, and lm-eval's `local-completions` scoring a small local multiple-choice task
through /v1/completions (echo + logprobs) with its remote tokenizer backend (/tokenizer_info, /tokenize).

Engine options match tests/test_server.py, so the persistent compilation cache it fills serves these compiles.
"""

import json
import os
import subprocess
import sys

import numpy as np
import openai
import pytest

from serving.api import app as srv
from serving.api import http as server_http
from tests.live_app import serving_in_thread

MODEL = srv.DEFAULT_MODEL_NAME
MAX_MODEL_LEN = 256
MAX_QUEUE = 8
CACHE_DIR = os.environ.get(
    "PALLAS_SERVE_TEST_XLA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pallas-serve", "xla-tests")
)
ENGINE_OPTIONS = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    attention_backend="xla",
    decode_steps=1,
    warmup=True,
    compilation_cache_dir=CACHE_DIR,
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The capital of France is"
SHORT = 16  # every short sequence scored offline is padded to this length: one compiled forward for all of them


def _log_softmax(llm, ids, pad_to: int) -> np.ndarray:
    """float64 log-softmax of LLM.score over `ids` [len, V], scored padded to `pad_to` tokens: the model is causal,
    so the padding changes no row kept, and LLM.score compiles once per length (the 30-layer forward, seconds on a
    CPU) instead of once per sequence."""
    x = llm.score(list(ids) + [0] * (pad_to - len(ids)))[: len(ids)].astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    return logp - np.log(np.exp(logp).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def live():
    from serving.engine.llm import LLM

    llm = LLM(max_model_len=MAX_MODEL_LEN, **ENGINE_OPTIONS)
    asgi = srv.create_app(lambda: llm, model_name=MODEL, max_queue=MAX_QUEUE, warmup=True)
    with serving_in_thread(asgi, http=server_http.timed_h11_protocol(10.0), timeout_graceful_shutdown=60) as (
        _,
        _,
        url,
    ):
        yield llm, url


def _client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_openai_models_and_completions(live):
    llm, url = live
    client = _client(url)
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra["max_model_len"] == MAX_MODEL_LEN
    ref = llm.generate([PROMPT], max_tokens=6, temperature=0.0)[0]
    ids = llm.tokenizer.encode(PROMPT)
    for prompt in (PROMPT, [PROMPT, PROMPT], ids, [ids, ids]):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert [c.text for c in out.choices] == [ref.text] * len(out.choices)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8, n=2, best_of=3, seed=3)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens <= 18
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text == PROMPT and len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    logp = _log_softmax(llm, ids, SHORT)
    expect = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert np.allclose(lp.token_logprobs[1:], expect, atol=2e-3)


def test_openai_streams(live):
    llm, url = live
    client = _client(url)
    ref = llm.generate([PROMPT], max_tokens=6, temperature=0.0)[0]
    for include_usage in (False, True):
        extra = {"stream_options": {"include_usage": True}} if include_usage else {}
        chunks = list(
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True, **extra)
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert (chunks[-1].usage is not None) == include_usage and all(c.usage is None for c in chunks[:-1])
        chat = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=5,
                temperature=0,
                stream=True,
                n=2,
                **extra,
            )
        )
        texts = {0: "", 1: ""}
        for c in chat:
            for ch in c.choices:
                texts[ch.index] += ch.delta.content or ""
        assert texts[0] == texts[1] and texts[0]  # greedy: both choices agree
        assert (chat[-1].usage is not None) == include_usage


def test_openai_chat_options_tools_and_errors(live):
    llm, url = live
    client = _client(url)
    msgs = [{"role": "user", "content": "Name a colour."}]
    a = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0.9, seed=5, logprobs=True, top_logprobs=2
    )
    b = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0.9, seed=5)
    assert a.choices[0].message.content == b.choices[0].message.content  # seeded
    assert all(len(t.top_logprobs) == 2 for t in a.choices[0].logprobs.content)
    ids = llm.encode_prompt(llm.tokenizer.apply_chat_template(msgs))
    c = client.chat.completions.create(
        model=MODEL, messages=[], max_tokens=6, temperature=0, extra_body={"prompt_token_ids": ids}
    )
    d = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert c.choices[0].message.content == d.choices[0].message.content and c.usage.prompt_tokens == len(ids)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    t = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        max_tokens=40,
        temperature=0,
    )
    assert t.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for call in t.choices[0].message.tool_calls or []:
        json.loads(call.function.arguments)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        named = {"type": "function", "function": {"name": "nope"}}
        client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice=named)
    # logit_bias: +100 on one token makes greedy decoding emit only it; -100 on the greedy token removes it.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    first = llm.tokenizer.encode(plain.choices[0].text)[0]
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={"42": 100})
    assert forced.choices[0].text == llm.tokenizer.decode([42, 42, 42])  # ids are exact in tests/test_engine.py
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(first): -100}
    )
    assert llm.tokenizer.encode(banned.choices[0].text)[0] != first
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"5": 101})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT)


def test_soak_burst_at_twice_the_queue_loses_nothing(live, tmp_path):
    _, url = live
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "tools", "soak.py"),
        "--url",
        url,
        "--duration_s",
        "0",
        "--burst",
        str(2 * MAX_QUEUE),
        "--min_tokens",
        "2",
        "--max_tokens",
        "6",
        "--cancel_fraction",
        "0",
        "--model_name",
        MODEL,
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600
    )
    summary = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert summary["requests_sent"] == 2 * MAX_QUEUE and summary["completed"] == 2 * MAX_QUEUE
    assert summary["lost"] == 0 and summary["kv_blocks_in_requests_end"] == 0
    print(
        "soak burst:", {k: summary[k] for k in ("completed", "lost", "pushed_back_503_retried", "requests_pushed_back")}
    )


DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Madrid"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["seven", "four", "ninety"], "answer": 1},
    {"question": "The opposite of hot is", "choices": ["purple", "loud", "cold"], "answer": 2},
    {"question": "Water is made of hydrogen and", "choices": ["oxygen", "gold", "sand"], "answer": 0},
]
TASK = """task: tiny_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _reference_logliks(llm) -> list[list[float]]:
    """Per doc and choice, the continuation's summed logprob from LLM.score, pairing context and continuation
    as lm-eval does (continuation = target_delimiter " " + choice; _encode_pair: the whole string encoded, the
    context's token count split off)."""
    out = []
    for doc in DOCS:
        scores = []
        for choice in doc["choices"]:
            whole = llm.tokenizer.encode(doc["question"] + " " + choice)  # lm-eval's target_delimiter
            ctx = llm.tokenizer.encode(doc["question"])
            logp = _log_softmax(llm, whole, SHORT)
            scores.append(float(sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole)))))
        out.append(scores)
    return out


def test_lm_eval_local_completions_scores_a_local_task(live, tmp_path):
    llm, url = live
    data = tmp_path / "tiny_facts.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny_facts.yaml").write_text(TASK.format(data=data))
    lm_eval = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    model_args = f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,num_concurrent=1,max_retries=1"
    cmd = [
        lm_eval,
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        "tiny_facts",
        "--include_path",
        str(tmp_path),
        "--output_path",
        str(tmp_path / "out"),
        "--log_samples",
    ]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "out") for f in fs]
    (result_file,) = [f for f in files if os.path.basename(f).startswith("results")]
    (samples_file,) = [f for f in files if os.path.basename(f).startswith("samples_tiny_facts")]
    acc = json.load(open(result_file))["results"]["tiny_facts"]["acc,none"]
    samples = sorted((json.loads(line) for line in open(samples_file)), key=lambda x: x["doc_id"])
    got = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    ref = _reference_logliks(llm)
    print("lm-eval tiny_facts acc:", acc, "loglikelihoods:", got)
    assert np.allclose(got, ref, atol=5e-3), (got, ref)
    assert acc == np.mean([int(np.argmax(r)) == d["answer"] for r, d in zip(ref, DOCS)])


def test_lm_eval_rolling_perplexity_matches_offline(live, tmp_path):
    """lm-eval's loglikelihood_rolling (a perplexity task) through the server equals the offline figure of the
    same held-out text: same tokens through /tokenize, and per window the summed logprob of LLM.score (no server)
    on lm-eval's own windows; the token perplexity within 0.1%."""
    from benchmarks import lm_eval_ppl

    llm, url = live
    text = lm_eval_ppl.documents(1500)[0]["text"]  # a held-out licence text, > 1 window of MAX_MODEL_LEN tokens
    (got,) = lm_eval_ppl.run_lm_eval(url, MODEL, [dict(text=text)], MAX_MODEL_LEN, str(tmp_path))
    ids = llm.tokenizer.encode(text, False)
    assert lm_eval_ppl._tokenize(url, text) == ids
    pairs = lm_eval_ppl.windows(ids, lm_eval_ppl.prefix_token(url), MAX_MODEL_LEN)
    assert len(pairs) >= 2 and sum(len(c) for _, c in pairs) == len(ids)
    ref = 0.0
    for ctx, cont in pairs:
        logp = _log_softmax(llm, ctx + cont, MAX_MODEL_LEN)
        ref += float(sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(cont)))
    ppl_server, ppl_offline = np.exp(-got / len(ids)), np.exp(-ref / len(ids))
    print("lm-eval rolling ppl", ppl_server, "offline", ppl_offline)
    assert abs(ppl_server / ppl_offline - 1.0) < 1e-3, (ppl_server, ppl_offline)
