"""Building the RL roles from the config: in this process (`executor: local`, exactly the
one-process objects of a laptop run) or as Ray actors (`executor: ray`), behind the same
interfaces, so the pipeline code does not change between them. The builder knows the executor,
so it also picks how the policy's weights reach the engine (`Roles.weight_sync`).

policy     `training.protocols.Policy` (`forward_logprobs`, `train_step`, `state_dict_for_sync`, ...)
reference  `training.protocols.Reference` (`logprobs(batch, temperature)`)
teacher    `training.protocols.Teacher` (`logprobs`, `top_k(batch, k, temperature)`)
critic     `training.protocols.Critic` (`values`, `update`, `save`, `load`, `num_critics`)
engine     `engines.base.Engine`
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from reroll.config.errors import ConfigError
from reroll.config.rewards import JudgeReward
from reroll.config.schema import RLConfig
from reroll.distributed.cluster import Cluster, LocalExecutor, RayExecutor, WorkerSpec
from reroll.distributed.engine_actor import start_engine_actor
from reroll.distributed.engine_pool import EnginePool
from reroll.distributed.env_actor import RemoteEnvs, start_env_hosts
from reroll.distributed.groups import CriticProxy, PolicyGroup, ReferenceGroup
from reroll.distributed.placement import (
    colocate_on_node,
    colocated_with_policy,
    placement_config,
    ray_options,
    role_options,
)
from reroll.distributed.ray_runtime import ensure_ray
from reroll.distributed.reward_actor import start_reward_actors
from reroll.distributed.reward_serve import start_reward_service
from reroll.distributed.weight_sync import (
    InProcessSync,
    PublishedSync,
    WeightSync,
    actor_weight_sync,
    adapter_only,
)
from reroll.engines import engine_factory
from reroll.engines.base import Engine
from reroll.engines.delta import DeltaPolicy
from reroll.models.devices import RoleDevice, machine_devices, plan_devices
from reroll.models.files import read_config
from reroll.models.loading import load_model, load_tokenizer
from reroll.rewards.base import RewardFn
from reroll.training.critic import LocalCritic
from reroll.training.local import LocalStrategy
from reroll.training.protocols import AdapterOffReference, Critic, Policy, Reference, Teacher
from reroll.workers.critic import CriticWorker
from reroll.workers.policy import PolicyWorker
from reroll.workers.reference import ReferenceWorker


@dataclass
class Roles:
    policy: Policy
    reference: Reference | None
    critic: Critic | None
    engine: Engine
    clusters: list[Cluster]
    weight_sync: WeightSync
    """Policy -> `engine`, chosen with the roles (in memory, object store or broadcast)."""
    lora_sync: str | None = None
    """`model.lora.sync` (None: full fine-tuning): an in-memory sync may send the adapter alone."""
    teacher: Teacher | None = None
    """On-policy distillation's teacher (`algorithm.distill`): logprobs of the samples, or
    their top-k next tokens (`mode: dense`)."""

    def shutdown(self) -> None:
        for cluster in self.clusters:
            cluster.shutdown()
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()


def weight_sync_to(roles: Roles, engine: Engine) -> WeightSync:
    """The sync from the policy to the engine the pipeline loads weights into: the roles' own for
    their engine; for an asynchronous rollout source's facade in front of it, a hand-over
    (in-flight updates) or an in-memory load through the facade, which pauses the producer."""
    if engine is roles.engine:
        return roles.weight_sync
    if getattr(engine, "publishes_weights", False):
        adapter_only(roles.lora_sync, engine)  # hand-overs are merged: `adapter` is an error
        return PublishedSync(roles.policy, engine)
    return InProcessSync(roles.policy, engine, roles.lora_sync)


Plan = dict[str, RoleDevice]


def policy_spec(c: RLConfig, total_steps: int, plan: Plan) -> WorkerSpec:
    return WorkerSpec(PolicyWorker, dict(
        model_path=c.model.path, dtype=c.model.dtype, optimizer=c.optimizer, train=c.train,
        total_steps=total_steps, param_dtype=c.distributed.fsdp_param_dtype,
        attn_implementation=c.model.attn_implementation, dropout=c.model.dropout,
        device=plan["policy"].device, autocast_bf16=plan["policy"].autocast_bf16,
        lora=c.model.lora), role="policy")


def reference_spec(c: RLConfig, plan: Plan) -> WorkerSpec:
    return WorkerSpec(ReferenceWorker, dict(model_path=c.model.path, dtype=c.model.dtype,
                                            micro_batch_size=c.train.micro_batch_size,
                                            attn_implementation=c.model.attn_implementation,
                                            device=plan["reference"].device,
                                            autocast_bf16=plan["reference"].autocast_bf16),
                      role="reference")


def critic_spec(c: RLConfig, total_steps: int, plan: Plan) -> WorkerSpec:
    return WorkerSpec(CriticWorker, dict(
        config=c.algorithm.critic, policy_path=c.model.path, dtype=c.model.dtype,
        optimizer=c.optimizer, train=c.train, total_steps=total_steps,
        device=plan["critic"].device, autocast_bf16=plan["critic"].autocast_bf16), role="critic")


def rollout_engine_factory(c: RLConfig, pad_token_id: int, plan: Plan):
    """The configured engine's builder on the planned device and weight dtype."""
    rollout = c.rollout.model_copy(update={"dtype": plan["rollout"].engine_dtype})
    return engine_factory(rollout, c.model.path, c.model.dtype, pad_token_id, c.seed,
                          c.model.attn_implementation, plan["rollout"].device,
                          lora_rank=adapter_rank(c),
                          record_routing=c.algorithm.routing_replay == "rollout")


def adapter_rank(c: RLConfig) -> int:
    """The LoRA rank an engine must take adapters of (vLLM then starts with its LoRA support),
    0 where the sync sends merged weights: no `model.lora`, or `model.lora.sync: merged`."""
    lora = c.model.lora
    return lora.rank if lora is not None and lora.sync != "merged" else 0


def build_roles(c: RLConfig, total_steps: int, pad_token_id: int) -> Roles:
    plan = plan_devices(c.distributed, c.train, c.rollout, *machine_devices())
    if c.distributed.executor == "ray":
        return _ray_roles(c, total_steps, pad_token_id, plan)
    return _local_roles(c, total_steps, pad_token_id, plan)


def teachers(c: RLConfig, plan: Plan, cluster: Callable[[WorkerSpec], Cluster]
             ) -> Teacher | None:
    """On-policy distillation's teacher (None without `algorithm.distill`): one reference worker
    group over each teacher's weights (`cluster` builds it in this process or as Ray actors),
    routed by tag when there are several."""
    distill = c.algorithm.distill
    if distill is None:
        return None
    groups = {name: ReferenceGroup(cluster(teacher_spec(
                  c, plan, distill.teachers[name] if name else distill.teacher, name)))
              for name in distill.names()}
    return groups[None] if list(groups) == [None] else RoutedTeacher(groups)


def check_teachers(c: RLConfig, tokenizer) -> None:
    """On-policy distillation gathers the teacher's logprob of each sampled token id: every
    teacher must share the policy's tokenizer and output width (ConfigError at start)."""
    from reroll.pipelines.distill import check_same_tokenizer

    distill = c.algorithm.distill
    if distill is None:
        return
    width = vocab_width(c.model.path)
    named = ([("algorithm.distill.teacher.path", distill.teacher)] if distill.teacher else []) \
        + [(f"algorithm.distill.teachers.{tag}.path", t) for tag, t in distill.teachers.items()]
    for where, teacher in named:
        check_same_tokenizer(teacher.path, tokenizer, vocab_width(teacher.path) or width,
                             width, where)
    if distill.dense and width is not None and distill.top_k > width:
        raise ConfigError(f"algorithm.distill.top_k: {distill.top_k} is more than the "
                          f"vocabulary ({width} tokens)")


def vocab_width(path: str) -> int | None:
    """The output width (`vocab_size`) a local model folder's config.json declares."""
    data, _ = read_config(Path(path))
    size = (data or {}).get("vocab_size")
    return size if isinstance(size, int) else None


class RoutedTeacher:
    """Several teachers of on-policy distillation behind the `Teacher` interface: a sample's
    logprobs (or top-k) come from the teacher its prompt row's `tag` names (`algorithm.distill.teachers`;
    None: the default `teacher`). The batch carries each sample's teacher as
    `teacher_route` [B], an index into `names`, set from the trajectories' tags."""

    def __init__(self, teachers: dict[str | None, Reference]):
        self.teachers = teachers
        self.names = list(teachers)
        self.samples = dict.fromkeys(self.names, 0)
        """Samples each teacher scored in the last batch."""

    def routes(self, tags: list[str | None]) -> torch.Tensor:
        """[B] the teacher index of each tag (a tag no teacher takes goes to the default one;
        the rows were checked at start)."""
        index = {name: i for i, name in enumerate(self.names)}
        return torch.tensor([index.get(tag, index.get(None, -1)) for tag in tags],
                            dtype=torch.long)

    def logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        return self._routed(batch, lambda teacher, rows: teacher.logprobs(rows, temperature))

    def top_k(self, batch: TensorDict, k: int, temperature: float = 1.0) -> TensorDict:
        return self._routed(batch, lambda teacher, rows: teacher.top_k(rows, k, temperature))

    def _routed(self, batch: TensorDict, score):
        """`score(teacher, rows)` of each teacher on its own rows, put back in batch order."""
        route = batch["teacher_route"]
        if bool((route < 0).any()):
            raise ValueError("a sample's tag routes to no teacher (rows are checked at start)")
        order, parts = [], []
        for i, name in enumerate(self.names):
            rows = (route == i).nonzero().squeeze(-1)
            self.samples[name] = len(rows)
            if len(rows):
                order.append(rows)
                parts.append(score(self.teachers[name], batch[rows]))
        scored = torch.cat(parts)  # every row routes to one teacher: a permutation of the batch
        return scored[torch.cat(order).argsort().to(scored.device)]


def teacher_spec(c: RLConfig, plan: Plan, teacher, tag: str | None = None) -> WorkerSpec:
    """A teacher of on-policy distillation (the one of rows tagged `tag`, None: the default): a
    reference worker over the teacher's weights, on the reference's device (`executor: ray`: in
    Ray actors placed as `distributed.reference`, named `...-teacher-<tag>-<rank>`)."""
    return WorkerSpec(ReferenceWorker, dict(model_path=teacher.path, dtype=teacher.dtype,
                                            micro_batch_size=c.train.micro_batch_size,
                                            attn_implementation=c.model.attn_implementation,
                                            device=plan["reference"].device,
                                            autocast_bf16=plan["reference"].autocast_bf16),
                      role="teacher" if tag is None else f"teacher-{tag}")


def _local_roles(c: RLConfig, total_steps: int, pad_token_id: int, plan: Plan) -> Roles:
    if colocated_with_policy(c.distributed, "rollout"):
        # Taking turns needs the worker's offload()/reload(); numerically the same strategy.
        policy = PolicyGroup(Cluster(policy_spec(c, total_steps, plan), 1, LocalExecutor()))
    else:
        policy = LocalStrategy(load_model(c.model.path, c.model.dtype, c.model.attn_implementation,
                                          c.model.dropout), c.optimizer, c.train,
                               total_steps, plan["policy"].device, plan["policy"].autocast_bf16,
                               c.model.lora)
    # The reference model exists only when a KL term needs it, the critic only for gae.
    reference = None
    if c.algorithm.kl.coef:
        reference = AdapterOffReference(policy) if c.model.lora else \
            ReferenceGroup(Cluster(reference_spec(c, plan), 1, LocalExecutor()))
    critic = LocalCritic(c.algorithm.critic, c.model.path, c.model.dtype, c.optimizer, c.train,
                    total_steps, plan["critic"].device, plan["critic"].autocast_bf16) \
        if c.algorithm.critic else None
    engine = _local_engine(c, pad_token_id, plan)
    teacher = teachers(c, plan, lambda spec: Cluster(spec, 1, LocalExecutor()))
    # An engine actor fed by an in-process policy packs the weights itself (ActorEngine).
    lora_sync = c.model.lora.sync if c.model.lora else None
    return Roles(policy, reference, critic, engine, [], InProcessSync(policy, engine, lora_sync),
                 lora_sync, teacher)


def _local_engine(c: RLConfig, pad_token_id: int, plan: Plan) -> Engine:
    """The rollout engine in this process, or with `scheduler.engine_process` in a Ray actor of
    its own with 1 CPU, so that it runs beside the trainer."""
    scheduler = c.scheduler
    if scheduler.engine_process:
        return start_engine_actor(rollout_engine_factory(c, pad_token_id, plan), num_cpus=1,
                                  num_threads=scheduler.engine_threads)
    return rollout_engine_factory(c, pad_token_id, plan)()


def ray_role_names(c: RLConfig) -> tuple[str, ...]:
    """The roles a Ray run builds: the reference only for a KL term (not with LoRA: the policy's
    own adapter-off model is its reference), a teacher for each of on-policy distillation's
    (placed as `distributed.reference`), the critic only for gae, the reward and env roles only
    when `distributed.reward` / `distributed.env` place them."""
    own_reference = bool(c.algorithm.kl.coef) and c.model.lora is None
    distill = c.algorithm.distill
    return ("policy", "rollout") + (("reference",) if own_reference else ()) \
        + ("teacher",) * (len(distill.names()) if distill is not None else 0) \
        + (("critic",) if c.algorithm.critic else ()) \
        + (("reward",) if c.distributed.reward is not None else ()) \
        + (("env",) if c.distributed.env is not None else ())


def remote_reward(c: RLConfig, factory: Callable[[], RewardFn]) -> RewardFn | None:
    """With `distributed.reward` set (executor ray), the reward function in Ray actors placed
    there, each built by `factory`; else None (the task builds the reward in this process).
    With `distributed.reward.serve`, a Ray Serve deployment with autoscaling replicas instead of
    a fixed number of actors."""
    d = c.distributed
    if d.executor != "ray" or d.reward is None:
        return None
    ensure_ray(d.ray_address, d.num_cpus)
    if isinstance(c.reward, JudgeReward):
        # a bad folder: a ConfigError here, not in an actor
        load_tokenizer(c.reward.model, field="reward.model")
    options = role_options(d, ray_role_names(c), "reward")
    if d.reward.serve is not None:
        return start_reward_service(factory, d.reward.serve, options[0],
                                    num_threads=d.reward.num_threads,
                                    app=f"reroll-{c.name}-reward")
    return start_reward_actors(factory, options,
                               num_threads=d.reward.num_threads,
                               name_prefix=f"reroll-{c.name}")


def remote_envs(c, factory: Callable[[], Any]) -> RemoteEnvs | None:
    """With `distributed.env` set (executor ray, agentic runs), environments built by `factory`
    in Ray actors placed there (`.make()` is the episodes' `make_env`); else None (episodes step
    their environments in threads of this process)."""
    d = c.distributed
    if d.executor != "ray" or d.env is None:
        return None
    ensure_ray(d.ray_address, d.num_cpus)
    return start_env_hosts(factory, role_options(d, ray_role_names(c), "env"),
                           num_threads=d.env.num_threads, name_prefix=f"reroll-{c.name}")


def _ray_roles(c: RLConfig, total_steps: int, pad_token_id: int, plan: Plan) -> Roles:
    d = c.distributed
    ensure_ray(d.ray_address, d.num_cpus)
    wanted = tuple(r for r in ray_role_names(c) if r not in ("reward", "env"))  # the task's own
    own_reference = "reference" in wanted
    options = ray_options(d, wanted)
    prefix = f"reroll-{c.name}"

    def cluster(spec: WorkerSpec, role: str) -> Cluster:
        placement = placement_config(d, role)
        executor = RayExecutor(options[role], placement.num_threads
                               if not placement.colocate_with else d.policy.num_threads,
                               name_prefix=prefix)
        return Cluster(spec, len(options[role]), executor)

    policy = PolicyGroup(cluster(policy_spec(c, total_steps, plan), "policy"))
    colocate_on_node(options, d, policy.cluster.executor.node_ids()[0])
    clusters = [policy.cluster]
    reference = critic = None
    if own_reference:
        reference = ReferenceGroup(cluster(reference_spec(c, plan), "reference"))
        clusters.append(reference.cluster)
    elif c.algorithm.kl.coef:  # a LoRA policy: its base model, adapter off
        reference = AdapterOffReference(policy)
    if c.algorithm.critic:
        critic = CriticProxy(cluster(critic_spec(c, total_steps, plan), "critic"))
        clusters.append(critic.cluster)
    # One engine actor per rollout worker (on its node or device); several behind one pool.
    delta = DeltaPolicy(full_every=d.full_sync_every) if d.weight_sync == "delta" else None
    engines = [start_engine_actor(rollout_engine_factory(c, pad_token_id, plan),
                                  num_cpus=rollout["num_cpus"], num_threads=d.rollout.num_threads,
                                  name=f"{prefix}-rollout-{rank}", ray_options=rollout,
                                  delta=delta)
               for rank, rollout in enumerate(options["rollout"])]
    engine = engines[0] if len(engines) == 1 else EnginePool(engines)

    def teacher_cluster(spec: WorkerSpec) -> Cluster:
        clusters.append(cluster(spec, "teacher"))  # shut down with the other roles
        return clusters[-1]

    teacher = teachers(c, plan, teacher_cluster)
    lora_sync = c.model.lora.sync if c.model.lora else None
    return Roles(policy, reference, critic, engine, clusters,
                 actor_weight_sync(policy, engine, d, lora_sync), lora_sync, teacher)
