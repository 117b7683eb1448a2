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


def test_pairs_scored_in_length_order_come_back_in_their_order(pairs, tokenizer, tiny_model):
    """`pair_logprobs` forwards the pairs shortest first, packed, in micro-batches; each pair's
    sums are those of its own two rows forwarded alone, unpacked, and in the pairs' order."""
    from reroll.pipelines.dpo import pair_logprobs
    from reroll.pipelines.preference import by_length, packed_length

    torch.manual_seed(0)
    model = load_model(tiny_model)
    shuffled = [pairs[i] for i in (3, 0, 5, 1, 4, 2)]
    order = by_length(shuffled)
    assert [packed_length(shuffled[i]) for i in order] == sorted(map(packed_length, shuffled))
    assert order != list(range(6))  # the arithmetic pairs differ in length: a real reordering
    scored = pair_logprobs(model, shuffled, tokenizer.pad_token_id, 4)
    assert scored.shape == (6, 2) and not scored.is_inference()
    for pair, sums in zip(shuffled, scored, strict=True):
        for ids, value in ((pair.chosen_ids, sums[0]), (pair.rejected_ids, sums[1])):
            row = torch.tensor([pair.prompt_ids + ids])
            with torch.no_grad():
                logits = model(input_ids=row).logits[0, :-1].float()
            token = torch.log_softmax(logits, -1).gather(-1, row[0, 1:, None])[:, 0]
            assert float(value) == pytest.approx(float(token[-len(ids):].sum()), rel=1e-6,
                                                 abs=1e-5)
