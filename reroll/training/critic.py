"""The critic: value models (a causal-LM backbone with a linear value head) and their training.

A vision-language policy's critic is its multimodal base model (the vision tower, the connector
and the language model, without the LM head) with the head: it reads each row's images through
the batch's model inputs (`reroll.data.batch.model_kwargs`), as the policy's logprob forward does.

Values follow the logprob convention of `reroll.models.logprobs`: position t holds V(s_t), the
value of the state in which token t was generated (the prefix of tokens < t), computed from the
backbone's hidden state at position t-1; position 0 holds 0. A GAE step from token t to t+1
therefore reads values[t] and values[t+1], and the state after the last response token is
terminal.

`LocalCritic` holds one value model, or several (AsyPPO's mini-critics), each with its own optimizer
(`LocalStrategy`). Mini-critic m trains on the responses whose index within their group is m
modulo M, so every critic sees every prompt but a disjoint share of its responses (AsyPPO's
group-level split); the value estimate is the mean over the critics.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tensordict import TensorDict

from reroll import algorithms
from reroll.config.algorithm import CriticConfig
from reroll.config.errors import ConfigError
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.data.batch import model_kwargs
from reroll.models.loading import DTYPES
from reroll.models.logprobs import placeholder_ids, trimmed_micro_batches
from reroll.training.local import LocalStrategy

WEIGHTS = "model.safetensors"


class ValueModel(torch.nn.Module):
    """A transformers base model (`AutoModel`; of a vision-language model, its multimodal base
    model) and a linear head giving one value per token."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        width = backbone.config.get_text_config().hidden_size  # a VLM's is its language model's
        self.value_head = torch.nn.Linear(width, 1, dtype=backbone.dtype)
        self.vision = bool(placeholder_ids(backbone))  # it reads images (a VLM's base model)
        # A fresh head predicts 0 everywhere: GAE starts as discounted returns, not as noise.
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                model_inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, attention_mask [B, L] (right-padded) -> values [B, L] float32.
        `model_inputs`: the rows' inputs beyond tokens (`model_kwargs`: pixel values...), passed
        to the backbone, without position ids for them or for any VLM, as in
        `reroll.models.logprobs.forward_logprobs` (the model places its image features and
        positions by its image tokens)."""
        vision = self.vision
        if model_inputs and not vision:  # refused at start (validation)
            raise ValueError("the critic's model is text-only: it would score these rows "
                             "without their images")
        extra = dict(model_inputs or {}) if vision else \
            {"position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0)}
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               use_cache=False, **extra).last_hidden_state
        head = self.value_head(hidden).squeeze(-1).float()
        values = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        values[:, 1:] = head[:, :-1]
        return values

    def save_pretrained(self, directory: Path) -> None:
        """The backbone's config.json and every weight (backbone and head) in model.safetensors."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backbone.config.save_pretrained(directory)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS), metadata={"format": "pt"})


def is_saved_critic(path: str | Path) -> bool:
    weights = Path(path) / WEIGHTS
    if not weights.is_file():
        return False
    with safe_open(str(weights), "pt") as f:
        return "value_head.weight" in f.keys()


def load_value_model(path: str, dtype: str = "float32") -> ValueModel:
    """A saved critic, or a new value head on the backbone of a causal LM (or of a
    vision-language model) saved at `path`."""
    from transformers import AutoConfig, AutoModel  # deferred: ~1.5 s to import, PPO runs only

    if not (Path(path).expanduser() / "config.json").is_file():
        raise ConfigError(f"algorithm.critic.model_path {path}: no Hugging Face model there "
                          f"(config.json missing)")
    if is_saved_critic(path):
        backbone = AutoModel.from_config(AutoConfig.from_pretrained(path)).to(DTYPES[dtype])
        model = ValueModel(backbone)
        model.load_state_dict(load_file(str(Path(path) / WEIGHTS)))
        return model
    return ValueModel(AutoModel.from_pretrained(path, dtype=DTYPES[dtype]))


class LocalCritic:
    """One value model, or AsyPPO's M mini-critics, each with its own AdamW and schedule."""

    def __init__(self, config: CriticConfig, policy_path: str, dtype: str,
                 optimizer: OptimizerConfig, train: TrainConfig, total_steps: int,
                 device: str = "cpu", autocast_bf16: bool | None = None):
        self.config = config
        path = config.model_path or policy_path
        settings = optimizer.model_copy(update={
            "lr": config.lr or optimizer.lr, "weight_decay": config.weight_decay,
            "grad_clip": config.grad_clip})
        train = train.model_copy(update={"gradient_checkpointing": False})  # the policy's only
        self.members = [LocalStrategy(load_value_model(path, dtype), settings, train, total_steps,
                                      device, autocast_bf16)
                        for _ in range(config.num_critics)]
        self.micro_batch_size = train.micro_batch_size

    @property
    def num_critics(self) -> int:
        return len(self.members)

    @torch.no_grad()
    def values(self, batch: TensorDict) -> torch.Tensor:
        """Every critic's values of the batch's tokens: [M, B, L] (0 on padding); each
        micro-batch's rows pass their model inputs (images) along."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        out = torch.zeros((self.num_critics, *ids.shape), dtype=torch.float32)
        for m, member in enumerate(self.members):
            member.model.eval()
            device = member.device
            for rows, width in trimmed_micro_batches(mask, self.micro_batch_size):
                with member.autocast():
                    values = member.model(ids[rows, :width].to(device), mask[rows, :width].to(device),
                                          model_kwargs(batch[rows], device))
                out[m, rows, :width] = values.to(out.device) * mask[rows, :width]
            member.model.train()
        return out

    def update(self, batch: TensorDict, updates_per_batch: int) -> dict[str, float]:
        """Fit each critic to `returns` on its share of the batch, in `updates_per_batch`
        mini-batches. Reads `old_values_m` (critic m's values at scoring time, for clipping),
        `returns`, `response_mask` and `index_in_group`."""
        shard = batch["index_in_group"] % self.num_critics
        totals: dict[str, float] = {}
        count = 0
        for m, member in enumerate(self.members):
            rows = batch[shard == m]
            if rows.batch_size[0] == 0:
                continue
            size = math.ceil(rows.batch_size[0] / updates_per_batch)
            for start in range(0, rows.batch_size[0], size):
                mini = rows[start : start + size]
                result = member.train_step(mini, self._loss(mini, f"old_values_{m}"))
                for key, value in result.items():
                    name = "critic/" + key.split("/", 1)[1] if key.startswith("train/") else key
                    totals[name] = totals.get(name, 0.0) + value
                count += 1
        return {k: v / max(count, 1) for k, v in totals.items()}

    def _loss(self, batch: TensorDict, old_key: str):
        num_tokens, num_seqs = algorithms.loss_normalisers(batch["response_mask"])
        clip = self.config.value_clip

        def loss_fn(model: torch.nn.Module, micro: TensorDict) -> tuple[torch.Tensor, dict]:
            values = model(micro["input_ids"], micro["attention_mask"],
                           model_kwargs(micro, micro["input_ids"].device))
            loss, raw = algorithms.value_loss(values, micro[old_key], micro["returns"],
                                              micro["response_mask"], clip_range=clip,
                                              agg="token_mean", num_tokens=num_tokens,
                                              num_seqs=num_seqs)
            return loss, {f"critic/{k}": v for k, v in raw.items()}

        return loss_fn

    # -- checkpoints -----------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """`critic_m/` for each critic inside a checkpoint directory (weights + optimizer)."""
        for m, member in enumerate(self.members):
            member.save(Path(directory) / f"critic_{m}", {})

    def load(self, directory: Path) -> None:
        for m, member in enumerate(self.members):
            path = Path(directory) / f"critic_{m}"
            if not path.is_dir():
                raise ConfigError(f"resume: checkpoint {directory} has no {path.name}/ "
                                  f"(was it written by a run with this critic configuration?)")
            member.load(path)
