"""The architecture registry (checkpoints/architectures.py): README's table is generated from it, and every entry
maps its config.json onto a ModelConfig the model can build."""

import json
import os

import pytest

from checkpoints import hf
from checkpoints.architectures import ARCHITECTURES, TABLE_BEGIN, TABLE_END, supported_models_table, with_table

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_table_is_the_registrys():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert text.count(TABLE_BEGIN) == text.count(TABLE_END) == 1
    assert with_table(text) == text, "README.md is stale: run PYTHONPATH=. python tools/gen_supported_models.py"
    for name in ARCHITECTURES:
        assert f"`{name}`" in supported_models_table()


def test_with_table_needs_markers():
    with pytest.raises(ValueError, match="markers"):
        with_table("# no table here\n")
    assert (
        with_table(f"a\n{TABLE_BEGIN}\nold\n{TABLE_END}\nb")
        == f"a\n{TABLE_BEGIN}\n{supported_models_table()}\n{TABLE_END}\nb"
    )


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["MambaForCausalLM"]}, "unsupported architecture"),
        ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}, "do not repeat"),
        ({"layer_types": ["sliding_attention", "other", "full_attention"]}, "full_attention or sliding_attention"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "sliding layers"),
        ({"hidden_activation": "silu"}, "hidden_act"),
    ],
)
def test_config_errors(change, message):
    with open(os.path.join(os.path.dirname(__file__), "data", "hf_tiny", "gemma3", "config.json")) as f:
        base = json.load(f)
    with pytest.raises(ValueError, match=message):
        hf.config_from_hf({**base, **change})


def test_qwen3_sliding_window_refused():
    with open(os.path.join(os.path.dirname(__file__), "data", "hf_tiny", "qwen3", "config.json")) as f:
        base = json.load(f)
    assert hf.config_from_hf({**base, "sliding_window": 16}).sliding_window is None  # (use_sliding_window false)
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf.config_from_hf({**base, "sliding_window": 16, "use_sliding_window": True})


def test_phi3_partial_rotary_and_transformers4_longrope():
    with open(os.path.join(os.path.dirname(__file__), "data", "hf_tiny", "phi3", "config.json")) as f:
        base = json.load(f)
    rope = dict(base.pop("rope_parameters"))
    t4 = {**base, "rope_theta": rope.pop("rope_theta"), "rope_scaling": {**rope, "type": "su"}}
    del t4["rope_scaling"]["rope_type"]
    assert (
        hf.config_from_hf(t4).rope_scaling
        == hf.config_from_hf(
            {**base, "rope_parameters": {**rope, "rope_theta": 1e4, "rope_type": "longrope"}}
        ).rope_scaling
    )
    with pytest.raises(ValueError, match="partial rotary"):
        hf.config_from_hf({**t4, "partial_rotary_factor": 0.75})


def _write_tokenizer(directory, config=None):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "user", "hi", ":"])}
    tok = HFTokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(os.path.join(directory, "tokenizer.json"))
    if config is not None:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)


def test_chat_template_from_config_from_jinja_file_or_none(tmp_path):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    _write_tokenizer(str(a), {"chat_template": template, "eos_token": "</s>"})
    _write_tokenizer(str(b), {"eos_token": "</s>"})
    (b / "chat_template.jinja").write_text(template)
    _write_tokenizer(str(c), {"eos_token": "</s>"})
    for d in (a, b):
        tok = hf.load_hf_tokenizer(str(d))
        assert tok.chat_template == template and tok.has_chat_template
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\n"
    base = hf.load_hf_tokenizer(str(c))
    assert base.chat_template is None and not base.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        base.apply_chat_template([{"role": "user", "content": "hi"}])
