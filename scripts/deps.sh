#!/usr/bin/env bash
# Installs the Debian packages dtensor's build, tests and demo need (fortunes: the GPT demo's text;
# gnuplot-nox: its loss curves; lld: links the test build's programs about 4x faster than GNU ld), if any is
# missing (idempotent: does nothing when all are present). Needs root or sudo only when something is missing.
#
#   scripts/deps.sh           # what the build and the demo need
#   scripts/deps.sh --tests   # and python3-torch, the peer of the interop tests (never a build dependency),
#                             # and python3-sklearn, whose 8x8 digits examples/11_vision.cpp reads
set -euo pipefail

packages=(g++ lld cmake ninja-build catch2 libgloo-dev libopenblas-dev librandom123-dev libdlpack-dev
          nlohmann-json3-dev libopenmpi-dev openmpi-bin fortunes gnuplot-nox)
if [[ ${1:-} == --tests ]]; then
  packages+=(python3-torch python3-sklearn)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
