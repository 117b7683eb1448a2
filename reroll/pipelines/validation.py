"""Checks of a task's prompts before any model is built: every row, not the ones a step happens
to sample (one long row used to end a run at step 4).

Policy for long prompts: refuse, never truncate. A prompt over `data.max_prompt_tokens`, or one
that with `rollout.max_new_tokens` does not fit the model's context, is a ConfigError naming the
longest such row's file and line, and how many rows are over.

Image prompts are refused at start, not mid-run, by what does not take them yet
(`check_image_support`): the rows are read and their images opened before any model loads, so
whether the data holds images is known exactly, for the cost of a scan of the parsed rows.
"""

from __future__ import annotations

from pathlib import Path

from reroll.config.errors import ConfigError
from reroll.config.schema import RLConfig
from reroll.data.datasets import PromptRow
from reroll.data.images import limit_images
from reroll.models.files import model_context
from reroll.models.loading import is_vision_language
from reroll.rewards.rules import check_rows
from reroll.rollout.stream import encode_prompt

NEEDS_ANSWER = {"math": "the reference answer", "code": "the test cases"}
CHUNK = 256


def check_prompts(config: RLConfig, tokenizer, splits: dict[str, list[PromptRow]]) -> None:
    """`splits` maps a config field (`data.train`) to its rows."""
    context = model_context(config.model.path)
    max_new = config.rollout.max_new_tokens
    if context is not None and max_new >= context:
        raise ConfigError(f"rollout.max_new_tokens={max_new} is past the model's context of "
                          f"{context} tokens ({config.model.path}/config.json)")
    eval_reward = config.eval.reward
    check_teacher_tags(config.algorithm.distill, "data.train", splits.get("data.train", []))
    for field, rows in splits.items():
        # The held-out split is scored by `eval.reward` when the run sets one.
        reward = eval_reward if field == "data.eval" and eval_reward is not None else config.reward
        check_image_support(config, field, rows, train=field == "data.train")
        check_answers(reward.type, field, rows)
        check_rules(reward, rows)
        limit_images(field, rows, config.data.max_image_pixels, config.data.oversize_images)
        lengths = prompt_lengths(tokenizer, rows)
        check_lengths(field, rows, lengths, config.data.max_prompt_tokens, max_new, context)


def check_image_support(config, field: str, rows: list[PromptRow], train: bool) -> None:
    """What does not take image prompts yet refuses rows with images here, at start, rather than
    drop the images or fail mid-run (docs/vlm.md): the vLLM engine and a serving endpoint (every
    split they sample; vLLM takes an Idefics3's, `vllm_image_refusal`), dense on-policy
    distillation and a text-only critic model (the training split). The data decides: a VLM's
    text-only prompts pass."""
    first = next((row for row in rows if row.has_images), None)
    if first is None:
        return
    held = f"{field} holds images, e.g. {first.source}"
    if config.rollout.engine.type == "vllm":
        why = vllm_image_refusal(config.model.path)
        lora = config.model.lora
        if not why and lora is not None and lora.sync != "merged":
            why = (f"a LoRA adapter synced alone, model.lora.sync: {lora.sync}, is not checked "
                   f"on vLLM's image path; model.lora.sync: merged is")
        if why:
            raise ConfigError(f"rollout.engine: vllm does not take these image prompts yet "
                              f"({held}; {why}); use rollout.engine: hf")
    if config.rollout.serving_endpoint is not None:  # lent requests go as token ids alone
        raise ConfigError(f"rollout.serving_endpoint: a serving endpoint does not take image "
                          f"prompts yet ({held}); drop it to generate on the rollout engine")
    if not train:
        return
    critic = config.algorithm.critic
    if critic is not None and critic.model_path and not reads_images(critic.model_path):
        raise ConfigError(f"algorithm.critic.model_path: {critic.model_path} is a text-only model "
                          f"and {held}: its value head would not see the images; use a "
                          f"vision-language model there (or drop model_path for the policy's)")
    distill = config.algorithm.distill
    if distill is not None and distill.mode == "dense":
        raise ConfigError(f"algorithm.distill.mode: dense does not take image prompts yet "
                          f"({held}); use mode: pure or mixed")


def vllm_image_refusal(path: str) -> str:
    """Why the vLLM engine is not given image prompts of the model at `path` ("": it is, or the
    model is text-only or unreadable, which encoding the rows or loading it names)."""
    from reroll.engines.vllm import architecture
    from reroll.engines.vllm import vllm_image_refusal as refusal

    config = _saved_config(path)
    if config is None or not is_vision_language(config):
        return ""
    return refusal(architecture(config))


def reads_images(path: str) -> bool:
    """Whether the model saved at `path` is a vision-language one (True without a config.json
    there: loading the model names that problem)."""
    config = _saved_config(path)
    return config is None or is_vision_language(config)


def _saved_config(path: str):
    """The transformers config saved at `path`; None without a config.json there."""
    from transformers import AutoConfig  # deferred: image rows only

    if not (Path(path).expanduser() / "config.json").is_file():
        return None
    return AutoConfig.from_pretrained(path)


def check_max_tokens(config) -> None:
    """`data.max_tokens` of SFT, DPO and RM (prompt + response) within the model's context: a
    longer sequence would be trained on positions the model was never built for."""
    context = model_context(config.model.path)
    if context is not None and config.data.max_tokens > context:
        raise ConfigError(f"data.max_tokens={config.data.max_tokens} is past the model's "
                          f"context of {context} tokens ({config.model.path}/config.json)")


def check_teacher_tags(distill, field: str, rows: list[PromptRow]) -> None:
    """On-policy distillation with `teachers`: a training row's `tag` must name one of them (a
    misspelt tag is refused, not sent to the default teacher); a row without a tag needs the
    default `teacher`."""
    if distill is None or not distill.teachers:
        return
    unknown = [row for row in rows if row.tag is not None and row.tag not in distill.teachers]
    untagged = [] if distill.teacher is not None else [row for row in rows if row.tag is None]
    for bad, what in ((unknown, f"tag {unknown[0].tag!r}" if unknown else ""),
                      (untagged, "no `tag` column")):
        if bad:
            fix = ("fix the tag or add its teacher" if bad is unknown else
                   "tag it, or add algorithm.distill.teacher for untagged rows")
            raise ConfigError(f"{field}: {bad[0].source} has {what}, which names none of "
                              f"algorithm.distill.teachers ({', '.join(distill.teachers)}); "
                              f"{len(bad)} of {len(rows)} rows are like it: {fix}")


def check_answers(reward_type: str, field: str, rows: list[PromptRow]) -> None:
    if reward_type not in NEEDS_ANSWER:
        return
    missing = [row for row in rows if row.answer is None or not str(row.answer).strip()]
    if missing:
        raise ConfigError(f"{field}: reward.type={reward_type} needs an `answer` column "
                          f"({NEEDS_ANSWER[reward_type]}) in every row; {missing[0].source} has "
                          f"none ({len(missing)} of {len(rows)} rows lack it)")


def check_rules(reward, rows: list[PromptRow], where: str = "reward") -> None:
    """A `rules` reward's checks, per row: unknown names or arguments name the file and line."""
    if reward.type == "rules":
        check_rows(rows, reward.field, reward.checks, where)


def check_lengths(field: str, rows: list[PromptRow], lengths: list[int], max_prompt: int,
                  max_new: int, context: int | None) -> None:
    if not rows:
        return
    longest = max(range(len(rows)), key=lengths.__getitem__)
    source, length = rows[longest].source, lengths[longest]
    over = sum(n > max_prompt for n in lengths)
    if over:
        raise ConfigError(f"{field}: {over} prompt(s) are longer than data.max_prompt_tokens="
                          f"{max_prompt} after the chat template; the longest, {source}, has "
                          f"{length} tokens (raise the limit or drop those rows)")
    if context is not None and length + max_new > context:
        over = sum(n + max_new > context for n in lengths)
        raise ConfigError(f"{field}: {over} prompt(s) with rollout.max_new_tokens={max_new} do "
                          f"not fit the model's context of {context} tokens; the longest, "
                          f"{source}, has {length} prompt tokens")


def prompt_lengths(tokenizer, rows: list[PromptRow]) -> list[int]:
    """Templated prompt lengths, as the rollout encodes them (batched: ~10x faster)."""
    lengths: list[int] = []
    for start in range(0, len(rows), CHUNK):
        chunk = rows[start:start + CHUNK]
        encoded = tokenizer.apply_chat_template([row.messages for row in chunk],
                                                add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        if len(ids) != len(chunk) or not all(isinstance(x, list) for x in ids):
            ids = [encode_prompt(tokenizer, row, 1 << 62) for row in chunk]
        lengths += [len(x) for x in ids]
    return lengths


def context_tokens(value: int | None, field: str, model_path: str) -> int:
    """A multi-turn context limit (`env.max_context_tokens`, `agent.max_context_tokens`): the
    model's own context when unset; one past the model's context is a ConfigError (positions
    it was never built for)."""
    model = model_context(model_path)
    if value is None:
        if model is None:
            raise ConfigError(f"{field}: the model {model_path} declares no context length "
                              f"(max_position_embeddings) in a local config.json; set {field}")
        return model
    if model is not None and value > model:
        raise ConfigError(f"{field}: {value} is past the model's context ({model} tokens, "
                          f"max_position_embeddings of {model_path}); set it to at most {model}")
    return value
