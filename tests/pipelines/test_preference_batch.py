"""Preference batches: a pair's chosen and rejected responses share one forward of their prompt,
and the DPO loss over micro-batches is the loss of the whole batch computed without packing."""

import pytest
import torch

from reroll.algorithms.preference import dpo_loss
from reroll.data.datasets import parse_records
from reroll.data.preferences import arithmetic_preference_rows, preference_row
from reroll.models.loading import load_model
from reroll.models.logprobs import forward_logprobs
from reroll.models.packing import pack_shared_prefixes
from reroll.pipelines.dpo import PREFERENCE_LOSSES, sequence_sums
from reroll.pipelines.preference import pair_batch, tokenize_pair

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def pairs(tokenizer):
    rows = parse_records(arithmetic_preference_rows(6, seed=0), "pairs")
    return [tokenize_pair(tokenizer, preference_row(row), 512) for row in rows]


def test_each_pair_is_one_packed_row(pairs, tokenizer):
    batch = pair_batch(pairs, tokenizer.pad_token_id)
    assert batch.batch_size[0] == 12
    packed = pack_shared_prefixes(batch["input_ids"], batch["attention_mask"],
                                  batch["response_mask"])
    assert packed is not None and packed.input_ids.shape[0] == 6  # prompt once per pair
    assert sorted(set(packed.segments[0].tolist()) - {-1}) == [0, 1, 2]


def test_packed_micro_batches_give_the_unpacked_batch_loss(pairs, tokenizer, tiny_model):
    torch.manual_seed(0)
    model = load_model(tiny_model)
    batch = pair_batch(pairs, tokenizer.pad_token_id)
    batch["ref_sums"] = -torch.rand(12) * 30
    cfg = type("Cfg", (), {"beta": 0.1, "label_smoothing": 0.0})()
    loss_sum = 0.0
    for start in (0, 4, 8):  # micro-batches of two pairs, packed
        micro = batch[start:start + 4]
        mask = micro["response_mask"]
        with torch.no_grad():
            logprobs, _ = forward_logprobs(model, micro["input_ids"], micro["attention_mask"],
                                           response_mask=mask)
        sums, counts = sequence_sums(logprobs, mask)
        loss_sum += float(PREFERENCE_LOSSES["sigmoid"](cfg, sums, counts, micro["ref_sums"],
                                                       6)[0])
    with torch.no_grad():  # the whole batch, the model's own forward, no packing
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits[:, :-1]
        token = torch.log_softmax(logits.float(), -1).gather(
            -1, batch["input_ids"][:, 1:, None])[..., 0]
        sums = (token * batch["response_mask"][:, 1:]).sum(-1)
    ref = batch["ref_sums"]
    whole, _ = dpo_loss(sums[0::2], sums[1::2], ref[0::2], ref[1::2], beta=0.1)
    assert loss_sum == pytest.approx(float(whole), abs=1e-4)
