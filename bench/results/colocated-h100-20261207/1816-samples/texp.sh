# the sample-building timing on the device host, without ray or SGLang: bash texp.sh (from the repository root, its wheels in .dev/wheels/2)
mkdir -p /tmp/site
pip install -q --no-deps --target /tmp/site .dev/wheels/2/antlr4*.whl .dev/wheels/2/hydra_core*.whl .dev/wheels/2/omegaconf*.whl .dev/wheels/2/datasets*.whl .dev/wheels/2/dill*.whl .dev/wheels/2/multiprocess*.whl > /tmp/texp-pip.log 2>&1 || tail -5 /tmp/texp-pip.log
PYTHONPATH=/tmp/site:. VLMRL_CACHE=/tmp/vc python3 .dev/gpu/texp.py 2>&1 | grep -v Warning | tail -40
