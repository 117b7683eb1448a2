"""What `load_model` decides for every role: dropout off, attention that keeps its features."""

import pytest
import torch

from reroll.config.errors import ConfigError
from reroll.models.factory import make_model
from reroll.models.loading import load_model
from reroll.models.logprobs import forward_logprobs


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("gpt2") / "m", "tiny", architecture="gpt2"))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("gemma2") / "m", "tiny", architecture="gemma2",
                          config_overrides={"attn_logit_softcapping": 1.0}))


def _ids():
    return torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(0))


def test_dropout_is_off_in_train_mode(gpt2):
    """GPT-2 declares dropout 0.1: in train mode (as during an update) the trainer's logprobs
    were random, up to ~2 nats from the engine's."""
    model = load_model(gpt2).train()
    ids = _ids()
    first, _ = forward_logprobs(model, ids, torch.ones_like(ids))
    second, _ = forward_logprobs(model, ids, torch.ones_like(ids))
    with torch.no_grad():
        evaluated, _ = forward_logprobs(model.eval(), ids, torch.ones_like(ids))
    assert torch.equal(first, second)
    assert torch.allclose(first, evaluated, atol=1e-5)
    assert model.config.resid_pdrop == 0.0


def test_dropout_kept_when_asked(gpt2):
    model = load_model(gpt2, dropout=True).train()
    ids = _ids()
    first, _ = forward_logprobs(model, ids, torch.ones_like(ids))
    second, _ = forward_logprobs(model, ids, torch.ones_like(ids))
    assert not torch.equal(first, second)


def test_softcapping_chooses_eager_and_matches_it(gemma2):
    """transformers' sdpa ignores Gemma 2's attention logit soft-capping without a word: auto
    picks eager, whose logits are the reference."""
    model = load_model(gemma2).eval()
    assert model.config._attn_implementation == "eager"
    ids = _ids()
    with torch.no_grad():
        sdpa_logits = load_model(gemma2, attn_implementation="eager").eval()(ids).logits
        assert torch.allclose(model(ids).logits, sdpa_logits, atol=1e-5)


def test_an_implementation_that_drops_a_feature_is_refused(gemma2):
    with pytest.raises(ConfigError, match="attn_logit_softcapping.*'sdpa' ignores"):
        load_model(gemma2, attn_implementation="sdpa")


@pytest.mark.parametrize("model_type,reason", [("t5", "encoder-decoder"),
                                               ("vit", "no causal LM")])
def test_an_architecture_that_cannot_be_served_is_refused(tmp_path, model_type, reason):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=reason):
        load_model(str(tmp_path))
