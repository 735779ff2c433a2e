# Set-up for a fresh machine: `make demo` and `make test` each create .venv when missing,
# install the project into it and run. An existing torch is never replaced.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.stabilitywatch-installed

.PHONY: demo test install clean

$(VPY):
	$(PY) -m venv --system-site-packages $(VENV)

# torch: keep whatever torch the interpreter already sees (a GPU machine's own build);
# otherwise take the CPU build 2.13.0 on a machine without a GPU, plain torch on one with.
$(STAMP): $(VPY) pyproject.toml
	@if $(VPY) -c "import torch" 2>/dev/null; then \
	  echo "torch already present: $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	  $(VPY) -m pip install -q torch; \
	else \
	  $(VPY) -m pip install -q torch==2.13.0; \
	fi
	$(VPY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VPY) -m stabilitywatch demo --out runs/demo

test: $(STAMP)
	$(VPY) -m pytest -q -n auto --dist worksteal tests

clean:
	rm -rf $(VENV) runs .pytest_cache
