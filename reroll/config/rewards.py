"""The `reward:` section of RLVR configs (and of each domain): one typed union told apart by
`type`, each variant with its own settings and limits (docs/rewards.md, docs/preferences.md)."""

from __future__ import annotations

import re
import string
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from reroll.config.base import Section, choice
from reroll.config.engines import EngineConfig, HFEngineConfig


class RewardSection(Section):
    """What every reward type has: when failing calls stop the run."""

    max_failure_rate_step: float = Field(1.0, gt=0, le=1)
    """Stop the run (exit 1) when this share of one step's reward calls failed (errors, time-outs,
    non-finite scores; the step's evaluation included). 1.0: a step where every call failed."""
    max_failure_rate_run: float = Field(0.5, gt=0, le=1)
    """Stop the run (exit 1) when this share of all reward calls since the start failed."""


class MathReward(RewardSection):
    """Correctness checked with math-verify against the row's `answer` (the response's last
    `\\boxed{...}`), plus an optional format bonus."""

    type: Literal["math"] = "math"
    format_weight: float = Field(0.0, ge=0, le=1)
    """Weight of the format reward (a `\\boxed{}` answer present); score = (1-w)*correct + w*format."""
    timeout_s: float = Field(5.0, gt=0)
    """Per-call time limit (the call itself, not the wait for a free worker); a call past it
    scores 0 and counts in `reward/timeouts`."""
    num_workers: int = Field(1, ge=1, le=64)
    """Processes in the reward pool (math-verify uses signals, which fail in threads)."""
    memory_mb: int | None = Field(2048, ge=64)
    """Memory cap of each reward worker process (heap and anonymous mappings, RLIMIT_DATA); an
    allocation past it is a `MemoryError`, counted in `reward/errors` and `reward/memory_errors`.
    None: no cap."""


class CodeReward(RewardSection):
    """Run the response's program against the row's test cases (its `answer`, as JSON) in the
    sandbox; see reroll/rewards/code.py for the accepted test formats."""

    type: Literal["code"] = "code"
    credit: Literal["all_or_nothing", "fractional"] = "all_or_nothing"
    """all_or_nothing: 1.0 only if every test passes; fractional: passed / total."""
    time_limit_s: float = Field(6.0, gt=0, le=600)
    """Per-test wall-clock and CPU limit."""
    max_tests: int | None = Field(None, ge=1)
    """Use at most this many tests per sample (None: all)."""
    timeout_s: float = Field(60.0, gt=0)
    """Limit for the whole call (all tests of one sample)."""


class CustomReward(RewardSection):
    """Your own function, `function(sample) -> float | RewardResult`, given as `module:name`
    (importable from the working directory). Sync functions run in worker processes; `async def`
    ones on an event loop of their own (a thread), so one that blocks cannot stall the run."""

    type: Literal["custom"] = "custom"
    function: str = Field(..., pattern=r"^[\w.]+:[\w.]+$")
    """Import path `package.module:function`."""
    timeout_s: float = Field(10.0, gt=0)
    """Per-call limit, for sync and async functions alike (the call itself, not the wait for a
    free worker); a call past it scores 0 and counts in `reward/timeouts`."""
    num_workers: int = Field(1, ge=1, le=64)
    """Worker processes for a synchronous function."""
    memory_mb: int | None = Field(2048, ge=64)
    """Memory cap of each worker process of a synchronous function (heap and anonymous mappings,
    RLIMIT_DATA); an allocation past it is a `MemoryError`, counted in `reward/errors` and
    `reward/memory_errors`. None: no cap. (An async function runs in this process: no cap.)"""


class PythonReward(RewardSection):
    """Reward functions passed as Python objects to `reroll.train(config, reward_funcs=[...])`
    (docs/python-api.md), recorded here by name. The score is the weighted sum of theirs. A run
    whose functions are all top-level functions of an importable module resumes from the CLI too;
    one with a lambda, a nested function, a callable instance (`name()`) or a function of a script
    run as `__main__` resumes from Python, given the same functions again."""

    type: Literal["python"] = "python"
    functions: list[str] = Field(..., min_length=1)
    """`module:qualname` of each function, in the order given (set by `reroll.train`)."""
    weights: list[float] | None = None
    """Weight of each function in the score (None: 1.0 each)."""
    timeout_s: float = Field(10.0, gt=0)
    """Per-call limit of each function (as `custom`)."""
    num_workers: int = Field(1, ge=1, le=64)
    """Worker processes of each synchronous function."""
    memory_mb: int | None = Field(2048, ge=64)
    """Memory cap of each worker process (as `custom`). None: no cap."""

    @model_validator(mode="after")
    def _weights_match(self) -> PythonReward:
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(f"reward.weights has {len(self.weights)} entries for "
                             f"{len(self.functions)} functions")
        return self


class LearnedReward(RewardSection):
    """A reward computed by a model of its own (a reward model, a judge)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where that model computes: `auto` is CUDA when the process building the reward sees a GPU
    (the run's process with `executor: local`; a reward actor with `distributed.reward`, which
    sees only the GPUs of its `devices`), in bf16 where the GPU has it (a judge; a reward
    model's scores stay float32), else CPU. For a judge, its `hf` engine's: `vllm` places
    itself."""


class ModelReward(LearnedReward):
    """A reward model's score of the response (`reroll rm` trains one): a causal LM with a scalar
    head, loaded as `AutoModelForSequenceClassification` in a thread of its own, scoring the
    calls that arrive together in batches."""

    type: Literal["model"] = "model"
    path: str
    """Folder of the reward model in Hugging Face format (`runs/<rm run>/final`), with its
    tokenizer and chat template: the prompt is templated as `reroll rm` did in training."""
    system_prompt: str | None = None
    """Prepended as a system message, as `data.system_prompt` was when the model was trained."""
    batch_size: int = Field(16, ge=1)
    """Most responses scored in one forward."""
    max_wait_s: float = Field(0.02, ge=0)
    """How long a call waits for others to fill a batch before its batch is scored anyway."""
    max_tokens: int = Field(1024, ge=8)
    """Longer prompt + response sequences keep their last `max_tokens` tokens."""
    timeout_s: float = Field(30.0, gt=0)
    """Per-call limit, the wait for the batch included; a call past it scores 0 and counts in
    `reward/timeouts`."""


JUDGE_TEMPLATE = ("Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
                  "Is the response correct? Answer yes or no.")


class JudgeReward(LearnedReward):
    """A generative judge (an LLM) scores the response: the judge prompt is `template` filled
    with the question, the response and the row's reference `answer`; its reply is parsed into
    a verdict, a score on [`score_min`, `score_max`] or one of `choices`, mapped to a reward in
    the run. The judge runs on a reroll engine of its own (`engine`: a local `hf` model on this
    event loop, a local model in vLLM's own worker process, or `remote` endpoints)."""

    type: Literal["judge"] = "judge"
    model: str
    """Folder of the judge model (Hugging Face format) with its tokenizer and chat template;
    with a `remote` engine, the folder of its tokenizer (the prompt is sent as token ids)."""
    engine: EngineConfig = Field(default_factory=HFEngineConfig)
    """The judge's engine: `hf` (default; the model in this process, decoding between the
    policy engine's steps), `vllm` (the model in vLLM's engine-core process, decoding beside the
    run) or `remote` endpoints
    serving it (`python -m reroll.engines.server`, vLLM's OpenAI server)."""
    max_batch_size: int = Field(64, ge=1)
    """`hf` and `vllm` engines: most judge requests decoded together (vLLM: the smaller of this
    and `engine.max_num_seqs`)."""
    template: str = JUDGE_TEMPLATE
    """The judge prompt (sent as the user message of the judge's chat template); fields
    `{question}`, `{response}` and `{reference}` (the row's `answer`, empty when it has none)."""
    verdict: Literal["choice", "score"] = "choice"
    """`choice`: the first of `choices` the reply names; `score`: a number (see `score_pattern`)
    on [`score_min`, `score_max`], mapped to [0, 1]."""
    choices: dict[str, float] = Field(default_factory=lambda: {"yes": 1.0, "no": 0.0})
    """`verdict: choice`: word -> reward (matched as a whole word, case-insensitive)."""
    score_min: float = 0.0
    """`verdict: score`: the lowest score of the scale (reward 0)."""
    score_max: float = 10.0
    """`verdict: score`: the highest score of the scale (reward 1)."""
    score_pattern: str | None = None
    """`verdict: score`: a regex whose first group is the score (None: the reply's last number)."""
    max_new_tokens: int = Field(32, ge=1)
    """Longest judge reply."""
    temperature: float = Field(0.0, ge=0)
    """Judge sampling temperature (0: greedy; a retry then gets the same reply, so use > 0 when
    `retries` should help)."""
    retries: int = Field(2, ge=0, le=10)
    """Asks again when a reply holds no verdict; past them the call fails (`reward/errors`;
    every unparseable reply counts in `reward/judge_parse_failures`)."""
    cache: bool = True
    """Answer identical judge prompts once (same question, response and reference)."""
    timeout_s: float = Field(60.0, gt=0)
    """Per-call limit (retries included); a call past it scores 0 and counts in
    `reward/timeouts`."""

    @field_validator("choices", mode="before")
    @classmethod
    def _quoted_words(cls, choices: Any) -> Any:
        if isinstance(choices, dict) and any(isinstance(k, bool) for k in choices):
            raise ValueError("YAML reads an unquoted yes/no/on/off/true/false as a boolean: quote "
                             "the choice words, e.g. {'yes': 1.0, 'no': 0.0}")
        return choices

    @model_validator(mode="after")
    def _check_template(self) -> JudgeReward:
        fields = {n for _, n, _, _ in string.Formatter().parse(self.template) if n}
        unknown = fields - {"question", "response", "reference"}
        if unknown or "response" not in fields:
            raise ValueError(f"reward.template: fields are {{question}}, {{response}} (required) "
                             f"and {{reference}}; got {sorted(fields)}")
        if self.score_max <= self.score_min:
            raise ValueError("reward.score_max must be above reward.score_min")
        if self.verdict == "choice" and not self.choices:
            raise ValueError("reward.choices: name at least one choice")
        if self.score_pattern is not None:
            try:
                re.compile(self.score_pattern)
            except re.error as e:  # found here, not at the first judged reply
                raise ValueError(f"reward.score_pattern {self.score_pattern!r}: not a valid "
                                 f"regular expression ({e})") from None
        return self



class RulesReward(RewardSection):
    """Instruction-following checks in the IFEval style (word, sentence and paragraph counts,
    keywords, letter case, JSON or list format, start/end phrases, a language's script), taken
    from each row's `constraints` column and from `checks`; score = the share of checks passed,
    optionally mixed with a `<think>...</think>`-then-answer format reward. The check names and
    their arguments are in docs/multidomain.md (reroll/rewards/rules.py)."""

    type: Literal["rules"] = "rules"
    checks: list[str | dict[str, Any]] = Field(default_factory=list)
    """Checks applied to every prompt besides the row's own: a name (`lowercase`) or
    `{check: NAME, ARG: VALUE}` (`{check: word_count, max: 50}`)."""
    field: str = Field("constraints", min_length=1)
    """The dataset column holding each row's list of checks (same forms as `checks`)."""
    credit: Literal["fractional", "all_or_nothing"] = "fractional"
    """fractional: the share of checks passed; all_or_nothing: 1.0 only if every check passes."""
    format_weight: float = Field(0.0, ge=0, le=1)
    """Weight of the format reward (`<think>` reasoning `</think>` then a non-empty answer);
    score = (1-w)*checks + w*format. The checks read the answer after `</think>`."""
    timeout_s: float = Field(5.0, gt=0)
    """Per-call limit (the checks are pure and fast; this bounds a pathological response)."""


RewardConfig = choice("type", "math", MathReward, CodeReward, CustomReward, PythonReward,
                      ModelReward, JudgeReward, RulesReward)
