"""The judge of `reward: {type: judge}` over a reroll engine: `rewards.judge` knows nothing of
engines (rewards sit below them), so the pipeline builds the engine and hands the reward a
`generate` function (judge prompt text -> reply text)."""

from __future__ import annotations

from functools import partial

from reroll.config.schema import JudgeReward
from reroll.engines import build_engine
from reroll.engines.base import Request, SamplingParams
from reroll.models.loading import load_tokenizer
from reroll.rewards.judge import JudgeRewardFn, parse_choice, parse_score


def judge_parser(config: JudgeReward):
    """The verdict parser `config.verdict` asks for: reply text -> reward."""
    if config.verdict == "score":
        return partial(parse_score, low=config.score_min, high=config.score_max,
                       pattern=config.score_pattern)
    return partial(parse_choice, choices=config.choices)


def build_judge(config: JudgeReward, seed: int = 0) -> JudgeRewardFn:
    """The judge reward: its engine and tokenizer loaded now (a bad `model` folder is a
    ConfigError at start-up), prompts templated with the judge's chat template."""
    tokenizer = load_tokenizer(config.model)
    engine = build_engine(config, config.model, pad_token_id=tokenizer.pad_token_id, seed=seed)
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
