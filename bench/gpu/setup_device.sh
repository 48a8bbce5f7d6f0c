#!/usr/bin/env bash
# Set up specflow on the offline GPU machine, from the repo root, with the wheels that
# bench/gpu/stage_wheels.sh put in .wheels/ (carried along). Idempotent: a second run takes seconds.
#
# Makes .venv over the machine's own Python packages (torch, transformers, lightning: a .pth file
# puts them on the venv's path, whether they live in the system or in another environment),
# installs the missing wheels into it without network, and specflow in editable mode; then
# touches the stamp `make setup` leaves, so `make test-gpu` does not try to reach PyPI.
# Afterwards: `. .venv/bin/activate` (puts .venv/bin, and with it flashinfer's `ninja`, on PATH).
set -euo pipefail
PY=${PY:-python3}
VENV=${VENV:-.venv}
WHEELS=${WHEELS:-.wheels}
ls "$WHEELS"/flashinfer_python-*.whl >/dev/null 2>&1 || {
    echo "no flashinfer wheel in $WHEELS/: run bench/gpu/stage_wheels.sh where there is network, carry $WHEELS" >&2
    exit 1
}

"$PY" -m pip --version >/dev/null || { echo "$PY has no pip: set PY to the Python that has torch and pip" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --without-pip "$VENV"
    site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    # after the venv's own packages: every site dir of $PY, with the .pth files inside them
    "$PY" -c "import sys; dirs = list(dict.fromkeys(p for p in sys.path if p.endswith('-packages'))); \
print('import site; list(map(site.addsitedir, %r))' % dirs)" > "$site/_machine_site.pth"
fi
pip=("$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS")

# --no-deps: its metadata lists packages (cuda-python, cutlass-dsl, ...) the attention path never imports;
# pip then reports them as missing, which is expected
"${pip[@]}" --no-deps "$WHEELS"/flashinfer_python-*.whl
# kernels stage_wheels.sh built ahead of time: flashinfer loads data/aot/<name>/<name>.so before
# compiling anything (and compiles after all if one fails to load)
if [ -d "$WHEELS/flashinfer-aot" ]; then
    aot=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")/flashinfer/data/aot
    mkdir -p "$aot" && cp -r "$WHEELS"/flashinfer-aot/. "$aot"/
fi
"${pip[@]}" apache-tvm-ffi requests nvidia-ml-py ninja "omegaconf>=2.3" einops \
    pytest pytest-xdist hypothesis "setuptools>=68"
"${pip[@]}" --no-deps --no-build-isolation -e .
# pytest may come from the machine's packages (then pip installs no script into the venv)
if [ ! -x "$VENV/bin/pytest" ]; then
    printf '#!/bin/sh\nexec "$(dirname "$0")/python" -m pytest "$@"\n' > "$VENV/bin/pytest"
    chmod +x "$VENV/bin/pytest"
fi
touch "$VENV/.installed-dev"

PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/python" -c "
import shutil, torch, flashinfer, specflow
from flashinfer.jit import env
from flashinfer.jit.norm import gen_norm_module
from specflow.runtime.flashinfer_backend import flashinfer_available
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'
aot = len(list(env.FLASHINFER_AOT_DIR.glob('*/*.so')))
loads = aot and gen_norm_module().try_load() is not None  # a prebuilt module loads here (else: JIT builds)
print('torch', torch.__version__, '| cuda', torch.version.cuda, '|', gpu, '| flashinfer', flashinfer.__version__,
      '| available', flashinfer_available(), '| prebuilt modules', aot, '| they load', bool(loads),
      '| nvcc', shutil.which('nvcc'), '| ninja', shutil.which('ninja'))
"
