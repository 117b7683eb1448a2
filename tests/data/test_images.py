"""Prompt rows with images: the built-in counting task, image paths resolved and checked at
load (a missing or unreadable one named by file and line), and the tiny VLM's image path from
the row to the engine and the trainer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from reroll.config.errors import ConfigError
from reroll.data.datasets import load_prompts
from reroll.data.images import write_count_task

pytestmark = pytest.mark.unit


def red_squares(path: str) -> int:
    pixels = np.asarray(Image.open(path).convert("RGB"))
    return int((pixels == [255, 0, 0]).all(-1).sum()) // 100  # 10x10 squares


def test_the_counting_task_s_answer_is_in_its_image(tmp_path):
    paths = write_count_task(tmp_path / "task", train_size=12, eval_size=4, seed=0)
    rows = load_prompts(paths["train"])
    assert len(rows) == 12 and all(row.has_images for row in rows)
    assert {row.answer for row in rows} <= {"1", "2", "3", "4"}
    for row in rows:
        image = row.messages[0]["content"][0]["image"]  # made absolute against the file
        assert image.startswith(str(tmp_path)) and red_squares(image) == int(row.answer)
        assert row.prompt_text.startswith("<image>How many red squares")



def test_a_text_only_model_is_at_chance_on_the_counting_task(tmp_path):
    """Every row's text is the same question, so a model that does not see the image gives every
    row the same answer distribution: its expected accuracy is at most the share of the most
    frequent answer, about 1 in 4."""
    rows = load_prompts(write_count_task(tmp_path, train_size=400, eval_size=1, seed=0)["train"])
    assert len({row.prompt_text for row in rows}) == 1
    shares = [sum(row.answer == a for row in rows) / len(rows) for a in ("1", "2", "3", "4")]
    assert max(shares) < 0.3, shares


def test_make_data_blank_images_writes_the_same_rows_with_white_images(tmp_path, capsys):
    """The demo's ablation: the same rows and answers, the answer no longer in the image."""
    from reroll.cli import main

    for folder, flags in (("task", []), ("blank", ["--blank-images"])):
        assert main(["make-data", "--images", *flags, "--out", str(tmp_path / folder),
                     "--train-size", "6", "--eval-size", "2"]) == 0
    for split in ("train", "eval"):
        rows = (tmp_path / "task" / f"{split}.jsonl").read_text()
        assert (tmp_path / "blank" / f"{split}.jsonl").read_text() == rows
    white = [(64 * 64, (255, 255, 255))]
    assert all(Image.open(p).getcolors() == white for p in (tmp_path / "blank").glob("images/*"))
    assert not any(Image.open(p).getcolors() == white for p in (tmp_path / "task").glob("images/*"))
    assert main(["make-data", "--blank-images", "--out", str(tmp_path / "text")]) == 2
    assert "--blank-images goes with --images" in capsys.readouterr().err


@pytest.mark.parametrize("damage, said", [("missing", "does not exist"),
                                          ("unreadable", "cannot be read")])
def test_a_bad_image_is_named_by_file_and_line(tmp_path, damage, said):
    paths = write_count_task(tmp_path, train_size=3, eval_size=1, seed=0)
    second = json.loads(paths["train"].read_text().splitlines()[1])["messages"][0]["content"][0]
    image = tmp_path / second["image"]
    if damage == "missing":
        image.unlink()
    else:
        image.write_text("not a png")
    with pytest.raises(ConfigError, match=rf"train.jsonl:2: image .*train_1.png {said}"):
        load_prompts(paths["train"])


def test_an_unknown_content_part_is_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": "x.wav"}]}]}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: a content part must be"):
        load_prompts(path)


def test_a_text_only_model_refuses_image_rows(tmp_path, tokenizer):
    from reroll.rollout.stream import encode_prompt

    row = load_prompts(write_count_task(tmp_path, 1, 1, seed=0)["train"])[0]
    with pytest.raises(ConfigError, match="train.jsonl:1: the row has images.*no image processor"):
        encode_prompt(tokenizer, row, 1024)


@pytest.mark.e2e
def test_the_tiny_vlm_samples_from_images_and_its_logprobs_follow_them(tiny_vlm, tmp_path):
    """check-model's image checks on `make-model --vlm`: the HF engine's and the trainer's
    logprobs agree on image prompts, and another image changes them."""
    from reroll.check_model import ModelChecks
    from reroll.models.loading import load_tokenizer
    from reroll.rollout.stream import EncodedPrompt, encode_prompt

    row = load_prompts(write_count_task(tmp_path, 1, 1, seed=0)["train"])[0]
    prompt = encode_prompt(load_tokenizer(tiny_vlm), row, 1024)
    assert isinstance(prompt, EncodedPrompt) and prompt.model_inputs["pixel_values"].dim() == 5
    checks = ModelChecks(tiny_vlm, tokens=6)
    status, detail = checks.check_image_logprobs()
    assert status == "pass", detail
    status, detail = checks.check_image_sensitivity()
    assert status == "pass", detail
    assert torch.is_tensor(prompt.model_inputs["pixel_attention_mask"])


@pytest.mark.e2e
def test_grpo_runs_on_the_tiny_vlm_with_its_images_in_every_forward(tiny_vlm, tmp_path):
    """Two GRPO steps on the counting task: the engine's and the trainer's logprobs agree (the
    trainer's forward got the same pixels: without them its logprobs would part from the
    engine's), the update has a gradient, and the checkpoint keeps the image processor."""
    import reroll

    paths = write_count_task(tmp_path / "task", train_size=8, eval_size=2, seed=0)
    summary = reroll.train(
        {"name": "vlm", "seed": 0, "steps": 2, "output_dir": str(tmp_path / "run"),
         "model": {"path": tiny_vlm},
         "data": {"train": str(paths["train"]), "eval": str(paths["eval"])},
         "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
         "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 4},
         "tracking": {"progress": False, "tensorboard": False}},
        reward_funcs=lambda s: float(len(s.response) % 3))  # varies: a gradient every step
    history = summary.history()
    assert summary.steps == 2 and all(row["train/grad_norm"] > 0 for row in history)
    assert all(row["actor/behaviour_kl_k3"] < 1e-5 for row in history)
    assert (summary.final_checkpoint / "processor_config.json").is_file()
    # The rollout files name each prompt's images (`reroll view` shows them beside the text).
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert rows and all(len(row["images"]) == 1 and row["images"][0].endswith(".png")
                        for row in rows)


def big_image_task(tmp_path):
    """A one-row image task whose image is 200x100 (20000 pixels)."""
    Image.new("RGB", (200, 100), "white").save(tmp_path / "big.png")
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image", "image": name}, {"type": "text", "text": "How many?"}]}],
        "answer": "1"}) for name in ("big.png", "big.png")) + "\n")
    return path


def test_an_oversize_image_is_scaled_down_with_its_aspect_kept(tmp_path):
    from reroll.data.images import fitted_size, limit_images, load_images

    rows = load_prompts(big_image_task(tmp_path))
    limit_images("data.train", rows, 5000, "resize")
    assert [image.size for image in load_images(rows[1].messages)] == [(100, 50)]
    assert fitted_size((200, 100), 20000) == (200, 100)  # at the limit: unchanged
    fresh = load_prompts(big_image_task(tmp_path))
    limit_images("data.train", fresh, None, "refuse")  # no limit: nothing refused or changed
    assert [image.size for image in load_images(fresh[0].messages)] == [(200, 100)]


def test_an_oversize_image_is_refused_by_file_and_line(tmp_path):
    from reroll.data.images import limit_images

    rows = load_prompts(big_image_task(tmp_path))
    with pytest.raises(ConfigError, match=r"train.jsonl:1: image .*big.png is 200x100 = 20000 "
                                          r"pixels, over data.max_image_pixels=19999"):
        limit_images("data.train", rows, 19999, "refuse")


def test_the_image_limit_is_validated(tmp_path):
    from pydantic import ValidationError

    from reroll.config.schema import DataConfig

    assert DataConfig(train="t.jsonl").max_image_pixels is None
    for bad in ({"max_image_pixels": 0}, {"oversize_images": "crop"}):
        with pytest.raises(ValidationError):
            DataConfig(train="t.jsonl", **bad)


@pytest.mark.e2e
def test_train_refuses_an_oversize_image_with_exit_2(tiny_vlm, tmp_path, capsys):
    """`reroll train` with `oversize_images: refuse` stops before the model loads."""
    import yaml

    from reroll.cli import main

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "model": {"path": tiny_vlm}, "steps": 1,
        "data": {"train": str(big_image_task(tmp_path)), "max_image_pixels": 4096,
                 "oversize_images": "refuse"}}))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl:1: image" in err and "max_image_pixels=4096" in err


def qwen2_vl_config(folder) -> str:
    """A Qwen2-VL model folder's config.json alone: an architecture vLLM is not given image
    prompts of (the check reads the config before any model loads)."""
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig()
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    config.save_pretrained(folder)
    return str(folder)


def test_what_does_not_take_images_is_checked_on_the_splits_it_reads(tmp_path, tiny_vlm):
    """The vLLM engine samples every split; dense distillation trains on the training split
    only; text rows pass whatever the settings (a VLM's text prompts too). The critic takes
    image rows (its value model reads the images, tests/pipelines/test_critic.py). vLLM takes
    the image prompts of an Idefics3 (tests/engines/test_vllm_vlm.py), not of other
    architectures, nor with a LoRA adapter synced alone."""
    from reroll.config.schema import RLConfig
    from reroll.pipelines.validation import check_image_support

    images = load_prompts(write_count_task(tmp_path, 2, 1, seed=0)["train"])
    (tmp_path / "text.jsonl").write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    text = load_prompts(tmp_path / "text.jsonl")

    def config(model: str | dict = "m", **values):
        model = model if isinstance(model, dict) else {"path": model}
        return RLConfig(model=model, data={"train": "t.jsonl"}, steps=1, **values)

    vllm = config(qwen2_vl_config(tmp_path / "qwen2-vl"), rollout={"engine": "vllm"})
    check_image_support(config(tiny_vlm, rollout={"engine": "vllm"}), "data.train", images,
                        train=True)
    check_image_support(config({"path": tiny_vlm, "lora": {"sync": "merged"}},
                               rollout={"engine": "vllm"}), "data.train", images, train=True)
    with pytest.raises(ConfigError, match=r"model.lora.sync: auto, is not checked on vLLM's "):
        check_image_support(config({"path": tiny_vlm, "lora": {}}, rollout={"engine": "vllm"}),
                            "data.train", images, train=True)
    lend = config(rollout={"serving_endpoint": {"url": "http://127.0.0.1:9/v1",
                                                "ttft_p99_s": 1, "tpot_p99_s": 1}})
    critic = config(algorithm={"advantage": {"name": "gae"}, "critic": {}})
    dense = config(algorithm={"distill": {"mode": "dense", "teacher": {"path": "t"}}})
    for c in (vllm, lend, critic, dense):
        check_image_support(c, "data.train", text, train=True)
    with pytest.raises(ConfigError, match=r"rollout.engine: vllm .* \(data.eval holds images, "
                                          r"e.g. .*train.jsonl:1; vLLM's image path is checked "
                                          r"against the trainer's logprobs for "
                                          r"Idefics3ForConditionalGeneration only\); use "
                                          r"rollout.engine: hf"):
        check_image_support(vllm, "data.eval", images, train=False)
    with pytest.raises(ConfigError, match=r"^rollout.serving_endpoint: a serving endpoint does "
                                          r"not take image prompts yet \(data.eval holds"):
        check_image_support(lend, "data.eval", images, train=False)
    check_image_support(critic, "data.train", images, train=True)
    check_image_support(dense, "data.eval", images, train=False)
    with pytest.raises(ConfigError, match=r"^algorithm.distill.mode: dense does not take image "):
        check_image_support(dense, "data.train", images, train=True)


def test_a_text_only_critic_model_is_refused_on_image_rows(tmp_path, tiny_model, tiny_vlm):
    """Its value head would score the image rows' tokens without their pixels, silently; a
    vision-language critic model passes, and so does a text-only one on text rows."""
    from reroll.config.schema import RLConfig
    from reroll.pipelines.validation import check_image_support

    images = load_prompts(write_count_task(tmp_path, 2, 1, seed=0)["train"])
    (tmp_path / "text.jsonl").write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")

    def config(critic_model: str) -> RLConfig:
        return RLConfig(model={"path": tiny_vlm}, data={"train": "t.jsonl"}, steps=1,
                        algorithm={"advantage": {"name": "gae"},
                                   "critic": {"model_path": critic_model}})

    check_image_support(config(tiny_vlm), "data.train", images, train=True)
    check_image_support(config(tiny_model), "data.train",
                        load_prompts(tmp_path / "text.jsonl"), train=True)
    with pytest.raises(ConfigError, match=r"^algorithm.critic.model_path: .* is a text-only "
                                          r"model and data.train holds images, e.g. "):
        check_image_support(config(tiny_model), "data.train", images, train=True)


def test_a_domain_with_images_is_refused_by_its_name(tmp_path, tokenizer):
    from reroll.config.schema import RLConfig
    from reroll.pipelines.domains import build_domain

    path = str(write_count_task(tmp_path, 2, 1, seed=0)["train"])
    c = RLConfig(steps=1, model={"path": qwen2_vl_config(tmp_path / "qwen2-vl")},
                 rollout={"engine": "vllm"}, data={"domains": [{"name": "count", "train": path}]})
    with pytest.raises(ConfigError, match=r"rollout.engine: vllm does not take these image "
                                          r"prompts yet \(data.domains\[0\] \(count\).train holds"):
        build_domain(c, tokenizer, 0, c.data.domains[0])


def test_the_remote_engine_refuses_model_inputs_rather_than_drop_them():
    """The completions API takes token ids alone: sending the prompt without its pixels would
    sample from the text alone, silently."""
    import asyncio

    from reroll.engines.base import Request, SamplingParams
    from reroll.engines.remote import RemoteEngine

    engine = RemoteEngine(["http://127.0.0.1:9/v1"])  # never reached: refused before a request
    try:
        request = Request([1, 2, 3], SamplingParams(4),
                          model_inputs={"pixel_values": torch.zeros(1, 1, 3, 8, 8)})
        with pytest.raises(ValueError, match="remote engine does not take image"):
            asyncio.run(engine.generate(request))
    finally:
        engine.close()


@pytest.mark.e2e
@pytest.mark.vllm
def test_eval_with_vllm_on_image_prompts_scores_as_the_hf_engine(tiny_vlm, tmp_path):
    """`reroll eval --engine vllm` on a VLM's image task: vLLM is given the images (the
    tiny VLM is an Idefics3, docs/vlm.md), through the rollout scheduler's requests, and
    answers each as the HF engine does (greedy; tests/engines/test_vllm_vlm.py checks that its
    logprobs follow the image)."""
    from reroll.cli import main

    task = write_count_task(tmp_path / "task", train_size=1, eval_size=8, seed=0)["eval"]
    answers = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / f"{engine}.json"
        assert main(["eval", "--model", tiny_vlm, "--task", str(task), "--engine", engine,
                     "--max-new-tokens", "6", "--out", str(out)]) == 0
        rows = [json.loads(line) for line in
                out.with_suffix(".samples.jsonl").read_text().splitlines()]
        assert len(rows) == 8 and all(row["images"] for row in rows)
        answers[engine] = [row["response"] for row in rows]
    assert answers["vllm"] == answers["hf"]


@pytest.mark.e2e
@pytest.mark.parametrize("setting, said", [
    ({"rollout": {"engine": "vllm"}, "model": {"path": "TINY_VLM", "lora": {"rank": 4}}},
     "rollout.engine: vllm does not take these image prompts yet (data.train holds images, "
     "e.g. "),
    ({"algorithm": {"distill": {"mode": "dense", "teacher": {"path": "TINY_VLM"}}}},
     "algorithm.distill.mode: dense does not take image prompts yet (data.train holds images, "
     "e.g. "),
], ids=["vllm_lora_adapter", "dense_distill"])
def test_train_refuses_what_does_not_take_images_at_start(tiny_vlm, tmp_path, capsys, setting,
                                                          said):
    """What does not take image prompts yet is refused before any model loads, with one message
    naming the field and the data, and exit 2: not a NotImplementedError mid-run."""
    import yaml

    from reroll.cli import main

    paths = write_count_task(tmp_path / "task", train_size=2, eval_size=1, seed=0)
    config = tmp_path / "config.yaml"
    run = tmp_path / "run"
    config.write_text(yaml.safe_dump({
        "output_dir": str(run), "model": {"path": tiny_vlm}, "steps": 1,
        "data": {"train": str(paths["train"])},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        **setting}).replace("TINY_VLM", tiny_vlm))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert said + f"{paths['train']}:1" in err, err
    assert "Traceback" not in err and "NotImplementedError" not in err
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
