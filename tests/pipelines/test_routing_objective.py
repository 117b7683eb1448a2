"""The RL loss on a mixture-of-experts policy: a batch's `routed_experts` is replayed in the
loss's forward, and the router losses are logged and, at their coefficients, trained on."""

import pytest
import torch

from reroll.config.schema import AlgorithmConfig
from reroll.data.batch import RLBatch, Trajectory, collate
from reroll.engines.base import Request, SamplingParams
from reroll.engines.hf import HFEngine
from reroll.pipelines import objective

pytestmark = pytest.mark.unit


def rollout_batch(moe) -> RLBatch:
    import copy

    engine = HFEngine(copy.deepcopy(moe), record_routing=True)
    requests = [Request([1, 5, 6, 7], SamplingParams(max_new_tokens=6), seed=s) for s in range(4)]
    trajectories = [Trajectory(c.prompt_ids, c.token_ids, c.logprobs, c.finish_reason, 0,
                               reward=float(i % 2), routed_experts=c.routed_experts)
                    for i, c in enumerate(engine.generate_batch(requests))]
    batch, _ = collate(trajectories, pad_token_id=0)
    batch = RLBatch.derived(batch, group_size=4)
    assert batch["routed_experts"].shape == (4, 10, 2, 2)
    grpo = objective.build(AlgorithmConfig(), group_size=4)
    batch["advantages"] = objective.estimate_advantages(grpo, batch)[0]
    return batch


def loss_of(moe, batch, **algorithm) -> tuple[float, dict]:
    obj = objective.build(AlgorithmConfig(**algorithm), group_size=4, max_new_tokens=6)
    loss, metrics = objective.make_rl_loss(obj, batch)(moe, batch)
    return float(loss), metrics


def test_the_loss_replays_the_batch_routing_and_trains_on_the_router_losses(moe):
    batch = rollout_batch(moe)
    replayed, metrics = loss_of(moe, batch)
    # a float32 engine routed as the trainer does: replaying its record changes nothing
    assert float(metrics["actor/behaviour_kl_k3"]) < 1e-9
    shifted = batch.clone()
    recorded = shifted["routed_experts"]
    shifted["routed_experts"] = torch.where(recorded >= 0, (recorded + 1) % 4, recorded)
    # other experts replayed: another network than the engine's, its logprobs part
    assert float(loss_of(moe, shifted)[1]["actor/behaviour_kl_k3"]) > 1e-7  # ~1e-6 here
    aux, z = float(metrics["actor/router_aux_loss"]), float(metrics["actor/router_z_loss"])
    assert aux > 0 and z > 0
    weighted, _ = loss_of(moe, batch, router_aux_loss_coef=0.5, router_z_loss_coef=0.1)
    assert weighted == pytest.approx(replayed + 0.5 * aux + 0.1 * z, rel=1e-5)
