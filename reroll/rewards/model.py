"""Reward models: a causal LM with a scalar head (`AutoModelForSequenceClassification`,
`num_labels=1`), as `reroll rm` trains and saves it.

The score of a sequence is the head's output at its last attended token. That is what
transformers' own sequence-classification forward returns for an unpadded sequence; computing it
here from the hidden states makes it independent of the pad token (a tokenizer whose pad is its
EOS would otherwise hide the response's closing EOS).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from reroll.config.errors import ConfigError
from reroll.rewards.base import RewardResult, RewardSample

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def sequence_scores(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """[B] scalar scores of right-padded sequences: the score head at each row's last token."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids).last_hidden_state
    last = attention_mask.long().sum(-1) - 1
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return score_head(model)(hidden[rows, last]).squeeze(-1).float()


def score_head(model: torch.nn.Module) -> torch.nn.Module:
    """The scalar head of a transformers sequence-classification model (`score` for the decoder
    LMs: Llama, Qwen2, Mistral, GPT-2, ...)."""
    head = getattr(model, "score", None)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no `score` head: not a decoder "
                         f"sequence-classification model")
    return head


class ModelRewardFn:
    """`reward: {type: model}`: a reward model's score of (prompt, response).

    Calls are gathered into batches: a call waits until `batch_size` calls are pending or
    `max_wait_s` has passed, then its batch is scored in the model's own thread (one forward,
    torch releasing the GIL), so scoring never blocks the event loop that runs the engines. The
    runner's time limit covers the wait and the forward; a failed forward fails the calls of its
    batch, each counted by the runner."""

    name = "model"

    def __init__(self, path: str, batch_size: int = 16, max_wait_s: float = 0.02,
                 max_tokens: int = 1024, system_prompt: str | None = None, device: str = "cpu"):
        self.model, self.tokenizer = load_reward_model(path)
        self.model.to(device)
        self.device = device
        self.batch_size, self.max_wait_s, self.max_tokens = batch_size, max_wait_s, max_tokens
        self.system_prompt = system_prompt
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="reward-model")
        self.pending: list[tuple[RewardSample, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.batches = 0

    async def __call__(self, sample: RewardSample) -> RewardResult:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((sample, future))
        if len(self.pending) >= self.batch_size:
            self._flush(loop)
        elif self.timer is None:
            self.timer = loop.call_later(self.max_wait_s, self._flush, loop)
        score = await future
        return RewardResult(score, {"reward_model_score": score})

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if not batch:
            return
        self.batches += 1
        work = loop.run_in_executor(self.executor, self.score, [s for s, _ in batch])
        futures = [f for _, f in batch]

        def deliver(done: asyncio.Future) -> None:
            error = done.exception()
            for i, future in enumerate(futures):
                if future.done():  # its call timed out meanwhile
                    continue
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(done.result()[i])

        work.add_done_callback(deliver)

    def encode(self, sample: RewardSample) -> list[int]:
        """Prompt templated as `reroll rm` trained on it, then the response, closed with EOS
        unless it was cut at the length limit; the last `max_tokens` tokens."""
        messages = [{"role": "user", "content": sample.prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        ids += self.tokenizer.encode(sample.response, add_special_tokens=False)
        if sample.finish_reason != "length":
            ids.append(self.tokenizer.eos_token_id)
        return ids[-self.max_tokens:]

    def score(self, samples: list[RewardSample]) -> list[float]:
        """[B] scores of `samples` (one right-padded forward, no gradients)."""
        rows = [self.encode(s) for s in samples]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        with torch.no_grad():
            return sequence_scores(self.model, ids.to(self.device), mask.to(self.device)).tolist()

    def queue_metrics(self) -> dict[str, float]:
        return {"reward/model_batches": float(self.batches)}

    def counter_state(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_counter_state(self, state: dict[str, int]) -> None:
        self.batches = state["batches"]

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def load_reward_model(path: str) -> tuple[torch.nn.Module, object]:
    """The reward model and its tokenizer at `path`; a folder that is not one (no weights, no
    scalar head in them, files that do not load) is a ConfigError."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"reward.path {path}: no Hugging Face model there (config.json "
                          f"missing); train one with `reroll rm` (its run's `final/`)")
    if not any(next(Path(path).glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ConfigError(f"reward.path {path}: no weights there (no *.safetensors or "
                          f"pytorch_model*.bin); train one with `reroll rm`")
    try:
        config = AutoConfig.from_pretrained(path)
        if getattr(config, "num_labels", None) != 1:
            raise ConfigError(f"reward.path {path}: not a reward model (num_labels is "
                              f"{getattr(config, 'num_labels', None)}, expected 1); train one "
                              f"with `reroll rm`")
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - anything from reading the user's files
        detail = (str(e).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"reward.path {path}: cannot load the reward model "
                          f"({type(e).__name__}: {detail})") from None
    head = [k for k in info["missing_keys"] if k.split(".")[0] == "score"]
    if head:  # transformers would initialise it at random: every score would be noise
        raise ConfigError(f"reward.path {path}: its scalar head ({', '.join(sorted(head))}) is "
                          f"not in the weights (a causal LM's folder with num_labels: 1?); "
                          f"train a reward model with `reroll rm`")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer
