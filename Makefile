# The two commands a user needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REROLL := $(VENV)/bin/reroll
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit test-e2e lint setup clean

setup: $(STAMP)

# bubblewrap (the sandbox for untrusted code) from Debian, then torch first (the pinned CPU
# build), then the package with its dev extras.
$(STAMP): pyproject.toml
	command -v bwrap >/dev/null || { apt-get update -qq && apt-get install -y -qq bubblewrap; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

models/tiny/config.json: | $(STAMP)
	$(REROLL) make-model --out models/tiny --preset tiny

data/arithmetic/train.jsonl: | $(STAMP)
	$(REROLL) make-data --out data/arithmetic

# Tiny model -> SFT warm start -> GRPO with held-out evaluation; prints the summary.
demo: $(STAMP) models/tiny/config.json data/arithmetic/train.jsonl
	$(REROLL) sft examples/arithmetic/sft.yaml
	$(REROLL) train examples/arithmetic/grpo.yaml

# Every tier this machine can run: unit, e2e (tiny models). Exit code 5 (no tests selected) is fine.
test: $(STAMP)
	$(PY) -m pytest -q -m "unit or not (e2e or ray or vllm or gpu)" ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc
	$(PY) -m pytest -q -m e2e ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check reroll tests benchmarks

clean:
	rm -rf runs models/tiny data/arithmetic
