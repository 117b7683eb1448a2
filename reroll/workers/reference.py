"""ReferenceWorker: the frozen reference policy (or a distillation teacher); logprobs of a batch
shard, or its top-k next-token distribution at every response position."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from reroll.models.loading import load_model
from reroll.models.logprobs import batched_logprobs, trimmed_micro_batches
from reroll.models.top_k import teacher_top_k


class ReferenceWorker:
    def __init__(self, *, rank: int, world_size: int, model_path: str, dtype: str,
                 micro_batch_size: int, attn_implementation: str = "auto", device: str = "cpu",
                 autocast_bf16: bool = False):
        self.model = load_model(model_path, dtype, attn_implementation).eval().to(device)
        self.micro_batch_size = micro_batch_size
        self.autocast = torch.autocast(device_type=torch.device(device).type,
                                       dtype=torch.bfloat16, enabled=autocast_bf16)

    def logprobs(self, shard: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        with self.autocast:
            return batched_logprobs(self.model, shard["input_ids"], shard["attention_mask"],
                                    self.micro_batch_size, temperature, shard["response_mask"],
                                    shard.get("model_inputs"))

    def top_k(self, shard: TensorDict, k: int, temperature: float = 1.0) -> TensorDict:
        """{"ids", "logprobs"} [B, L, k]: the k likeliest next tokens at each response position
        and their log-probabilities (0 elsewhere), micro-batch by micro-batch."""
        device = next(self.model.parameters()).device
        size, length = shard["input_ids"].shape
        ids = torch.zeros(size, length, k, dtype=torch.long)
        logprobs = torch.zeros(size, length, k, dtype=torch.float32)
        for rows, width in trimmed_micro_batches(shard["attention_mask"], self.micro_batch_size):
            with self.autocast:
                top_ids, top_lp = teacher_top_k(
                    self.model, *(shard[key][rows, :width].to(device) for key in
                                  ("input_ids", "attention_mask", "response_mask")),
                    k, temperature)
            ids[rows, :width], logprobs[rows, :width] = top_ids.cpu(), top_lp.cpu()
        return TensorDict({"ids": ids, "logprobs": logprobs}, batch_size=[size])
