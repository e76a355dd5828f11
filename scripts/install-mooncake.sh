#!/usr/bin/env bash
# Install the Mooncake Transfer Engine into the venv, with the system libraries it needs even
# for TCP (libibverbs). As root with apt they are installed here; otherwise this stops with
# the exact command to run, or with --optional only warns (Mooncake tests then skip).
#
#   scripts/install-mooncake.sh VENV_PYTHON [--optional]
set -euo pipefail
python=$1
optional=${2:-}
packages="libibverbs1 libnl-3-200 libnl-route-3-200"
command="apt-get update && apt-get install -y $packages"

if "$python" -c "import mooncake.engine" 2>/dev/null; then
  exit 0
fi
if ! ldconfig -p | grep -q "libibverbs.so.1 "; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing $packages for Mooncake"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq $packages >/dev/null
  elif [ "$optional" = --optional ]; then
    echo "warning: Mooncake needs libibverbs; as root run: $command (Mooncake tests will skip)"
    exit 0
  else
    echo "error: Mooncake needs libibverbs; as root run: $command" >&2
    exit 1
  fi
fi
"$python" -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/mooncake.txt
"$python" -c "import mooncake.engine"
