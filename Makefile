# Set-up for a fresh machine: `make demo` and `make test` each create .venv when missing,
# install the project into it and run. An existing torch is never replaced.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.stabilitywatch-installed
# --no-compile: Python compiles a module when it is first imported, instead of pip compiling
# every file of every package (torch's tens of thousands) at install. The runs below write
# those compiled files (PYTHONDONTWRITEBYTECODE emptied): otherwise every process of the
# suite (workers, ranks, CLI runs) would compile torch again.
PIP := $(VPY) -m pip install -q --no-compile
RUN := PYTHONDONTWRITEBYTECODE= $(VPY)

.PHONY: demo test install clean

# The venv takes pip from the interpreter's own site-packages where it has one (the venv sees
# them): ensurepip's copy into the venv is most of the venv's creation time.
$(VPY):
	@if $(PY) -m pip --version >/dev/null 2>&1; then \
	  $(PY) -m venv --without-pip --system-site-packages $(VENV); \
	else \
	  $(PY) -m venv --system-site-packages $(VENV); \
	fi

# torch: keep whatever torch the interpreter already sees (a GPU machine's own build);
# otherwise take the CPU build 2.13.0 on a machine without a GPU, plain torch on one with.
# One pip run installs it with the project: a second run costs its own start-up and index
# look-ups (~3 s), and the project's requirements are resolved against that torch.
$(STAMP): $(VPY) pyproject.toml
	@if v=$$($(VPY) -c "import torch; print(torch.__version__)" 2>/dev/null); then \
	  echo "torch already present: $$v"; \
	  torch=; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	  torch=torch; \
	else \
	  torch=torch==2.13.0; \
	fi; \
	echo "$(PIP) $$torch -e \".[dev]\""; \
	$(PIP) $$torch -e ".[dev]"
	@# once here, not in each of the suite's first processes at the same time: the imports,
	@# and the CPU statistics' compiled loops (numba caches them beside their source)
	$(RUN) -c "import torch, stabilitywatch; from stabilitywatch.stats import cpu_jit; cpu_jit.wait()"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(RUN) -m stabilitywatch demo --out runs/demo

test: $(STAMP)
	$(RUN) -m pytest -q -n auto --dist worksteal tests

clean:
	rm -rf $(VENV) runs .pytest_cache
