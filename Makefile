# The README's commands. Every target sets up the virtual environment first if needed.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# The git filter that keeps notebook outputs and kernel-specific metadata out of git (.gitattributes):
# what JupyterLab adds when it runs and saves a notebook is stripped before git compares or commits.
NBSTRIP := $(abspath $(VENV))/bin/nbstripout --keep-id --extra-keys metadata.language_info

.PHONY: setup run notebook figures test lab cifar10 weights reference student grade clean

$(STAMP): pyproject.toml constraints.txt jupyter/jupyter_server_config.json
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -c constraints.txt -e ".[dev]"
	$(PY) -c "import torch, torchvision, ddpm_core; print('torch', torch.__version__, '| torchvision', torchvision.__version__)"
	-git config filter.nbstripout.clean "$(NBSTRIP)" && git config filter.nbstripout.smudge cat
	mkdir -p $(VENV)/etc/jupyter   # JupyterLab's save hook, for servers of this environment: see ddpm_core/lab.py
	cp jupyter/jupyter_server_config.json $(VENV)/etc/jupyter/jupyter_server_config.json
	touch $(STAMP)

setup: $(STAMP)          ## create .venv and install the project with its dev tools

run: $(STAMP)            ## the main job: every numbered notebook, headless (smoke mode without a GPU)
	$(PY) -m ddpm_core.series

notebook: $(STAMP)       ## one notebook and its figures: make notebook NB=03
	$(PY) -m ddpm_core.series $(NB)

figures: run             ## maintainers: the main job, then its figures into the committed figures/ (a GPU run's stay)
	$(PY) -m ddpm_core.reference figures
	$(PY) -m ddpm_core.reference readme

test: $(STAMP)           ## the test suite (CPU; GPU tests are skipped without a GPU)
	$(PY) -m pytest

reference: $(STAMP)      ## the reference run on a GPU: gpu tests + every notebook in full mode -> data/reference/<gpu>/
	$(PY) -m ddpm_core.reference run

student: $(STAMP)        ## student copies of the notebooks, without the worked solutions -> student/
	$(PY) -m ddpm_core.student

grade: $(STAMP)          ## check a notebook's run (results rows, device labels, figures): make grade NB=03
	$(PY) -m ddpm_core.grade $(NB)

lab: $(STAMP)            ## open the series in JupyterLab
	$(VENV)/bin/jupyter lab notebooks/

cifar10: $(STAMP)        ## download CIFAR-10 into data/ (needs internet)
	$(PY) -c "from ddpm_core.data import CIFAR10Images; CIFAR10Images()"

weights: $(STAMP)        ## download the paper's CIFAR-10 weights (google/ddpm-cifar10-32, 143 MB) into data/pretrained/ (needs internet)
	$(PY) -m ddpm_core.pretrained download

clean:                   ## remove run outputs and generated data (keeps downloads of CIFAR-10)
	rm -rf runs data/synthetic .pytest_cache
