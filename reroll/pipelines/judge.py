"""What the rewards that hold a model of their own need from above the rewards layer, built in
the process where the reward runs: the engine of `reward: {type: judge}` (a reroll engine, local
or `remote`; `rewards.judge` is handed its `generate`, judge prompt text -> reply text), and the
device `reward.device` resolves to there. `rewards.build_reward` builds every reward."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from reroll.config.rewards import JudgeReward, LearnedReward, RewardSection
from reroll.engines import build_engine
from reroll.engines.base import Request, SamplingParams
from reroll.models.devices import machine_devices, resolve_device
from reroll.models.loading import load_tokenizer
from reroll.rewards import RewardFn, build_reward
from reroll.rewards.judge import Generate


def reward_factory(config: RewardSection, seed: int = 0) -> Callable[[], RewardFn]:
    """What builds a `reward:` section's reward, in this process or inside a reward actor (it
    pickles): `rewards.build_reward` with the device and judge engine of the process calling it."""
    return partial(build_here, config, seed)


def build_here(config: RewardSection, seed: int = 0) -> RewardFn:
    """The section's reward built in this process, on this process's device."""
    return build_reward(config, device=reward_device(config),
                        judge_engine=partial(judge_engine, seed=seed))


def reward_device(config: RewardSection) -> str:
    """`reward.device` in the process building the reward: `cpu` or `cuda:0` (`cpu` for the
    rewards that hold no model)."""
    if not isinstance(config, LearnedReward):
        return "cpu"
    return resolve_device(config.device, machine_devices()[0], "reward.device")


def judge_engine(config: JudgeReward, seed: int = 0) -> tuple[Generate, Callable[[], None]]:
    """The judge's engine and tokenizer loaded now (a bad `model` folder is a ConfigError at
    start-up), prompts templated with the judge's chat template: (`generate`, close)."""
    tokenizer = load_tokenizer(config.model, field="reward.model")
    count, bf16 = machine_devices()
    # `reward.device` is the hf engine's; vLLM places itself, a remote judge is elsewhere
    device = resolve_device(config.device, count, "reward.device") \
        if config.engine.type == "hf" else "cpu"
    # bf16 where the GPU computes in it, as the rollout engine's default
    dtype = "bfloat16" if device != "cpu" and bf16 else "float32"
    engine = build_engine(config, config.model, dtype, pad_token_id=tokenizer.pad_token_id,
                          seed=seed, device=device, section="reward")
    params = SamplingParams(config.max_new_tokens, config.temperature,
                            stop_token_ids=(tokenizer.eos_token_id,))

    async def generate(prompt: str, attempt: int) -> str:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        completion = await engine.generate(Request(ids, params, seed=seed * 7919 + attempt))
        return tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    return generate, engine.close
