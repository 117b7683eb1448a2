"""SFT: token cross-entropy on response tokens, the prompt masked out.

The same step with another loss (offline distillation's teacher: `pipelines/distill.py`) is built
with `make_loss`: it makes each batch's loss, adds its metrics and keeps its state in checkpoints.
The loop is `reroll.pipelines.run`, every pipeline's.

A row is `prompt` + a target response (the field named by `data.response_key`), or `messages`
ending with the assistant's message. The response is tokenised on its own after the templated
prompt and closed with EOS, exactly the token sequence the RL engine later generates. A
multi-turn `messages` row (several assistant turns, tool calls and results, a `tools` column)
trains every assistant turn, the rest masked (`reroll.data.multiturn`). A prompt with images
(`{"type": "image"}` parts) goes through the model's processor as an RL prompt does
(`encode_prompt`): its pixel values travel with the example to the loss's forward, and the
checkpoints keep the processor, so an RL run can start from them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from reroll.config.errors import ConfigError
from reroll.config.schema import SFTConfig
from reroll.data.batch import Trajectory, collate
from reroll.data.datasets import PromptRow, load_prompts
from reroll.data.images import image_parts
from reroll.data.multiturn import is_multi_turn, is_tool_conversation, multi_turn_example
from reroll.models.devices import machine_devices, trainer_device
from reroll.models.loading import load_model, load_tokenizer
from reroll.models.logprobs import batched_logprobs
from reroll.pipelines import objective, run
from reroll.pipelines.common import UpdateGuard
from reroll.pipelines.inputs import TaskInputs
from reroll.pipelines.task import held_out
from reroll.pipelines.validation import check_max_tokens
from reroll.rollout.stream import EncodedPrompt, encode_prompt, save_processor
from reroll.training.local import LocalStrategy


def sft_example(tokenizer, row: PromptRow, response_key: str, max_tokens: int,
                train_turns: str = "auto") -> Trajectory:
    """`train_turns` (`data.train_turns`): which assistant turns of a `messages` row train."""
    tools = row.metadata.get("tools")
    multi = train_turns == "all" or (train_turns == "auto" and is_tool_conversation(
        row.messages, tools))
    if row.messages[-1]["role"] == "assistant" and multi and is_multi_turn(row.messages, tools):
        if row.has_images:
            raise ConfigError(f"{row.source}: a multi-turn row with images is not trained yet; "
                              f"give the images in a row with one final assistant message")
        return multi_turn_example(tokenizer, row.messages, tools, max_tokens, row.source)
    if row.messages[-1]["role"] == "assistant":
        prompt_row = PromptRow(row.messages[:-1], None, source=row.source)
        target = row.messages[-1]["content"]
        if not isinstance(target, str):
            raise ConfigError(f"{row.source}: the last assistant message's content (the SFT "
                              f"target) must be a string")
    else:
        prompt_row, target = row, row.metadata.get(response_key, row.answer)
        if not isinstance(target, str) or not target:
            raise ConfigError(f"{row.source}: needs a string `{response_key}` (the SFT target) or "
                              f"`messages` ending with an assistant message")
    prompt = EncodedPrompt.of(encode_prompt(tokenizer, prompt_row, max_tokens))
    response_ids = tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]
    if len(prompt.ids) + len(response_ids) > max_tokens:
        raise ConfigError(f"{row.source}: {len(prompt.ids) + len(response_ids)} tokens, over "
                          f"data.max_tokens={max_tokens}")
    return Trajectory(prompt.ids, response_ids, [0.0] * len(response_ids), "stop", group_id=0,
                      model_inputs=prompt.model_inputs or None,
                      images=[part["image"] for part in image_parts(prompt_row.messages)] or None)


class SFTStep:
    """The SFT run's step (`reroll.pipelines.run.Step`): the next rows of the shuffled data, one
    optimizer step on their response tokens. `loss`: what replaces plain cross-entropy
    (offline distillation's `distill.TeacherLoss`): its `loss(batch)`, `metrics()`,
    `state_dict()`, `load_state_dict()` and `label`."""

    start_row = False
    phase = "training"
    eval_every = 0  # the held-out NLL before the first and after the last step

    def __init__(self, config: SFTConfig, place, run_dir: Path, make_loss=None):
        """`place`: the trainer's device and precision; `make_loss(config, tokenizer, model)`."""
        self.config = c = config
        self.tokenizer = load_tokenizer(c.model.path)
        self.train_set = self.read(c.data.train)
        self.eval_set = self.read(c.data.eval) if c.data.eval else []
        self.eval_what = held_out(len(self.eval_set), "row") if self.eval_set else ""
        self.steps = c.total_steps(len(self.train_set))
        model = load_model(c.model.path, c.model.dtype, c.model.attn_implementation,
                           c.model.dropout)
        self.policy = LocalStrategy(model, c.optimizer, c.train, total_steps=self.steps,
                                    device=place.device, autocast_bf16=place.autocast_bf16,
                                    lora=c.model.lora)
        self.loss = make_loss(c, self.tokenizer, model) if make_loss is not None else None
        self.label = self.loss.label if self.loss is not None else "SFT"
        self.order: list[int] = []  # the rest of the current pass over the data
        self.data_rng = random.Random(c.seed)
        self.guard = UpdateGuard(c.train.max_skipped_updates)

    def read(self, path: str) -> list[Trajectory]:
        d = self.config.data
        return load_prompts(path, d.system_prompt, lambda row: sft_example(
            self.tokenizer, row, d.response_key, d.max_tokens, d.train_turns))

    def next_batch(self, step: int) -> TensorDict:
        """The next `batch_size` rows of the shuffled data, reshuffled at each pass."""
        size = self.config.batch_size
        while len(self.order) < size:
            epoch = list(range(len(self.train_set)))
            self.data_rng.shuffle(epoch)
            self.order += epoch
        taken, self.order = self.order[:size], self.order[size:]
        batch, _ = collate([self.train_set[i] for i in taken], self.tokenizer.pad_token_id)
        return batch

    def train(self, batch: TensorDict, step: int) -> dict[str, float]:
        loss = objective.sft_loss(batch) if self.loss is None else self.loss.loss(batch)
        metrics = self.policy.train_step(batch, loss)
        self.guard.check(step, metrics)
        return metrics | self.guard.metrics() | (self.loss.metrics() if self.loss else {})

    def evaluate(self, step: int) -> dict[str, float]:
        """Mean response-token negative log-likelihood on the eval set."""
        batch, _ = collate(self.eval_set, self.tokenizer.pad_token_id)
        logprobs = batched_logprobs(self.policy.model, batch["input_ids"], batch["attention_mask"],
                                    self.config.train.micro_batch_size,
                                    response_mask=batch["response_mask"],
                                    model_inputs=batch.get("model_inputs"))
        mask = batch["response_mask"]
        return {"eval/nll": float(-(logprobs * mask).sum() / mask.sum())}

    def record(self, step: int, batch: TensorDict) -> None:
        """Nothing is sampled: the data is the record."""

    def status(self, metrics: dict[str, float]) -> str:
        return f"nll {metrics['sft/nll']:.3f}" if "sft/nll" in metrics \
            else f"divergence {metrics['distill/divergence']:.3f}"

    def state_dict(self) -> dict[str, Any]:
        return {"order": list(self.order), "data_rng": self.data_rng.getstate(),
                "step_state": self.loss.state_dict() if self.loss is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order = list(state["order"])
        self.data_rng.setstate(state["data_rng"])
        if self.loss is not None:
            self.loss.load_state_dict(state["step_state"])

    def save(self, directory: Path, state: dict[str, Any]) -> None:
        self.policy.save(directory, state)
        self.tokenizer.save_pretrained(directory)
        save_processor(self.tokenizer.name_or_path, directory)  # a VLM's image processor

    def load(self, directory: Path) -> dict[str, Any]:
        state = self.policy.load(directory)
        if "eval_start" not in state:  # checkpoints of earlier versions kept only the NLL
            state["eval_start"] = {"eval/nll": state.get("eval_nll_start")}
        return state

    def save_final(self, directory: Path) -> dict[str, Any]:
        self.policy.save_model(directory)  # with model.lora: the merged model
        self.tokenizer.save_pretrained(directory)
        save_processor(self.tokenizer.name_or_path, directory)
        return {"final_model": str(directory)}

    def summary_keys(self, start: dict[str, float], end: dict[str, float]) -> dict[str, Any]:
        return {"eval_nll_start": start.get("eval/nll"), "eval_nll_end": end.get("eval/nll")}

    def close(self) -> None:
        """Nothing runs besides this process."""


def sft_step(config: SFTConfig, make_loss=None):
    """The step factory of `pipeline: sft` (`reroll.config.pipelines`); a device this machine
    lacks stops the run here, before its directory is made."""
    place = trainer_device(config.device, config.train.bf16_autocast, *machine_devices())
    check_max_tokens(config)
    return lambda run_dir, inputs: SFTStep(config, place, run_dir, make_loss)


def train_sft(config: SFTConfig, inputs: TaskInputs | None = None) -> dict:
    """Run SFT (`reroll.pipelines.run.train`); resuming a run whose checkpoint is at its last
    step changes nothing. `inputs`: datasets passed as Python objects (`reroll.api.sft`)."""
    return run.train(config, inputs)
