"""Inputs that must be refused before training starts (issue 16, section 6). One table: each
case builds a broken input, runs the real CLI (`cli.main`, in this process, with output captured
at the file-descriptor level so worker processes' output counts too) and expects exit 2, one
message that names the file at fault, and no traceback."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from reroll.cli import main

pytestmark = pytest.mark.unit


def model_copy(tmp: Path, tiny_model: str) -> Path:
    target = tmp / "model"
    shutil.copytree(tiny_model, target)
    return target


def rl_config(tmp: Path, model: str | Path, train: str | Path, **extra) -> str:
    data = {"output_dir": str(tmp / "run"), "steps": 1, "model": {"path": str(model)},
            "data": {"train": str(train)},
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
            "train": {"micro_batch_size": 4}, "eval": {"every_steps": 0},
            "tracking": {"progress": False, "tensorboard": False}}
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp / "rl.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def rows(tmp: Path, lines: list[str | bytes], name: str = "train.jsonl") -> Path:
    path = tmp / name
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


GOOD = [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(8)]


# Each case: (tmp, tiny_model, arithmetic) -> (argv, text the message must contain)
def corrupt_config_json(tmp, tiny, data):
    model = model_copy(tmp, tiny)
    (model / "config.json").write_text('{"model_type": "qwen2", "hidden_size": ')
    return ["train", rl_config(tmp, model, data["eval"])], str(model / "config.json")


def truncated_safetensors(tmp, tiny, data):
    model = model_copy(tmp, tiny)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return ["train", rl_config(tmp, model, data["eval"])], str(weights)


def weights_do_not_match_the_config(tmp, tiny, data):
    model = model_copy(tmp, tiny)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = config["intermediate_size"] * 2
    (model / "config.json").write_text(json.dumps(config))
    return ["train", rl_config(tmp, model, data["eval"])], str(model)


def corrupt_tokenizer_json(tmp, tiny, data):
    model = model_copy(tmp, tiny)
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    return ["train", rl_config(tmp, model, data["eval"])], str(model)


def output_dir_is_a_file(tmp, tiny, data):
    (tmp / "run").write_text("not a directory")
    return ["train", rl_config(tmp, tiny, data["eval"])], str(tmp / "run")


def output_dir_not_writable(tmp, tiny, data):
    return ["train", rl_config(tmp, tiny, data["eval"], output_dir="/proc/self/run")], \
        "/proc/self/run"


def dataset_with_non_utf8_bytes(tmp, tiny, data):
    path = rows(tmp, [GOOD[0], GOOD[1], b'{"prompt": "caf\xe9 \xff", "answer": "1"}', GOOD[2]])
    return ["train", rl_config(tmp, tiny, path)], f"{path}:3"


def corrupt_parquet(tmp, tiny, data):
    path = tmp / "train.parquet"
    path.write_bytes(b"PAR1" + b"\x00garbage" * 50)
    return ["train", rl_config(tmp, tiny, path)], str(path)


def reward_module_with_a_syntax_error(tmp, tiny, data):
    (tmp / "broken_reward_syntax.py").write_text("def score(sample)\n    return 1.0\n")
    config = rl_config(tmp, tiny, data["eval"], reward={
        "type": "custom", "function": "broken_reward_syntax:score"})
    return ["train", config], str(tmp / "broken_reward_syntax.py")


def reward_module_that_raises_at_import(tmp, tiny, data):
    (tmp / "broken_reward_import.py").write_text("import json\nraise RuntimeError('no GPU')\n")
    config = rl_config(tmp, tiny, data["eval"], reward={
        "type": "custom", "function": "broken_reward_import:score"})
    return ["train", config], str(tmp / "broken_reward_import.py")


def advantage_estimator_that_does_not_import(tmp, tiny, data):
    config = rl_config(tmp, tiny, data["eval"], algorithm={"advantage": {
        "name": "custom", "function": "no_such_estimators:centred"}})
    return ["train", config], "algorithm.advantage.function 'no_such_estimators:centred' cannot"


def policy_loss_with_the_wrong_signature(tmp, tiny, data):
    (tmp / "short_loss.py").write_text("def loss(logprobs, advantages):\n    return 0.0, {}\n")
    config = rl_config(tmp, tiny, data["eval"], algorithm={"policy_loss": {
        "name": "custom", "function": "short_loss:loss"}})
    return ["train", config], "algorithm.policy_loss.function 'short_loss:loss' does not fit"


def math_reward_without_an_answer_column(tmp, tiny, data):
    path = rows(tmp, [json.dumps({"prompt": "Say hi."})] * 4)
    return ["train", rl_config(tmp, tiny, path)], f"{path}:1"


def prompt_longer_than_max_prompt_tokens_in_a_late_row(tmp, tiny, data):
    path = rows(tmp, [*GOOD, json.dumps({"prompt": "one two " * 200, "answer": "1"})])
    return ["train", rl_config(tmp, tiny, path)], f"{path}:9"


def prompt_longer_than_the_model_context(tmp, tiny, data):
    path = rows(tmp, [*GOOD[:3], json.dumps({"prompt": "seven " * 3000, "answer": "1"}),
                      *GOOD[3:]])
    config = rl_config(tmp, tiny, path, data={"max_prompt_tokens": 100000})
    return ["train", config], f"{path}:4"


def max_new_tokens_past_the_model_context(tmp, tiny, data):
    path = rows(tmp, GOOD)
    config = rl_config(tmp, tiny, path, rollout={"max_new_tokens": 5000})
    return ["train", config], "rollout.max_new_tokens"


def long_row_in_the_eval_set(tmp, tiny, data):
    path = rows(tmp, [*GOOD, json.dumps({"prompt": "one two " * 200, "answer": "1"})], "e.jsonl")
    config = rl_config(tmp, tiny, data["eval"], data={"eval": str(path)})
    return ["train", config], f"{path}:9"


def missing_model_path_shaped_like_a_hub_id(tmp, tiny, data):
    return ["train", rl_config(tmp, "nosuchorg/nosuchmodel", data["eval"])], \
        "nosuchorg/nosuchmodel"


def sft_dataset_with_non_utf8_bytes(tmp, tiny, data):
    path = rows(tmp, [json.dumps({"prompt": "a", "response": "b"}), b'{"prompt": "\xff"}'])
    config = tmp / "sft.yaml"
    config.write_text(yaml.safe_dump({"pipeline": "sft", "output_dir": str(tmp / "sft"),
                                      "model": {"path": tiny}, "data": {"train": str(path)},
                                      "tracking": {"progress": False, "tensorboard": False}}))
    return ["sft", str(config)], f"{path}:2"


def eval_with_a_corrupt_model_config(tmp, tiny, data):
    model = model_copy(tmp, tiny)
    (model / "config.json").write_text("{")
    return ["eval", "--model", str(model), "--task", data["eval"], "--out",
            str(tmp / "r.json")], str(model / "config.json")


def eval_dataset_with_non_utf8_bytes(tmp, tiny, data):
    path = rows(tmp, [GOOD[0], b'{"prompt": "\xff\xfe", "answer": "1"}'])
    return ["eval", "--model", tiny, "--task", str(path), "--out", str(tmp / "r.json")], \
        f"{path}:2"


def fake_run(tmp: Path) -> Path:
    """A run directory with its config and a recorded batch of step 1."""
    from reroll.data.batch import Trajectory
    from reroll.rollout.recording import batch_path, save_batch

    run = tmp / "run"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 1\n")
    save_batch(batch_path(run, 1), 1, [Trajectory([1, 2], [3], [-0.5], "stop", 0)])
    (run / "metrics.jsonl").write_text('{"step": 1, "train/reward_mean": 0.5}\n')
    return run


def replay_truncated_batch(tmp, tiny, data):
    run = fake_run(tmp)
    batch = run / "rollouts" / "step_1.batch.pt"
    batch.write_bytes(batch.read_bytes()[:100])
    return ["replay", str(run), "--step", "1"], str(batch)


def replay_truncated_metrics(tmp, tiny, data):
    run = fake_run(tmp)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "train/rew')
    return ["replay", str(run), "--step", "1"], f"{run / 'metrics.jsonl'}:2"


def config_yaml_that_does_not_parse(tmp, tiny, data):
    path = tmp / "bad.yaml"
    path.write_text("steps: 1\nmodel: {path: [unclosed\n")
    return ["train", str(path)], str(path)


def dense_distillation_top_k_past_the_vocabulary(tmp, tiny, data):
    config = rl_config(tmp, tiny, data["train"], algorithm={"distill": {
        "teacher": {"path": tiny}, "mode": "dense", "top_k": 4096}})
    return ["train", config], "algorithm.distill.top_k: 4096 is more than the vocabulary"


def judge_model_missing(tmp, tiny, data):
    config = rl_config(tmp, tiny, data["train"], reward={
        "type": "judge", "model": str(tmp / "no-judge"), "template": "{question} {response}",
        "verdict": "choice", "choices": {"yes": 1.0, "no": 0.0}})
    return ["train", config], f"reward.model {tmp / 'no-judge'}: no Hugging Face model there"


def on_policy_teacher_missing(tmp, tiny, data):
    config = rl_config(tmp, tiny, data["train"], algorithm={"distill": {
        "teacher": {"path": str(tmp / "no-teacher")}}})
    return ["train", config], \
        f"algorithm.distill.teacher.path {tmp / 'no-teacher'}: no Hugging Face model there"


def offline_teacher_missing(tmp, tiny, data):
    config = tmp / "distill.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": "distill", "output_dir": str(tmp / "distill"), "model": {"path": tiny},
        "teacher": {"path": str(tmp / "no-teacher")},
        "data": {"train": data["train"], "response_key": "solution"},
        "tracking": {"progress": False, "tensorboard": False}}))
    return ["distill", str(config)], f"teacher.path {tmp / 'no-teacher'}: no Hugging Face model"


def dpo_reference_missing(tmp, tiny, data):
    pairs = rows(tmp, [json.dumps({"prompt": "2 + 2?", "chosen": "4", "rejected": "5"})],
                 "pairs.jsonl")
    config = tmp / "dpo.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": "dpo", "output_dir": str(tmp / "dpo"), "model": {"path": tiny},
        "reference": str(tmp / "no-reference"), "data": {"train": str(pairs)},
        "batch_size": 1, "train": {"micro_batch_size": 2},
        "tracking": {"progress": False, "tensorboard": False}}))
    return ["dpo", str(config)], f"reference {tmp / 'no-reference'}: no Hugging Face model"


def judge_score_pattern_that_is_not_a_regex(tmp, tiny, data):
    config = rl_config(tmp, tiny, data["train"], reward={
        "type": "judge", "model": tiny, "verdict": "score", "score_pattern": "score: ([0-9]"})
    return ["train", config], "reward.score_pattern 'score: ([0-9]': not a valid regular"


def reward_model_without_its_scalar_head(tmp, tiny, data):
    model = model_copy(tmp, tiny)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_labels": 1}))
    return ["train", rl_config(tmp, tiny, data["train"], reward={
        "type": "model", "path": str(model)})], f"reward.path {model}: its scalar head"


def reward_model_without_weights(tmp, tiny, data):
    model = model_copy(tmp, tiny)
    (model / "model.safetensors").unlink()
    return ["train", rl_config(tmp, tiny, data["train"], reward={
        "type": "model", "path": str(model)})], f"reward.path {model}: no weights there"


def config_path_is_a_directory(tmp, tiny, data):
    (tmp / "a-run").mkdir()
    return ["train", str(tmp / "a-run")], f"config file {tmp / 'a-run'}: a directory"


def preference_config(tmp, tiny, pipeline, **extra) -> str:
    pairs = rows(tmp, [json.dumps({"prompt": "2 + 2?", "chosen": "4", "rejected": "5"})],
                 "pairs.jsonl")
    config = tmp / f"{pipeline}.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": pipeline, "output_dir": str(tmp / "run"), "model": {"path": tiny},
        "data": {"train": str(pairs), **extra.pop("data", {})}, "batch_size": 1,
        "train": {"micro_batch_size": 2}, "tracking": {"progress": False, "tensorboard": False},
        **extra}))
    return str(config)


def dpo_max_tokens_past_the_model_context(tmp, tiny, data):
    config = preference_config(tmp, tiny, "dpo", data={"max_tokens": 4096})
    return ["dpo", config], "data.max_tokens=4096 is past the model's context of 1024 tokens"


def rm_max_tokens_past_the_model_context(tmp, tiny, data):
    config = preference_config(tmp, tiny, "rm", data={"max_tokens": 4096})
    return ["rm", config], "data.max_tokens=4096 is past the model's context of 1024 tokens"


def domain_weight_that_is_infinite(tmp, tiny, data):
    config = rl_config(tmp, tiny, data["train"], data={"domains": [
        {"name": "a", "train": data["train"], "weight": float("inf")},
        {"name": "b", "train": data["train"]}]})
    return ["train", config], "data.domains.0.weight: Input should be a finite number"


def lora_alpha_that_is_nan(tmp, tiny, data):
    return ["train", rl_config(tmp, tiny, data["train"]), "model.lora.alpha=nan"], \
        "model.lora.alpha: Input should be a finite number"


def export_merge_under_a_regular_file(tmp, tiny, data):
    (tmp / "notes.txt").write_text("a file")
    return ["export", tiny, "--merge", "--out", str(tmp / "notes.txt" / "merged")], \
        f"--out {tmp / 'notes.txt' / 'merged'}: cannot write there"


def export_merge_where_nothing_can_be_written(tmp, tiny, data):
    return ["export", tiny, "--merge", "--out", "/proc/self/merged"], \
        "--out /proc/self/merged: cannot write there"


def grown_tokenizer(tiny: str, target: Path) -> str:
    """The tiny model's tokenizer with 8 tokens past the model's embedding, saved in `target`;
    returns the start of the message that refuses it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    embedding = json.loads((Path(tiny) / "config.json").read_text())["vocab_size"]
    assert len(tokenizer) == embedding
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(8)])
    tokenizer.save_pretrained(target)
    return f"the tokenizer has {embedding + 8} tokens, more than the {embedding} of the model's"


def tokenizer_longer_than_the_embedding(tmp, tiny, data):
    model = model_copy(tmp, tiny)
    refused = grown_tokenizer(tiny, model)
    return ["train", rl_config(tmp, model, data["train"])], f"model.path {model}: {refused}"


def eval_of_an_adapter_whose_base_has_another_tokenizer(tmp, tiny, data):
    from reroll.config.lora import LoRAConfig
    from reroll.config.schema import OptimizerConfig, TrainConfig
    from reroll.models.loading import load_model
    from reroll.training.local import LocalStrategy

    adapter = tmp / "adapter"
    LocalStrategy(load_model(tiny), OptimizerConfig(), TrainConfig(), total_steps=1,
                  lora=LoRAConfig(rank=2)).save(adapter, {})
    refused = grown_tokenizer(tiny, adapter)  # trained on a base whose tokenizer was longer
    return ["eval", "--model", str(adapter), "--task", data["eval"], "--out",
            str(tmp / "r.json")], f"{adapter}: {refused}"


def dead_judge_endpoint(tmp, tiny, data):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    config = rl_config(tmp, tiny, data["train"], reward={
        "type": "judge", "model": tiny, "engine": {"type": "remote", "endpoints": [url]}})
    return ["train", config], f"reward.engine.endpoints: endpoint(s) unreachable: {url}"


CASES: list[Callable] = [
    corrupt_config_json, truncated_safetensors, weights_do_not_match_the_config,
    corrupt_tokenizer_json, output_dir_is_a_file, output_dir_not_writable,
    dataset_with_non_utf8_bytes, corrupt_parquet, reward_module_with_a_syntax_error,
    reward_module_that_raises_at_import, advantage_estimator_that_does_not_import,
    policy_loss_with_the_wrong_signature, math_reward_without_an_answer_column,
    prompt_longer_than_max_prompt_tokens_in_a_late_row, prompt_longer_than_the_model_context,
    max_new_tokens_past_the_model_context, long_row_in_the_eval_set,
    missing_model_path_shaped_like_a_hub_id, sft_dataset_with_non_utf8_bytes,
    eval_with_a_corrupt_model_config, eval_dataset_with_non_utf8_bytes, replay_truncated_batch,
    replay_truncated_metrics, config_yaml_that_does_not_parse,
    dense_distillation_top_k_past_the_vocabulary, judge_model_missing, on_policy_teacher_missing,
    offline_teacher_missing, dpo_reference_missing,
    # issue 49, the hostile pass
    judge_score_pattern_that_is_not_a_regex, reward_model_without_its_scalar_head,
    reward_model_without_weights, config_path_is_a_directory,
    dpo_max_tokens_past_the_model_context, rm_max_tokens_past_the_model_context,
    domain_weight_that_is_infinite, lora_alpha_that_is_nan, export_merge_under_a_regular_file,
    export_merge_where_nothing_can_be_written, tokenizer_longer_than_the_embedding,
    eval_of_an_adapter_whose_base_has_another_tokenizer, dead_judge_endpoint,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_one_message_and_exit_2(case, tmp_path, tiny_model, arithmetic, capfd,
                                             monkeypatch):
    monkeypatch.chdir(tmp_path)  # custom reward modules import from the working directory
    monkeypatch.delenv("REROLL_ALLOW_HUB", raising=False)
    argv, named = case(tmp_path, tiny_model, arithmetic)
    t0 = time.perf_counter()
    try:
        code = main(argv)
    except BaseException as e:  # noqa: BLE001 - what escapes main() is what the user would see
        pytest.fail(f"{case.__name__}: {type(e).__name__} escaped cli.main: {e}")
    seconds = time.perf_counter() - t0
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert named in err, err[-3000:]  # whole: the message is not wrapped inside a path
    assert seconds < 30, seconds  # refused at start, not after minutes of retries or training
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_hub_ids_are_an_explicit_opt_in(monkeypatch):
    from reroll.config.errors import ConfigError
    from reroll.models.files import check_model_path

    monkeypatch.delenv("REROLL_ALLOW_HUB", raising=False)
    with pytest.raises(ConfigError, match="REROLL_ALLOW_HUB=1"):
        check_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    monkeypatch.setenv("REROLL_ALLOW_HUB", "1")
    check_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")  # left to transformers (network)
    with pytest.raises(ConfigError, match="config.json missing"):
        check_model_path("./not/here")  # a local-looking path is never a hub id


def test_every_row_is_checked_at_load_and_quickly(tokenizer, arithmetic):
    """The whole train set is templated at start-up (batched), so the check costs little."""
    from reroll.data.datasets import load_prompts
    from reroll.pipelines.validation import prompt_lengths
    from reroll.rollout.stream import encode_prompt

    rows = load_prompts(arithmetic["train"])
    t0 = time.perf_counter()
    lengths = prompt_lengths(tokenizer, rows)
    seconds = time.perf_counter() - t0
    assert lengths == [len(encode_prompt(tokenizer, row, 10**6)) for row in rows]
    assert seconds < 5, seconds


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("pipeline", ["sft", "distill", "dpo", "rm"])
def test_device_cuda_without_a_gpu_stops_before_the_run_directory(pipeline, tmp_path, tiny_model,
                                                                  arithmetic, capfd):
    teacher = str(tmp_path / "teacher")  # not read: the device is checked first
    extra = {"teacher": {"path": teacher}} if pipeline == "distill" else {}
    config = tmp_path / f"{pipeline}.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": pipeline, "output_dir": str(tmp_path / "run"), "device": "cuda",
        "model": {"path": tiny_model}, "data": {"train": arithmetic["train"]},
        "train": {"micro_batch_size": 16}, **extra}))
    assert main([pipeline, str(config)]) == 2
    err = capfd.readouterr().err
    assert "device: cuda, but torch sees no CUDA device" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
