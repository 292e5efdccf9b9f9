#!/usr/bin/env bash
# Download into .whl/ the wheels a bare GPU machine needs for `make reference` but lacks: it has
# python 3.12 with torch, numpy, pandas, matplotlib and seaborn, and no network. Run this HERE (with
# network), carry .whl/ to the GPU machine, and start the command there with:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD
#
# Versions are the ones this repo's .venv tested (pip freeze), so both machines run the same code.
# Not carried, because the device image has them (/work/.library/device/KINDS.md, 'Python packages already there'):
# torchvision 0.26 (paired with its torch 2.11), scipy, and pytest with its plugins (xdist, timeout, cov, mock,
# benchmark): a carried pytest would shadow the image's and load those plugins against another version.
# TORCHVISION=0.26.0 adds torchvision (it must pair with the machine's torch: 0.N <-> torch 2.(N-15)).
# scripts/gpu_call.sh runs one reference command there with them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TORCHVISION=${TORCHVISION:-}
NAMES="HolisticTraceAnalysis plotly narwhals pydot pyparsing papermill nbclient nbformat jupyter_client jupyter_core
ipykernel ipython ipython_pygments_lexers traitlets comm tenacity entrypoints pyzmq tornado fastjsonschema
jsonschema jsonschema-specifications referencing rpds-py attrs click PyYAML requests charset-normalizer idna urllib3
certifi decorator pexpect ptyprocess prompt_toolkit wcwidth Pygments stack-data executing asttokens
pure_eval matplotlib-inline nest-asyncio2 platformdirs python-dateutil tqdm psutil
ipywidgets jupyterlab_widgets packaging typing_extensions six
diffusers huggingface_hub safetensors filelock regex httpx2 httpcore2 anyio h11 truststore
denoising-diffusion-pytorch accelerate einops ema-pytorch defusedxml"
# Left out, because a headless kernel runs without them (the smoke series ran so here, in a venv without them) and
# they are 12.6 MB of a carry limited to 64 MB, which the committed reference folder grows into: jedi and parso
# (IPython's completer), debugpy (ipykernel's debugger), widgetsnbextension (the classic notebook's widgets).
# The peers of notebook 09b (bench_peers) above are about 9 MB. denoising-diffusion-pytorch also imports
# scipy (35 MB), which would take the carry past its 64 MB: it is added only with PEERS_SCIPY=1, for a
# GPU machine whose python lacks scipy (check there first: python3 -c "import scipy"). Without it,
# bench_peers reports lucidrains as "not installed" and measures the others.
if [ "${PEERS_SCIPY:-0}" = 1 ]; then NAMES="$NAMES scipy"; fi
freeze=$("$PY" -m pip freeze 2>/dev/null)
specs=()
for n in $NAMES; do
  v=$(printf '%s\n' "$freeze" | grep -i -E "^${n//[-_]/[-_]}==" | head -1 || true)
  specs+=("${v:-$n}")
done
if [ -n "$TORCHVISION" ]; then specs+=("torchvision==$TORCHVISION"); fi
mkdir -p .whl
for s in "${specs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$s" \
    || { echo "could not download $s" >&2; exit 1; }
done
du -sh .whl
