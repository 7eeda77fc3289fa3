#!/usr/bin/env bash
# Prepares .device-carry/ for running the notebooks on the GPU machine (no registry there):
#   source .device-carry/activate.sh && python3 tools/run_notebooks.py --set h200 --out "$OUT/notebooks"
#
# .device-carry/ is the layout of the shared tools/device-carry.sh (wheels/ installed with pip --target /tmp/site,
# site/ copied there, activate.sh puts /tmp/site and the checkout on PYTHONPATH): transformers as installed here,
# bitsandbytes with its CUDA 13 libraries only. This script builds that same layout itself when it is missing
# (device-carry.sh writes .git/info/exclude, which is not a folder in a git worktree) and adds the wheels of
# nbclient's kernel stack, none of which the GPU image holds (nbclient, nbformat, jupyter_client, jupyter_core,
# ipykernel, IPython, pyzmq, tornado, traitlets, jsonschema, ...), plus matplotlib (the image has it and its
# dependencies; carried so that the plots do not hang on that; NOTEBOOK_CARRY_MATPLOTLIB=0 leaves it out).
#
# The wheels are those pip resolves for the GPU machine's python (3.12, x86_64 manylinux; KINDS.md: Python 3.12.3),
# minus the packages the image already holds (numpy, pillow, packaging, pygments, psutil, python-dateutil, attrs,
# typing-extensions, matplotlib's dependencies) and two optional ones: debugpy (ipykernel runs without its debugger)
# and jedi/parso (IPython completes without them). About 15 MB of wheels, 37 MB in all with the base.
#
# Here, from the checkout:   tools/notebook-carry.sh            (REBUILD=1 rebuilds the base too)
# Then carry [".device-carry"].
set -euo pipefail
root=$(git rev-parse --show-toplevel)
dst=$root/.device-carry
cd "$root"
git check-ignore -q .device-carry/activate.sh || echo '/.device-carry/' >>"$(git rev-parse --git-path info/exclude)"

pyver=${DEVICE_PYTHON_VERSION:-3.12}
abi=cp${pyver/./}
platform=(--only-binary=:all: --python-version "$pyver" --implementation cp --abi "$abi"
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

download() {  # pip download, its warnings dropped
  python3 -m pip download -q "$@" 2>&1 | { grep -v '^WARNING' || true; }
}

if [[ ! -f $dst/activate.sh || -n ${REBUILD:-} ]]; then  # the base, as device-carry.sh makes it
  rm -rf "$dst" && mkdir -p "$dst/wheels" "$dst/site"
  tv=$(python3 -c 'import transformers; print(transformers.__version__)' 2>/dev/null || true)
  tv=${TRANSFORMERS_VERSION:-${tv:-5.23.0}}
  download --no-deps -d "$dst/wheels" "transformers==$tv"
  bv=${BITSANDBYTES_VERSION:-0.50.2}
  tmp=$(mktemp -d)
  download --no-deps -d "$tmp" "bitsandbytes==$bv"
  (cd "$dst/site" && unzip -q "$tmp"/bitsandbytes-*.whl -x 'bitsandbytes/libbitsandbytes_cuda1[12]*' \
    'bitsandbytes/libbitsandbytes_rocm*' 'bitsandbytes/libbitsandbytes_xpu*')
  rm -rf "$tmp"
  cat >"$dst/activate.sh" <<'EOF'
# sourced on the GPU machine
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .device-carry/wheels/*.whl \
  && cp -r .device-carry/site/* /tmp/site/ \
  && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
  && python3 -c 'import torch, transformers, bitsandbytes; print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "transformers", transformers.__version__, "bnb", bitsandbytes.__version__)'
EOF
fi

# the notebook stack: resolved with its dependencies for the GPU machine's python, then trimmed
wanted=(nbclient nbformat jupyter_client ipykernel)
[[ ${NOTEBOOK_CARRY_MATPLOTLIB:-1} != 0 ]] && wanted+=(matplotlib)
on_image='^(numpy|pillow|packaging|pygments|psutil|python_dateutil|six|tzdata|attrs|typing_extensions|contourpy|cycler|fonttools|kiwisolver|pyparsing|debugpy|jedi|parso)-'
tmp=$(mktemp -d)
download "${platform[@]}" -d "$tmp" "${wanted[@]}"
if [[ -f $dst/notebook-wheels.txt ]]; then  # the previous run's, so that one version of each stays
  (cd "$dst/wheels" && xargs -r rm -f <"$dst/notebook-wheels.txt")
fi
ls "$tmp" | grep -Ev "$on_image" >"$dst/notebook-wheels.txt"
(cd "$tmp" && xargs -I{} mv {} "$dst/wheels/" <"$dst/notebook-wheels.txt")
rm -rf "$tmp"
twice=$(ls "$dst/wheels" | sed -E 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[[ -z $twice ]] || { echo "two versions of: $twice (pip --target would stop): remove one" >&2; exit 1; }
echo "wheels: $(ls "$dst/wheels" | tr '\n' ' ')"
du -sh "$dst"
echo "ready: carry [\".device-carry\"] and run: source .device-carry/activate.sh && python3 tools/run_notebooks.py --set h200 --out \$OUT/notebooks"
