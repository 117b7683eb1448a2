"""LoRA adapters on a causal LM, built with PEFT, and the merged weights the engines receive.

`LoRAAdapter` injects PEFT's LoRA layers into the model in place: the trainer keeps calling the
same transformers model (so the chunked LM head and prompt packing of `models/logprobs.py` work
unchanged), and the PEFT wrapper is kept beside it for what PEFT does well: switching the adapter
off (the reference policy), and the adapter's files (`adapter_config.json` +
`adapter_model.safetensors`, which `PeftModel.from_pretrained` and vLLM's LoRA loader read).

Engines never see LoRA layers. They get either the merged weights (`merged_state_dict`: the plain
model's state dict with every adapted weight replaced by `W + scale * B A`, under the plain
model's names, which every weight sync path and the fingerprint check take as they take a fully
fine-tuned model), or the adapter alone (`adapter_tensors`, a few MB), which an engine merges into
its own copy of the base weights (`HeldBase`): the adapter-only sync of `model.lora.sync`.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from reroll.config.errors import ConfigError
from reroll.config.lora import LoRAConfig
from reroll.models.files import ADAPTER_CONFIG, is_adapter_dir  # noqa: F401 - imported from here

ADAPTER_NAME = "default"


def adapter_base_path(path: str | Path) -> str:
    """The base model an adapter folder was trained on (`base_model_name_or_path`)."""
    file = Path(path).expanduser() / ADAPTER_CONFIG
    try:
        base = json.loads(file.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: cannot be read ({e})") from None
    if not base:
        raise ConfigError(f"{file}: names no base model (base_model_name_or_path)")
    return str(base)


def _linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    return torch.nn.Linear, Conv1D


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Full names of the model's leaf linear layers that can carry an adapter. An output head
    tied to the input embeddings is left out: its merged weight would have to be the
    embeddings' too."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and getattr(model.config, "tie_word_embeddings", False)
    return [name for name, module in model.named_modules()
            if isinstance(module, _linear_types()) and not (tied and module is head)]


def check_targets(model: torch.nn.Module, targets: str | list[str], source: str) -> None:
    """A ConfigError naming the first of `targets` that matches no linear layer of `model`,
    with the model's real linear layer names listed."""
    if isinstance(targets, str):
        return  # all-linear
    names = linear_module_names(model)
    short = sorted({name.rsplit(".", 1)[-1] for name in names})
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in names):
            kind = getattr(model.config, "model_type", type(model).__name__)
            raise ConfigError(
                f"model.lora.target_modules: {source} ({kind}) has no linear layer named "
                f"{target!r}; its linear layers are {', '.join(short)}")


# The vision side of the VLM families transformers has: Idefics3/SmolVLM (`vision_model`,
# `connector`), Qwen2-VL (`visual`), LLaVA-likes (`vision_tower`, `multi_modal_projector`).
VISION_MODULES = r"(.*\.)?(vision_model|visual|vision_tower|connector|multi_modal_projector)\..*"


def vision_module_names(model: torch.nn.Module) -> list[str]:
    """The linear layers of `model`'s vision tower and connector (none for a text model)."""
    return [name for name in linear_module_names(model) if re.fullmatch(VISION_MODULES, name)]


def peft_config(config: LoRAConfig, model: torch.nn.Module | None = None):
    from peft import LoraConfig

    # A VLM's vision side stays frozen unless `vision`: adapters on the language model only.
    exclude = VISION_MODULES if model is not None and not config.vision and \
        vision_module_names(model) else None
    return LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                      target_modules=config.target_modules, use_rslora=config.rslora,
                      exclude_modules=exclude, bias="none", task_type="CAUSAL_LM")


class LoRAAdapter:
    """The adapter of one trained model: `model` is the transformers model with LoRA layers
    injected, `peft` the PEFT wrapper around the same modules."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig):
        from peft import get_peft_model

        base = str(getattr(model, "name_or_path", "") or "")
        source = f"model {base}" if base else "the model"
        check_targets(model, config.target_modules, source)
        if Path(base).expanduser().exists():  # the adapter's files name an absolute base path
            model.name_or_path = str(Path(base).expanduser().resolve())
        self.peft = get_peft_model(model, peft_config(config, model))
        self.model = model

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: every LoRA layer passes its input through the frozen weight only."""
        with self.peft.disable_adapter():
            yield

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's state dict with each adapted weight merged (`W + delta`, in W's
        dtype, as PEFT's own merge computes it); the LoRA matrices are left out."""
        from peft.tuners.lora import LoraLayer

        merged = {}
        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
                base = module.get_base_layer()
                with torch.no_grad():
                    delta = module.get_delta_weight(ADAPTER_NAME)
                    merged[f"{name}.weight"] = base.weight + delta.to(base.weight.dtype)
        out = {}
        for key, value in self.model.state_dict().items():
            if ".lora_" in key:
                continue
            plain = key.replace(".base_layer.", ".")
            out[plain] = merged.get(plain, value).detach()
        return out

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter alone, as engines take it (`HeldBase.apply`): per adapted layer, under the
        plain model's module name, `<name>.lora_A` [r, in], `<name>.lora_B` [out, r] and
        `<name>.lora_scale` ([1] float64, so the scale arrives exactly)."""
        from peft.tuners.lora import LoraLayer

        out = {}
        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
                out[f"{name}.lora_A"] = module.lora_A[ADAPTER_NAME].weight.detach()
                out[f"{name}.lora_B"] = module.lora_B[ADAPTER_NAME].weight.detach()
                out[f"{name}.lora_scale"] = torch.tensor([float(module.scaling[ADAPTER_NAME])],
                                                         dtype=torch.float64)
        return out

    def save(self, directory: Path) -> None:
        """`adapter_config.json` + `adapter_model.safetensors` (PEFT's format)."""
        self.peft.save_pretrained(str(directory))

    def load(self, directory: Path) -> None:
        """The adapter weights `save` wrote, exactly."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        file = directory / "adapter_model.safetensors"
        if not file.is_file():
            raise ConfigError(f"checkpoint {directory}: no adapter_model.safetensors (was it "
                              f"written by a run without model.lora?)")
        result = set_peft_model_state_dict(self.peft, load_file(file))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ConfigError(f"checkpoint {directory}: the adapter does not fit model.lora "
                              f"(unexpected {unexpected[:3]})")

    def save_merged(self, directory: Path) -> None:
        """A plain transformers model folder with the merged weights."""
        save_merged_model(self.model, self.merged_state_dict(), directory)


def save_merged_model(model: torch.nn.Module, state: dict[str, torch.Tensor],
                      directory: Path) -> None:
    """`model`'s config with the weights `state` (plain names) as a transformers folder."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(model.config)
    plain.load_state_dict(state, strict=False, assign=True)
    plain.tie_weights()
    plain.save_pretrained(str(directory))


def merge_adapter_dir(model: torch.nn.Module, directory: str | Path) -> torch.nn.Module:
    """`model` (the base) with the adapter saved in `directory` merged into its weights."""
    from peft import PeftModel

    try:
        peft = PeftModel.from_pretrained(model, str(directory))
    except Exception as e:  # noqa: BLE001 - anything from reading the user's files
        detail = (str(e).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"{directory}: cannot load the LoRA adapter "
                          f"({type(e).__name__}: {detail})") from None
    return peft.merge_and_unload()


class AdapterError(ValueError):
    """An adapter that does not fit the engine's model (a part missing, a layer the model lacks,
    a shape that differs): nothing was applied."""


ADAPTER_PARTS = ("lora_A", "lora_B", "lora_scale")


def adapter_layers(adapter: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """{module name: (A, B, scale)} from `LoRAAdapter.adapter_tensors`' flat names."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.items():
        name, _, part = key.rpartition(".")
        if part not in ADAPTER_PARTS or not name:
            raise AdapterError(f"adapter tensor {key!r} is not <layer>.lora_A/lora_B/lora_scale")
        layers.setdefault(name, {})[part] = tensor
    for name, parts in layers.items():
        missing = [p for p in ADAPTER_PARTS if p not in parts]
        if missing:
            raise AdapterError(f"the adapter of layer {name} lacks {', '.join(missing)}")
    return {name: tuple(parts[p] for p in ADAPTER_PARTS) for name, parts in layers.items()}


def adapter_delta(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                  transposed: bool) -> torch.Tensor:
    """`scale * B A` as PEFT's own merge computes it (float32 on CPU for half-precision
    matrices, the weight's layout), so a merge here equals the trainer's bit for bit."""
    dtype = b.dtype
    if b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()
    delta = b @ a
    delta = (delta.T if transposed else delta) * scale.item()
    return delta.to(dtype)


class HeldBase:
    """An engine's copy (in CPU memory) of the base weights of the layers an adapter adapts, taken
    when the first adapter arrives, so that each new adapter merges into the base and never into
    the previous merge (no drift, and exactly the trainer's `W + scale * B A`). Costs one copy of
    the adapted weights in host memory."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.base: dict[str, torch.Tensor] = {}

    def apply(self, adapter: dict[str, torch.Tensor]) -> None:
        """Set every adapted layer's weight to base + the adapter's delta. Everything is checked
        and computed first: an adapter that does not fit raises AdapterError and changes no
        weight."""
        from transformers.pytorch_utils import Conv1D

        modules = dict(self.model.named_modules())
        layers = adapter_layers(adapter)
        merged = {}
        for name, (a, b, scale) in layers.items():
            module = modules.get(name)
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor):
                raise AdapterError(f"the adapter adapts layer {name}, which the engine's model "
                                   f"does not have")
            base = self.base.get(name)
            base = weight.detach().to("cpu", copy=True) if base is None else base
            delta = adapter_delta(a.to("cpu"), b.to("cpu"), scale, isinstance(module, Conv1D))
            if delta.shape != base.shape:
                raise AdapterError(f"the adapter of layer {name} gives a {tuple(delta.shape)} "
                                   f"update to a {tuple(base.shape)} weight")
            merged[name] = (base, base + delta.to(base.dtype) if base.dtype == delta.dtype
                            else (base.float() + delta.float()).to(base.dtype))
        for name in self.base.keys() - layers.keys():  # no longer adapted: back to the base
            merged[name] = (self.base[name], self.base[name])
        with torch.no_grad():
            for name, (base, weight) in merged.items():
                self.base.setdefault(name, base)
                modules[name].weight.copy_(weight)


def write_peft_adapter(adapter: dict[str, torch.Tensor], directory: Path, base: str) -> None:
    """`adapter` (`LoRAAdapter.adapter_tensors`) as a PEFT adapter folder over the model `base`,
    for loaders that read PEFT's files (vLLM's LoRA support). One rank and scale for all layers,
    as `model.lora` trains."""
    from safetensors.torch import save_file

    layers = adapter_layers(adapter)
    ranks = {a.shape[0] for a, _, _ in layers.values()}
    scales = {float(s.item()) for _, _, s in layers.values()}
    if len(ranks) != 1 or len(scales) != 1:
        raise AdapterError(f"the adapter's layers differ in rank {sorted(ranks)} or scale "
                           f"{sorted(scales)}")
    rank, scale = ranks.pop(), scales.pop()
    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, (a, b, _) in layers.items():
        state[f"base_model.model.{name}.lora_A.weight"] = a.detach().cpu().contiguous()
        state[f"base_model.model.{name}.lora_B.weight"] = b.detach().cpu().contiguous()
    save_file(state, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": rank, "lora_alpha": scale * rank, "lora_dropout": 0.0, "bias": "none",
              "use_rslora": False, "fan_in_fan_out": False,
              "target_modules": sorted({name.rsplit(".", 1)[-1] for name in layers})}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config), encoding="utf-8")
