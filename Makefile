# The README's commands. Every target sets up the virtual environment first if needed.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

# Main job (until the notebooks land): a short CPU-friendly training run of the tiny preset
# that writes a grid of samples to figures/quickstart_samples.png.
RUN_ARGS ?= --model tiny --dataset auto --steps 300 --batch-size 32 --lr 1e-3 --warmup-steps 50 \
            --ema-decay 0.99 --checkpoint-every 100 --out-dir runs/quickstart \
            --sample-grid figures/quickstart_samples.png --samples 64 --sample-steps 100

.PHONY: setup run test lab cifar10 clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[dev]"
	$(PY) -c "import torch, torchvision, ddpm_core; print('torch', torch.__version__, '| torchvision', torchvision.__version__)"
	touch $(STAMP)

setup: $(STAMP)          ## create .venv and install the project with its dev tools

run: $(STAMP)            ## the main job
	$(PY) -m ddpm_core.train $(RUN_ARGS)

test: $(STAMP)           ## the test suite (CPU; GPU tests are skipped without a GPU)
	$(PY) -m pytest

lab: $(STAMP)            ## open the series in JupyterLab
	$(VENV)/bin/jupyter lab notebooks/

cifar10: $(STAMP)        ## download CIFAR-10 into data/ (needs internet)
	$(PY) -c "from ddpm_core.data import CIFAR10Images; CIFAR10Images()"

clean:                   ## remove run outputs and generated data (keeps downloads of CIFAR-10)
	rm -rf runs data/synthetic .pytest_cache
