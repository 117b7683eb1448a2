"""A generated suite of terminal tasks in several families (`reroll make-terminal-tasks`).

Each family draws one task from a seeded `random.Random`: the instruction, a set-up script, a
test script and an expert's solution (a `TerminalTask`, written as a task folder). Train and held-out tasks come
from disjoint generator seeds, and a held-out task whose instruction equals a train task's is
drawn again, so a held-out task is never trained on.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TerminalTask:
    """One generated task, before it is written as a folder (`write`)."""

    name: str
    instruction: str
    test: str
    setup: str = ""
    solution: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def toml(self) -> str:
        meta = "".join(f"{k} = {_toml_value(v)}\n" for k, v in self.metadata.items())
        return (f'version = "1.0"\n\n[metadata]\n{meta}\n[agent]\ntimeout_sec = 120.0\n\n'
                "[verifier]\ntimeout_sec = 60.0\n\n[environment]\ncpus = 1\nmemory_mb = 512\n"
                "storage_mb = 64\nallow_internet = false\n")

    def write(self, folder: Path) -> Path:
        """The task folder (docs/terminal-tasks.md), scripts executable."""
        contents = {"instruction.md": self.instruction.rstrip() + "\n", "task.toml": self.toml(),
                    "tests/test.sh": self.test, "environment/setup.sh": self.setup or None,
                    "solution/solve.sh": self.solution}
        for name, text in contents.items():
            if text is None:
                continue
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            if name.endswith(".sh"):
                path.chmod(0o755)
        return folder


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value).lower() if isinstance(value, bool) else str(value)


WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "orbit", "delta",
         "amber", "cedar", "falcon", "garnet", "harbor", "indigo", "jasper", "kernel", "lotus",
         "meadow", "nectar", "opal", "pepper", "quartz", "raven", "saffron", "tundra", "violet"]
LEVELS = ["INFO", "WARN", "ERROR", "DEBUG"]
HELD_OUT_SEED_BASE = 1_000_000
"""Generator seeds of held-out tasks start here; train tasks' count up from the suite's seed."""


def _lines(words: list[str]) -> str:
    return "".join(f"{w}\n" for w in words)


def _heredoc(path: str, text: str) -> str:
    return f"cat > {path} <<'EOF'\n{text}EOF\n"


def create_file(rng: random.Random) -> TerminalTask:
    folder, name, word = rng.choice(["notes", "out", "docs"]), rng.choice(WORDS), rng.choice(WORDS)
    line = f"{word} {rng.randint(10, 999)}"
    path = f"{folder}/{name}.txt"
    return TerminalTask("", f"Create the file `{path}` (make the folder) holding exactly one "
                        f"line: `{line}`", f'[ "$(cat {path})" = "{line}" ]\n',
                        solution=f"mkdir -p {folder} && echo '{line}' > {path}\n",
                        metadata={"category": "files", "difficulty": "easy"})


def move_files(rng: random.Random) -> TerminalTask:
    ext, other = rng.sample(["log", "tmp", "bak", "csv"], 2)
    names = rng.sample(WORDS, rng.randint(2, 5))
    keep = rng.choice([w for w in WORDS if w not in names])
    setup = "mkdir -p inbox\n" + "".join(f"echo {n} > inbox/{n}.{ext}\n" for n in names) \
        + f"echo {keep} > inbox/{keep}.{other}\n"
    test = (f'[ "$(ls archive/*.{ext} | wc -l)" -eq {len(names)} ] && '
            f'! ls inbox/*.{ext} >/dev/null 2>&1 && [ -f inbox/{keep}.{other} ]\n')
    return TerminalTask("", f"Move every `.{ext}` file from `inbox/` into a new folder "
                        f"`archive/`; leave the other files where they are.", test, setup,
                        f"mkdir -p archive && mv inbox/*.{ext} archive/\n",
                        metadata={"category": "files", "difficulty": "easy"})


def grep_lines(rng: random.Random) -> TerminalTask:
    level = rng.choice(LEVELS)
    rows = [f"{rng.choice(LEVELS)} {rng.choice(WORDS)} {i}" for i in range(rng.randint(6, 14))]
    rows[rng.randrange(len(rows))] = f"{level} {rng.choice(WORDS)} x"
    out = rng.choice(["found.txt", "matches.txt", "selected.txt"])
    setup = _heredoc("app.log", _lines(rows))
    return TerminalTask("", f"Write the lines of `app.log` that start with `{level}` to `{out}`, "
                        "in their order.", f"grep '^{level} ' app.log | cmp -s - {out}\n", setup,
                        f"grep '^{level} ' app.log > {out}\n",
                        metadata={"category": "text", "difficulty": "easy"})


def replace_word(rng: random.Random) -> TerminalTask:
    old, new = rng.sample(WORDS, 2)
    others = [w for w in WORDS if w not in (old, new)]
    keys = rng.sample(others, rng.randint(3, 6))
    values = [old if i % 2 == 0 else rng.choice(others) for i in range(len(keys))]
    text = "".join(f"{k}={v}\n" for k, v in zip(keys, values, strict=True))
    expected = text.replace(old, new)
    setup = _heredoc("settings.ini", text)
    test = _heredoc("/tmp/expected", expected) + "cmp -s /tmp/expected settings.ini\n"
    return TerminalTask("", f"In `settings.ini`, replace every occurrence of `{old}` with `{new}`"
                        ", changing nothing else.", test, setup,
                        f"sed -i 's/{old}/{new}/g' settings.ini\n",
                        metadata={"category": "text", "difficulty": "medium"})


def sum_column(rng: random.Random) -> TerminalTask:
    column, name = rng.choice([("qty", "sales.csv"), ("price", "items.csv"), ("hours", "log.csv")])
    rows = [(rng.choice(WORDS), rng.randint(1, 99)) for _ in range(rng.randint(3, 9))]
    total = sum(v for _, v in rows)
    setup = _heredoc(name, f"name,{column}\n" + "".join(f"{n},{v}\n" for n, v in rows))
    return TerminalTask("", f"Write the sum of the `{column}` column of `{name}` (its first line "
                        "is a header) to `total.txt`.",
                        f'[ "$(tr -d " \\n" < total.txt)" = "{total}" ]\n', setup,
                        f"awk -F, 'NR>1 {{s+=$2}} END {{print s}}' {name} > total.txt\n",
                        metadata={"category": "text", "difficulty": "medium"})


def count_distinct(rng: random.Random) -> TerminalTask:
    words = [rng.choice(WORDS[:rng.randint(4, 12)]) for _ in range(rng.randint(8, 20))]
    setup = _heredoc("words.txt", _lines(words))
    return TerminalTask("", "`words.txt` holds one word per line. Write how many different "
                        "words it holds to `distinct.txt`.",
                        f'[ "$(tr -d " \\n" < distinct.txt)" = "{len(set(words))}" ]\n', setup,
                        "sort -u words.txt | wc -l > distinct.txt\n",
                        metadata={"category": "text", "difficulty": "medium"})


def write_script(rng: random.Random) -> TerminalTask:
    greeting, script = rng.choice(["Hello", "Hi", "Welcome", "Good day"]), rng.choice(
        ["greet.sh", "hello.sh", "say.sh"])
    names = rng.sample(["Ada", "Linus", "Grace", "Ken", "Barbara"], 2)
    test = " && ".join([f"[ -x {script} ]"] + [f'[ "$(./{script} {n})" = "{greeting}, {n}!" ]'
                                                for n in names]) + "\n"
    return TerminalTask("", f"Write an executable script `{script}` that prints `{greeting}, "
                        f"NAME!` when run as `./{script} NAME`.", test,
                        solution=f"printf '#!/bin/sh\\necho \"{greeting}, $1!\"\\n' > {script} "
                        f"&& chmod +x {script}\n",
                        metadata={"category": "scripts", "difficulty": "medium"})


def make_archive(rng: random.Random) -> TerminalTask:
    folder, archive = rng.choice(["docs", "src", "data"]), rng.choice(["backup", "bundle", "snap"])
    names = rng.sample(WORDS, rng.randint(2, 4))
    setup = f"mkdir -p {folder}\n" + "".join(f"echo {n} > {folder}/{n}.txt\n" for n in names)
    test = (f"tar -tzf {archive}.tar.gz > /tmp/listing && "
            + " && ".join(f"grep -qx '{folder}/{n}.txt' /tmp/listing" for n in names) + "\n")
    return TerminalTask("", f"Create the gzip-compressed tar archive `{archive}.tar.gz` holding "
                        f"the folder `{folder}` (paths inside start with `{folder}/`).", test,
                        setup, f"tar -czf {archive}.tar.gz {folder}\n",
                        metadata={"category": "archives", "difficulty": "medium"})


def extract_archive(rng: random.Random) -> TerminalTask:
    inner, code = rng.choice(WORDS), f"{rng.choice(WORDS)}-{rng.randint(100, 999)}"
    setup = (f"mkdir -p {inner} && echo '{code}' > {inner}/code.txt && tar -czf parcel.tar.gz "
             f"{inner} && rm -r {inner}\n")
    return TerminalTask("", "`parcel.tar.gz` holds a file named `code.txt`. Write that file's "
                        "content to `answer.txt`.", f'[ "$(cat answer.txt)" = "{code}" ]\n', setup,
                        "tar -xzf parcel.tar.gz && cp */code.txt answer.txt\n",
                        metadata={"category": "archives", "difficulty": "medium"})


def permissions(rng: random.Random) -> TerminalTask:
    script, key = rng.choice(["run.sh", "start.sh", "deploy.sh"]), rng.choice(
        ["secret.key", "token.txt", "id.pem"])
    mode = rng.choice(["600", "400"])
    who = "readable and writable by its owner only" if mode == "600" else \
        "readable by its owner only"
    setup = f"printf '#!/bin/sh\\necho ok\\n' > {script}\nchmod 644 {script}\necho s > {key}\n" \
        f"chmod 644 {key}\n"
    test = f'[ -x {script} ] && [ "$(stat -c %a {key})" = "{mode}" ]\n'
    return TerminalTask("", f"Make `{script}` executable, and make `{key}` {who}.", test, setup,
                        f"chmod +x {script} && chmod {mode} {key}\n",
                        metadata={"category": "permissions", "difficulty": "easy"})


def fix_script(rng: random.Random) -> TerminalTask:
    n = rng.randint(3, 30)
    variable = rng.choice(["total", "sum", "acc"])
    typo = variable[:-1]
    script = rng.choice(["count.sh", "add.sh", "tally.sh"])
    body = (f"{variable}=0\nfor i in $(seq 1 {n}); do\n  {variable}=$(({variable} + i))\ndone\n"
            f"echo ${typo}\n")
    setup = _heredoc(script, body)
    return TerminalTask("", f"`{script}` should print the sum of the numbers 1 to {n}, but "
                        "prints an empty line. Fix the script.",
                        f'[ "$(bash {script})" = "{n * (n + 1) // 2}" ]\n', setup,
                        f"sed -i 's/echo \\${typo}$/echo ${variable}/' {script}\n",
                        metadata={"category": "debugging", "difficulty": "medium"})


FAMILIES: dict[str, list[Callable[[random.Random], TerminalTask]]] = {
    "files": [create_file, move_files],
    "text": [grep_lines, replace_word, sum_column, count_distinct],
    "scripts": [write_script],
    "archives": [make_archive, extract_archive],
    "permissions": [permissions],
    "debugging": [fix_script],
}
GENERATORS = [g for group in FAMILIES.values() for g in group]


def draw(seed: int, split: str) -> TerminalTask:
    """The task of one generator seed: its family by the seed, its content by a seeded rng."""
    rng = random.Random(seed)
    generator = GENERATORS[seed % len(GENERATORS)]
    task = generator(rng)
    name = f"{split}-{seed:07d}-{generator.__name__.replace('_', '-')}"
    return TerminalTask(name, task.instruction, task.test, task.setup, task.solution,
                        metadata=task.metadata | {"generator": generator.__name__, "seed": seed,
                                                  "split": split})


def suite(train: int, held_out: int, seed: int = 0) -> tuple[list[TerminalTask], list[TerminalTask]]:
    """`train` tasks from generator seeds seed, seed+1, ...; `held_out` from seeds at
    HELD_OUT_SEED_BASE + seed upwards, skipping any whose instruction a train task has."""
    train_tasks = [draw(seed + i, "train") for i in range(train)]
    seen = {t.instruction for t in train_tasks}
    held: list[TerminalTask] = []
    next_seed = HELD_OUT_SEED_BASE + seed
    while len(held) < held_out:
        task = draw(next_seed, "heldout")
        next_seed += 1
        if task.instruction not in seen:
            held.append(task)
            seen.add(task.instruction)
    return train_tasks, held


def write_suite(out: str | Path, train: int, held_out: int, seed: int = 0) -> dict[str, int]:
    """The suite's folders under `out/train` and `out/heldout`; returns the counts by category
    (family)."""
    root = Path(out)
    train_tasks, held = suite(train, held_out, seed)
    counts: dict[str, int] = {}
    for split, tasks in (("train", train_tasks), ("heldout", held)):
        for task in tasks:
            task.write(root / split / task.name)
            category = task.metadata["category"]
            counts[category] = counts.get(category, 0) + 1
    return counts
