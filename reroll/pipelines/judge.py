"""The rewards that hold a model of their own, built where they run: the judge of `reward:
{type: judge}` over a reroll engine (`rewards.judge` knows nothing of engines: rewards sit below
them, so the pipeline builds the engine and hands the reward a `generate` function, judge
prompt text -> reply text), and the reward model of `reward: {type: model}`, each on the device
`reward.device` resolves to in the process that builds it."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from reroll.config.schema import JudgeReward
from reroll.engines import build_engine
from reroll.engines.base import Request, SamplingParams
from reroll.models.devices import machine_devices, resolve_device
from reroll.models.loading import load_tokenizer
from reroll.rewards import RewardFn, build_reward
from reroll.rewards.judge import JudgeRewardFn, parse_choice, parse_score


def reward_factory(config, seed: int = 0) -> Callable[[], RewardFn]:
    """What builds a `reward:` section's reward, in this process or inside a reward actor: a
    judge (its engine sits above rewards) or a reward model here, on the device of the process
    that calls it; the others by `rewards.build_reward`."""
    if config.type == "judge":
        return partial(build_judge, config, seed)
    if config.type == "model":
        return partial(build_model_reward, config)
    return partial(build_reward, config)


def reward_device(config) -> str:
    """`reward.device` in the process building the reward: `cpu` or `cuda:0`."""
    return resolve_device(config.device, machine_devices()[0], "reward.device")


def build_model_reward(config) -> RewardFn:
    """`reward: {type: model}` on its device."""
    return build_reward(config, device=reward_device(config))


def judge_parser(config: JudgeReward):
    """The verdict parser `config.verdict` asks for: reply text -> reward."""
    if config.verdict == "score":
        return partial(parse_score, low=config.score_min, high=config.score_max,
                       pattern=config.score_pattern)
    return partial(parse_choice, choices=config.choices)


def build_judge(config: JudgeReward, seed: int = 0) -> JudgeRewardFn:
    """The judge reward: its engine and tokenizer loaded now (a bad `model` folder is a
    ConfigError at start-up), prompts templated with the judge's chat template."""
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

    return JudgeRewardFn(generate, config.template, judge_parser(config), config.retries,
                         config.cache, close=engine.close)
