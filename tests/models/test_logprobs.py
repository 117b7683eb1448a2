"""Scoring only the response positions gives the same logprobs and entropies there."""

import pytest
import torch

from reroll.models.loading import load_model
from reroll.models.logprobs import first_response_position, forward_logprobs

pytestmark = pytest.mark.unit


def test_first_position_skips_the_prompt_without_changing_the_response(tiny_model):
    model = load_model(tiny_model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (3, 12), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0  # right padding
    response = torch.zeros(3, 12)
    response[0, 5:], response[1, 7:9], response[2, 4:] = 1, 1, 1
    first = first_response_position(response)
    assert first == 4
    full, full_entropy = forward_logprobs(model, ids, attention, 0.7, with_entropy=True)
    part, part_entropy = forward_logprobs(model, ids, attention, 0.7, with_entropy=True,
                                          response_mask=response, entropy_grad=False)
    assert torch.allclose(part[:, first:], full[:, first:], atol=1e-5)
    assert torch.allclose(part_entropy[:, first:], full_entropy[:, first:], atol=1e-5)
    assert (part[:, :first] == 0).all() and not part_entropy.requires_grad


def test_first_response_position_without_a_response_is_one():
    assert first_response_position(torch.zeros(2, 5)) == 1
