"""benchmarks/shapes.py: every named shape builds, and the published HF configs read as the loader reads them give
each family's features and the parameter count its model card states."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import shapes
from checkpoints.gguf import expected_shapes

PUBLISHED_PARAMETERS = {  # embeddings and (untied) output head included
    "qwen3_8b": 8_190_735_360,
    "gemma2_9b": 9_241_705_984,
    "llama3_8b": 8_030_261_248,
}


@pytest.mark.parametrize("name", shapes.NAMES)
def test_every_named_shape_builds(name):
    assert shapes.model_config(name).name == name


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_parameter_counts_match_the_model_cards(name):
    counts = expected_shapes(shapes.model_config(name)).values()
    assert sum(int(np.prod(s)) for s in counts) == PUBLISHED_PARAMETERS[name]


def test_family_features_come_from_the_configs():
    qwen3, gemma2 = shapes.model_config("qwen3_8b"), shapes.model_config("gemma2_9b")
    assert qwen3.qk_norm and qwen3.sliding_window is None and not qwen3.tie_word_embeddings
    assert gemma2.arch == "gemma2" and gemma2.tie_word_embeddings
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert (gemma2.sliding_window, gemma2.sliding_window_pattern, gemma2.query_pre_attn_scalar) == (4096, 2, 256.0)


def test_an_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="unknown model preset"):
        shapes.model_config("gpt5")
