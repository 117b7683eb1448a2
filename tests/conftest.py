"""Shared fixtures: a tiny model and the arithmetic task, built locally once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from reroll.models.factory import make_model

    return str(make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0))


@pytest.fixture(scope="session")
def arithmetic(tmp_path_factory) -> dict:
    from reroll.data.tasks import write_arithmetic

    paths = write_arithmetic(tmp_path_factory.mktemp("data") / "arithmetic", train_size=600,
                             eval_size=32, seed=0)
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from reroll.models.loading import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct imported from the pinned package's GGUF, built once under the
    checkout (models/smollm2, as `make models/smollm2/config.json` does) and reused by later runs."""
    import fcntl
    from pathlib import Path

    from reroll.models.gguf import import_gguf

    root = Path(__file__).resolve().parent.parent / "models"
    path = root / "smollm2"
    root.mkdir(exist_ok=True)
    with open(root / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test processes must not write it at once
        if not (path / "model.safetensors").is_file():
            import_gguf("smollm2-135m-instruct", path)
    return str(path)
