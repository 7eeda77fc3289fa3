# Sourced on the GPU machine after .device-carry/activate.sh (";" between them: activate.sh fails where the carried
# transformers does not import):
#
#   source .device-carry/activate.sh; source tools/device_env.sh && python3 -m pytest -q tests/test_nf4_cuda.py
#
# A carried transformers newer than the machine's huggingface-hub allows fails to import (5.25 wants hub >= 2.4;
# the machine had 1.33 on 2026-12-06 and 12-07): use the machine's own transformers then, and say which.
if ! python3 -c "import transformers" 2>/dev/null && [ -d /tmp/site/transformers ]; then
    rm -rf /tmp/site/transformers /tmp/site/transformers-*
    echo "carried transformers does not import here; using the machine's $(python3 -c 'import transformers; print(transformers.__version__)')"
fi
