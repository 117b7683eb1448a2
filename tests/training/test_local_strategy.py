import math

import pytest
import torch

from reroll.config.schema import AlgorithmConfig, OptimizerConfig, TrainConfig
from reroll.data.batch import RLBatch, Trajectory, collate
from reroll.models.loading import load_model
from reroll.pipelines import objective
from reroll.training.local import LocalStrategy, accumulate_gradients, lr_lambda, read_once

pytestmark = pytest.mark.unit


def random_batch(seed: int, size: int = 8):
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for i in range(size):
        prompt = torch.randint(3, 500, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
        response = torch.randint(3, 500, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        trajectories.append(Trajectory(prompt.tolist(), response.tolist(), [-1.0] * len(response),
                                       "stop", group_id=i // 4, reward=float(i % 3 == 0)))
    batch, _ = collate(trajectories, pad_token_id=0)
    batch = RLBatch.derived(batch, group_size=4)
    grpo = objective.build(AlgorithmConfig(), group_size=4)
    batch["advantages"] = objective.estimate_advantages(grpo, batch)[0]
    return batch


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                 "seq_mean_token_sum_norm"])
def test_micro_batches_give_the_full_batch_update(tiny_model, agg):
    config = AlgorithmConfig(loss_agg=agg)
    batch = random_batch(seed=1)
    results = []
    for micro in (8, 4, 1):
        torch.manual_seed(0)
        strategy = LocalStrategy(load_model(tiny_model), OptimizerConfig(lr=1e-3, grad_clip=None),
                                 TrainConfig(micro_batch_size=micro), total_steps=1)
        loss_fn = objective.make_rl_loss(objective.build(config, max_new_tokens=16), batch)
        metrics = strategy.train_step(batch, loss_fn)
        grads = [p.grad.clone() for p in strategy.model.parameters()]
        results.append((metrics["train/loss"], grads))
    # (Adam's first step is ~lr*sign(g), so weights after the step would amplify float noise in
    # near-zero gradients; the gradient itself is what must agree.)
    loss_full, grads_full = results[0]
    assert any(g.abs().max() > 0 for g in grads_full)
    for loss, grads in results[1:]:
        assert math.isclose(loss, loss_full, rel_tol=1e-5, abs_tol=1e-7)
        for a, b in zip(grads, grads_full, strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_sft_loss_is_micro_batch_invariant(tiny_model):
    batch = random_batch(seed=2)
    grads = []
    for micro in (8, 2):
        strategy = LocalStrategy(load_model(tiny_model), OptimizerConfig(grad_clip=None),
                                 TrainConfig(micro_batch_size=micro), total_steps=1)
        strategy.train_step(batch, objective.sft_loss(batch))
        grads.append(torch.cat([p.grad.flatten() for p in strategy.model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_learning_rate_schedules():
    # warm-up 2 of 10 steps: 0.5, 1.0, then cosine from 1 down to min_ratio 0.1 at the end.
    assert lr_lambda(0, 2, 10, "cosine", 0.1) == 0.5
    assert lr_lambda(1, 2, 10, "cosine", 0.1) == 1.0
    assert lr_lambda(2, 2, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_lambda(6, 2, 10, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5)  # half way
    assert lr_lambda(10, 2, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_lambda(7, 0, 10, "constant", 0.0) == 1.0


def test_gradient_clipping_bounds_the_update(tiny_model):
    batch = random_batch(seed=3)
    strategy = LocalStrategy(load_model(tiny_model), OptimizerConfig(grad_clip=1e-3),
                             TrainConfig(micro_batch_size=8), total_steps=1)
    metrics = strategy.train_step(batch, objective.sft_loss(batch))
    clipped = torch.cat([p.grad.flatten() for p in strategy.model.parameters()]).norm()
    assert metrics["train/grad_norm"] > 1e-3 and float(clipped) == pytest.approx(1e-3, rel=1e-3)


def test_checkpoint_restores_weights_optimizer_and_rng(tiny_model, tmp_path):
    batch = random_batch(seed=4)
    make = lambda: LocalStrategy(load_model(tiny_model), OptimizerConfig(lr=1e-3, warmup_steps=3),  # noqa: E731
                                 TrainConfig(micro_batch_size=4), total_steps=5)
    a = make()
    a.train_step(batch, objective.sft_loss(batch))
    a.save(tmp_path / "step_1", {"step": 1})
    expected_noise = torch.rand(3)
    expected = a.train_step(batch, objective.sft_loss(batch))

    b = make()
    assert b.load(tmp_path / "step_1") == {"step": 1}
    assert torch.equal(torch.rand(3), expected_noise)
    got = b.train_step(batch, objective.sft_loss(batch))
    assert got["train/loss"] == expected["train/loss"] and got["train/lr"] == expected["train/lr"]
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_bf16_autocast_trains_with_float32_weights(tiny_model):
    batch = random_batch(seed=5)
    strategy = LocalStrategy(load_model(tiny_model), OptimizerConfig(lr=1e-3),
                             TrainConfig(micro_batch_size=4, bf16_autocast=True), total_steps=2)
    before = [p.detach().clone() for p in strategy.model.parameters()]
    first = strategy.train_step(batch, objective.sft_loss(batch))["train/loss"]
    second = strategy.train_step(batch, objective.sft_loss(batch))["train/loss"]
    assert math.isfinite(first) and second < first
    assert all(p.dtype == torch.float32 for p in strategy.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, strategy.model.parameters(), strict=True))


def batch_with_a_silent_group():
    """Two groups of 4: rewards (1, 0, 0, 1) carry signal, (0, 0, 0, 0) have advantage 0."""
    batch = random_batch(seed=3)
    batch["rewards"] = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0])
    grpo = objective.build(AlgorithmConfig(), group_size=4)
    batch["advantages"] = objective.estimate_advantages(grpo, batch)[0]
    return batch


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "topr", "reinforce"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_skipping_zero_advantage_samples_gives_the_same_gradient(tiny_model, loss, agg):
    if loss == "gspo" and agg != "seq_mean_token_mean":
        pytest.skip("gspo requires seq_mean_token_mean")
    batch = batch_with_a_silent_group()
    grads = {}
    for skip in (False, True):
        config = AlgorithmConfig(policy_loss={"name": loss}, loss_agg=agg, skip_zero_advantage=skip)
        trained = objective.samples_with_gradient(objective.build(config), batch, kl_coef=0.0)
        assert trained.tolist() == ([0, 1, 2, 3] if skip else list(range(8)))
        strategy = LocalStrategy(load_model(tiny_model), OptimizerConfig(grad_clip=None),
                                 TrainConfig(micro_batch_size=8), total_steps=1)
        loss_fn = objective.make_rl_loss(objective.build(config, max_new_tokens=16), batch)
        strategy.train_step(batch[trained], loss_fn)  # normalised over all 8 either way
        grads[skip] = torch.cat([p.grad.flatten() for p in strategy.model.parameters()])
    assert grads[False].abs().max() > 0
    assert torch.allclose(grads[True], grads[False], atol=1e-7, rtol=1e-4)


def test_skipped_samples_top_up_to_the_data_parallel_size_and_respect_exactness():
    batch = batch_with_a_silent_group()
    config = AlgorithmConfig()
    # 4 samples with signal over 3 ranks -> 6, topped up with the first silent ones.
    assert objective.samples_with_gradient(objective.build(config), batch, 0.0, multiple=3).tolist() == \
        [0, 1, 2, 3, 4, 5]
    silent = batch.clone()
    silent["advantages"] = torch.zeros_like(silent["advantages"])
    # Nothing carries signal: still one sample per rank, so the optimizer steps as it would.
    assert objective.samples_with_gradient(objective.build(config), silent, 0.0, multiple=2).tolist() == [0, 1]
    # An entropy bonus or a KL term in the loss depends on every sample: nothing is skipped.
    assert len(objective.samples_with_gradient(objective.build(AlgorithmConfig(entropy_coef=0.01)), batch, 0.0)) == 8
    in_loss = AlgorithmConfig(kl={"coef": 0.1, "mode": "loss"})
    assert len(objective.samples_with_gradient(objective.build(in_loss), batch, 0.1)) == 8
    assert len(objective.samples_with_gradient(objective.build(in_loss), batch, 0.0)) == 4


def test_gradient_checkpointing_gives_the_same_update_and_only_in_the_policy(tiny_model):
    batch = random_batch(seed=2)
    weights = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        train = TrainConfig(micro_batch_size=4, gradient_checkpointing=checkpointing)
        strategy = LocalStrategy(load_model(tiny_model), OptimizerConfig(lr=1e-3), train, 1)
        assert strategy.model.is_gradient_checkpointing == checkpointing
        strategy.train_step(batch, objective.make_rl_loss(objective.build(AlgorithmConfig(), max_new_tokens=16), batch))
        weights.append({n: p.detach().clone() for n, p in strategy.model.named_parameters()})
    for name, value in weights[0].items():
        assert torch.allclose(weights[1][name], value, atol=1e-6), name
    # The critic (a value head on a backbone) trains as before: the option is the policy's.
    from reroll.config.algorithm import CriticConfig
    from reroll.training.critic import LocalCritic

    critic = LocalCritic(CriticConfig(), tiny_model, "float32", OptimizerConfig(),
                    TrainConfig(gradient_checkpointing=True), 1)
    assert not any(getattr(m, "gradient_checkpointing", False)
                   for m in critic.members[0].model.modules())


@pytest.mark.unit
def test_read_once_keeps_floats_and_reads_tensors_in_order():
    assert read_once([1.5, torch.tensor(2.0), 3, torch.tensor([4.0])]) == [1.5, 2.0, 3.0, 4.0]
    assert read_once([0.25]) == [0.25]


@pytest.mark.unit
def test_accumulated_metrics_are_the_batch_mean_whether_floats_or_tensors():
    """Micro-batches of 3 and 1 rows: a metric's batch mean weighs each by its rows."""
    from contextlib import nullcontext

    from tensordict import TensorDict

    weight = torch.nn.Parameter(torch.tensor(2.0))
    model = torch.nn.Module()
    model.weight = weight
    x = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    batch = TensorDict({"x": x, "attention_mask": torch.ones(4, 1)}, batch_size=[4])

    def loss_fn(module, micro):
        loss = (module.weight * micro["x"]).sum()
        mean = micro["x"].mean()
        return loss, {"as_tensor": mean, "as_float": float(mean)}

    loss, metrics = accumulate_gradients(model, batch, loss_fn, 3, nullcontext)
    assert loss == pytest.approx(2.0 * 10)
    # (1+2+3)/3 = 2 over 3 rows, 4 over 1 row: 3/4 * 2 + 1/4 * 4 = 2.5
    assert metrics == {"as_tensor": pytest.approx(2.5), "as_float": pytest.approx(2.5)}
    assert all(type(v) is float for v in metrics.values()) and type(loss) is float
    assert weight.grad == pytest.approx(10.0)
