"""`reroll check-model DIR`: will this model work for RL in reroll?

Each check runs what training relies on, on the model as it is loaded for training (dropout off,
the attention implementation of `model.attn_implementation`):

- load: config, tokenizer and weights read (a broken file is exit 2 naming it, before any check);
- tokenizer: text -> ids -> text round trip, special tokens of the chat template single ids;
- chat_template: renders a conversation with the generation prompt, contents in order;
- attention: every attention feature the config declares (sliding window, soft-capping) is kept by
  the chosen implementation, and its logits equal eager attention's;
- engine_greedy: the HF engine's greedy tokens equal `model.generate`'s;
- logprobs_padded / logprobs_packed: the engine's behaviour logprobs of sampled responses equal
  the trainer's, on the padded path and on shared-prefix packing;
- weight_sync: new weights change the engine's fingerprint to the trainer's, and its logprobs;
- routing: on a mixture-of-experts model, the routing agreement (share of tokens whose top-k
  experts are the same in every layer) between the HF engine and the trainer, in the model's dtype
  (pass at 99% or more) and with a bf16 engine without and with routing replay (reported);
  skipped for a dense model;
- vllm: the same engine checks on vLLM when it is installed (skipped otherwise);
- cpu_bf16: whether this CPU computes bf16 natively (pass: `train.bf16_autocast: true` speeds CPU
  training up) or not (skip: bf16 would be slower here, keep float32), from its flags and oneDNN.

A table and one JSON line; exit 0 when every check passes, 1 naming the failing ones.
Layer: beside `evaluation` (it uses models and engines).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from reroll.config.errors import ConfigError
from reroll.data.batch import Trajectory, collate, model_kwargs
from reroll.engines.base import Request, SamplingParams, fingerprint
from reroll.models.devices import cpu_bf16
from reroll.models.loading import (
    attention_problems,
    choose_attention,
    is_vision_language,
    load_model,
    load_tokenizer,
)
from reroll.models.logprobs import forward_logprobs
from reroll.models.packing import sliding_window, supports_packing
from reroll.models.routing import is_moe

TEXTS = ["Hello, world!", "  two  spaces and\ttabs\nnew line", "3 + 4 * (12 - 5) = 31",
         "naïve café — ünïcödé ✓ 日本語", "def f(x):\n    return x ** 2\n"]
CONVERSATION = [{"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "2 + 3 = 5"},
                {"role": "user", "content": "And 4 + 4?"}]


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | skip
    detail: str


class ModelChecks:
    """The checks over one model directory; `run()` returns their results in order."""

    def __init__(self, path: str, attn_implementation: str = "auto", vllm: bool | None = None,
                 tokens: int = 12, atol: float = 1e-3):
        self.path = path
        self.tokens = tokens
        self.atol = atol
        self.want_vllm = vllm
        self.tokenizer, self.config = _load_parts(path)
        self.implementation = choose_attention(self.config, attn_implementation)
        self.model = _load_weights(path, self.implementation)
        self.prompts = self._prompts()

    def run(self, progress: Callable[[str], None] = lambda name: None) -> list[CheckResult]:
        results = []
        for name, check in (("tokenizer", self.check_tokenizer),
                            ("chat_template", self.check_chat_template),
                            ("attention", self.check_attention),
                            ("engine_greedy", self.check_engine_greedy),
                            ("logprobs_padded", lambda: self.check_logprobs(packed=False)),
                            ("logprobs_packed", lambda: self.check_logprobs(packed=True)),
                            ("weight_sync", self.check_weight_sync),
                            ("routing", self.check_routing),
                            ("vllm", self.check_vllm),
                            ("cpu_bf16", self.check_cpu_bf16),
                            ("image_logprobs", self.check_image_logprobs),
                            ("image_sensitivity", self.check_image_sensitivity)):
            progress(name)
            try:
                status, detail = check()
            except Exception as e:  # noqa: BLE001 - a check that crashes has failed, with why
                status, detail = "fail", f"{type(e).__name__}: {e}"
            results.append(CheckResult(name, status, detail))
        return results

    # -- the checks ------------------------------------------------------------------------------

    def check_cpu_bf16(self) -> tuple[str, str]:
        fast, detail = cpu_bf16()
        return ("pass" if fast else "skip"), detail

    def check_tokenizer(self) -> tuple[str, str]:
        bad = [t for t in TEXTS
               if self.tokenizer.decode(self.tokenizer.encode(t, add_special_tokens=False)) != t]
        if bad:
            return "fail", f"decode(encode(text)) != text for {bad[0]!r}"
        vocab, embedding = len(self.tokenizer), self.config.get_text_config().vocab_size
        if vocab > embedding:
            return "fail", f"tokenizer has {vocab} tokens, the model's embedding {embedding}"
        return "pass", f"{vocab} tokens, {len(TEXTS)} texts round-trip"

    def check_chat_template(self) -> tuple[str, str]:
        text = self.tokenizer.apply_chat_template(CONVERSATION, tokenize=False,
                                                  add_generation_prompt=True)
        positions = [text.find(m["content"]) for m in CONVERSATION]
        if -1 in positions or positions != sorted(positions):
            return "fail", "the rendered conversation lacks a message or reorders them"
        eos = self.tokenizer.eos_token
        if eos is None or len(self.tokenizer.encode(eos, add_special_tokens=False)) != 1:
            return "fail", f"the end-of-turn token {eos!r} is not a single id"
        return "pass", f"{len(self.prompts[0])}-token prompt, stops at {eos!r}"

    def check_attention(self) -> tuple[str, str]:
        features = [f"sliding_window={sliding_window(self.config)}"] \
            if sliding_window(self.config) else []
        features += [f"{n}={getattr(self.config, n)}" for n in ("attn_logit_softcapping",
                                                                 "final_logit_softcapping")
                     if getattr(self.config, n, None) is not None]
        problems = attention_problems(self.config, self.implementation)
        if problems:
            return "fail", "; ".join(problems)
        if self.implementation != "eager":
            eager = _load_weights(self.path, "eager")
            ids = torch.tensor([self.prompts[0]])
            with torch.no_grad():
                diff = (self.model(ids).logits - eager(ids).logits).abs().max().item()
            if diff > self.atol * 10:
                return "fail", f"{self.implementation} logits differ from eager by {diff:.2e}"
        kept = ", ".join(features) or "no special features"
        return "pass", f"{self.implementation} keeps {kept}"

    def check_routing(self) -> tuple[str, str]:
        from reroll.routing_check import compare_routing

        if not is_moe(self.model):
            return "skip", "dense model: no experts to route"
        pad = self.tokenizer.pad_token_id or 0
        dtype = next(self.model.parameters()).dtype
        same = compare_routing(self.model, self.prompts, dtype, self.tokens, 2, pad)
        agree = 1 - same["routing_mismatch_without"]
        detail = f"engine and trainer route {agree:.1%} of tokens alike ({same['engine_dtype']})"
        if dtype != torch.bfloat16:
            bf16 = compare_routing(self.model, self.prompts, torch.bfloat16, self.tokens, 2, pad)
            detail += (f"; bf16 engine: {1 - bf16['routing_mismatch_without']:.1%} without "
                       f"routing replay, {1 - bf16['routing_mismatch_with_replay']:.1%} with it")
        return ("pass" if agree >= 0.99 else "fail"), detail

    def check_engine_greedy(self) -> tuple[str, str]:
        engine = self._hf_engine()
        completions = _generate(engine, self.prompts, SamplingParams(self.tokens, temperature=0.0))
        for prompt, out in zip(self.prompts, completions, strict=True):
            expected = self._generate_reference(prompt, len(out.token_ids))
            if out.token_ids != expected:
                return "fail", f"engine {out.token_ids[:8]}... != generate {expected[:8]}..."
        return "pass", f"{len(self.prompts)} prompts x {self.tokens} tokens identical"

    def check_logprobs(self, packed: bool) -> tuple[str, str]:
        if packed and not supports_packing(self.model):
            return "skip", f"{self.implementation} attention does not pack (padded path used)"
        engine = self._hf_engine()
        diff = self._logprob_gap(engine, packed)
        status = "pass" if diff <= self.atol else "fail"
        return status, f"max |engine - trainer| = {diff:.1e} (tolerance {self.atol:.0e})"

    def check_weight_sync(self) -> tuple[str, str]:
        engine = self._hf_engine()
        before = engine.weights_fingerprint()
        params = SamplingParams(self.tokens, temperature=0.0)
        first = _generate(engine, self.prompts[:1], params)[0]
        new = self._perturbed_weights()
        engine.load_weights(new.items(), version=1)
        after = engine.weights_fingerprint()
        if after == before or after != fingerprint(new.items()):
            return "fail", "the engine's fingerprint does not follow the weights sent to it"
        second = _generate(engine, self.prompts[:1], params)[0]
        if second.policy_version != 1:
            return "fail", "the engine does not report the new policy version"
        changed = "changed" if second.logprobs != first.logprobs else "unchanged (!)"
        return ("pass" if second.logprobs != first.logprobs else "fail"), \
            f"fingerprint follows the trainer, logprobs {changed}"

    def check_vllm(self) -> tuple[str, str]:
        from reroll.engines.vllm import VLLMEngine, VLLMOptions, vllm_available

        if self.want_vllm is False:
            return "skip", "--no-vllm"
        if not vllm_available():
            if self.want_vllm:
                return "fail", "vLLM is not installed or fails to import"
            return "skip", "vLLM is not installed"
        engine = VLLMEngine(self.path, VLLMOptions(max_model_len=256, max_num_seqs=8))
        try:
            greedy = _generate(engine, self.prompts, SamplingParams(self.tokens, temperature=0.0))
            # Greedy decoding may part ways at a near tie in another kernel's rounding; compare
            # the logprobs of what vLLM produced instead of the tokens.
            diff = max(self._trainer_gap(out) for out in greedy)
            if diff > 5e-2:
                return "fail", f"vLLM's logprobs differ from the trainer's by {diff:.1e}"
            new = self._perturbed_weights()
            engine.load_weights(new.items(), version=1)
            if engine.weights_fingerprint() != fingerprint(new.items()):
                return "fail", "vLLM's fingerprint does not follow the weights sent to it"
            return "pass", f"logprobs within {diff:.1e} of the trainer's; weight sync verified"
        finally:
            engine.close()

    def check_image_logprobs(self) -> tuple[str, str]:
        """A vision-language model's engine and trainer logprobs agree on image prompts."""
        if not is_vision_language(self.config):
            return "skip", "not a vision-language model"
        trajectories, tensors = self._image_batch(self._image_prompts(seed=0))
        with torch.no_grad():
            logprobs, _ = forward_logprobs(self.model, tensors["input_ids"],
                                           tensors["attention_mask"], 1.0,
                                           model_inputs=model_kwargs(tensors))
        gap = max((logprobs[i, len(t.prompt_ids):len(t.prompt_ids) + len(t.response_ids)]
                   - torch.tensor(t.behaviour_logprobs)).abs().max().item()
                  for i, t in enumerate(trajectories))
        status = "pass" if gap <= self.atol else "fail"
        return status, (f"{len(trajectories)} image samples: max |engine - trainer| = {gap:.1e} "
                        f"(tolerance {self.atol:.0e})")

    def check_image_sensitivity(self) -> tuple[str, str]:
        """The trainer's logprobs of the same tokens change when the image does: pixel values
        that never reach the forward would leave them equal while the loss looks normal."""
        if not is_vision_language(self.config):
            return "skip", "not a vision-language model"
        _, tensors = self._image_batch(self._image_prompts(seed=0))
        _, other = self._image_batch(self._image_prompts(seed=1), generate=False)
        response = tensors["response_mask"].bool()
        with torch.no_grad():
            first, second = (forward_logprobs(self.model, tensors["input_ids"],
                                              tensors["attention_mask"], 1.0,
                                              model_inputs=model_kwargs(inputs))[0][response]
                             for inputs in (tensors, other))
        change = (first - second).abs().max().item()
        if change <= self.atol:
            return "fail", (f"the response logprobs do not depend on the image (max change "
                            f"{change:.1e}): the pixel values do not reach the forward")
        return "pass", f"another image changes the response logprobs by up to {change:.1e}"

    # -- helpers ---------------------------------------------------------------------------------

    def _image_prompts(self, seed: int) -> list:
        """Two "how many red squares?" prompts (drawn with `seed`) as the model's processor
        encodes them."""
        import random
        import tempfile

        from reroll.data.datasets import parse_records
        from reroll.data.images import QUESTION, draw_count_image
        from reroll.rollout.stream import encode_image_prompt

        rng, folder = random.Random(seed), Path(tempfile.mkdtemp(prefix="reroll-check-"))
        records = []
        for count in (1, 3):
            path = folder / f"{count}.png"
            draw_count_image(count, rng).save(path)
            content = [{"type": "image", "image": str(path)}, {"type": "text", "text": QUESTION}]
            records.append({"messages": [{"role": "user", "content": content}]})
        return [encode_image_prompt(self.tokenizer, row, 1 << 20)
                for row in parse_records(records, "check-model images")]

    def _image_batch(self, prompts: list, generate: bool = True):
        """Three sampled responses per image prompt from the HF engine (`generate`; otherwise
        the responses of the last call, on these prompts' images), collated for the trainer."""
        if generate:
            requests = [Request(p.ids, SamplingParams(self.tokens, temperature=1.0), seed=s,
                                model_inputs=p.model_inputs) for p in prompts for s in range(3)]
            outs = _generate(self._hf_engine(), requests=requests)
            self._image_samples = [(out.token_ids, out.logprobs) for out in outs]
        trajectories = [Trajectory(p.ids, list(tokens), list(logprobs), "stop", group_id=i,
                                   model_inputs=p.model_inputs)
                        for i, (p, (tokens, logprobs))
                        in enumerate(zip([p for p in prompts for _ in range(3)],
                                         self._image_samples, strict=True))]
        return trajectories, collate(trajectories, self.tokenizer.pad_token_id)[0]


    def _prompts(self) -> list[list[int]]:
        conversations = [CONVERSATION[:2], CONVERSATION, [{"role": "user", "content": TEXTS[3]}]]
        return [list(self.tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False))
                for c in conversations]

    def _perturbed_weights(self) -> dict[str, torch.Tensor]:
        """The trainer's state dict after a small random step on every parameter (tied weights
        stay tied, as after a real optimizer step)."""
        model = copy.deepcopy(self.model)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
        return dict(model.state_dict())

    def _hf_engine(self):
        from reroll.engines.hf import HFEngine

        # A copy, not a reload from disk: the engine then starts on exactly the trainer's weights.
        return HFEngine(copy.deepcopy(self.model), max_batch_size=16, pad_token_id=self.tokenizer.pad_token_id)

    @torch.no_grad()
    def _generate_reference(self, prompt: list[int], tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
                                  pad_token_id=self.tokenizer.pad_token_id, use_cache=True)
        return out[0, len(prompt):].tolist()

    def _logprob_gap(self, engine, packed: bool) -> float:
        """Sample a group of responses per prompt; the largest gap between the engine's logprobs
        and the trainer's, over one right-padded batch of them (packed or not)."""
        requests = [Request(p, SamplingParams(self.tokens, temperature=1.0), seed=s)
                    for p in self.prompts for s in range(3)]
        outs = _generate(engine, requests=requests)
        rows = [out.prompt_ids + out.token_ids for out in outs]
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        response = torch.zeros_like(ids)
        for i, out in enumerate(outs):
            response[i, len(out.prompt_ids):len(rows[i])] = 1
        with torch.no_grad():
            logprobs, _ = forward_logprobs(self.model, ids, attention, 1.0,
                                           response_mask=response if packed else None)
        gap = 0.0
        for i, out in enumerate(outs):
            start = len(out.prompt_ids)
            trainer = logprobs[i, start:start + len(out.token_ids)]
            gap = max(gap, (trainer - torch.tensor(out.logprobs)).abs().max().item())
        return gap

    def _trainer_gap(self, out) -> float:
        ids = torch.tensor([out.prompt_ids + out.token_ids])
        with torch.no_grad():
            logprobs, _ = forward_logprobs(self.model, ids, torch.ones_like(ids))
        # vLLM's greedy logprobs are of the raw distribution at temperature 0 -> compare at 1.
        return (logprobs[0, len(out.prompt_ids):] - torch.tensor(out.logprobs)).abs().max().item()


def _generate(engine, prompts: list[list[int]] | None = None, params: SamplingParams | None = None,
              requests: list[Request] | None = None):
    requests = requests or [Request(p, params, seed=i) for i, p in enumerate(prompts)]

    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    return asyncio.run(go())


def _load_parts(path: str):
    """Tokenizer and config, or a ConfigError naming the file that is missing or broken."""
    from transformers import AutoConfig

    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"{path}: no such model directory")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{config_file}: missing (not a Hugging Face model directory)")
    try:
        json.loads(config_file.read_text())
        config = AutoConfig.from_pretrained(str(directory))
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"{config_file}: cannot be read ({type(e).__name__}: {e})") from None
    if not any((directory / name).is_file() for name in
               ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
        raise ConfigError(f"{directory}: no tokenizer files (tokenizer.json, "
                          f"tokenizer_config.json) in the model directory")
    try:
        tokenizer = load_tokenizer(str(directory), fits_embedding=False)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is the user's broken file
        raise ConfigError(f"{directory / 'tokenizer.json'}: the tokenizer cannot be loaded "
                          f"({type(e).__name__}: {e})") from None
    return tokenizer, config


def _load_weights(path: str, implementation: str) -> torch.nn.Module:
    """The model for training (float32, dropout off), or a ConfigError naming the weights file."""
    try:
        return load_model(path, "float32", implementation).eval()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - corrupt or mismatched weights are the user's file
        files = sorted(p.name for p in Path(path).glob("*.safetensors")) or ["pytorch_model.bin"]
        raise ConfigError(f"{Path(path) / files[0]}: the weights cannot be loaded into this "
                          f"architecture ({type(e).__name__}: {str(e)[:300]})") from None


def run_checks(path: str, attn_implementation: str = "auto", vllm: bool | None = None,
               progress: Callable[[str], None] = lambda name: None) -> dict:
    """Every check over the model at `path`; a summary dict with each check's result."""
    start = time.perf_counter()
    checks = ModelChecks(path, attn_implementation, vllm)
    results = checks.run(progress)
    failed = [r.name for r in results if r.status == "fail"]
    return {"model": path, "architecture": checks.config.model_type,
            "attn_implementation": checks.implementation, "passed": not failed,
            "failed": failed, "seconds": round(time.perf_counter() - start, 1),
            "checks": [asdict(r) for r in results]}
