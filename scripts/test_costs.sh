#!/usr/bin/env bash
# Refreshes tests/ctest_costs.txt (cmake/DtensorTestCosts.cmake: the order a clean clone's first ctest runs
# the tests in, and the `slow` label) from the cost data of the last full `scripts/test.sh` run in build/,
# and prints the slowest tests. Run it after a full run on the 2-core machine, and commit the file.
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-build/Testing/Temporary/CTestCostData.txt}
[[ -f $data ]] || { echo "test_costs: no $data: run scripts/test.sh first" >&2; exit 1; }
# Tests only (the failed-tests list after "---" is this machine's business), longest first.
# A line is "<name> <runs> <average seconds>"; names may hold spaces.
awk '$0 == "---" { exit } NF >= 3 { print $NF "\t" $0 }' "$data" | sort -t$'\t' -k1,1 -g -r | cut -f2- \
  >tests/ctest_costs.txt
echo "test_costs: $(wc -l <tests/ctest_costs.txt) tests in tests/ctest_costs.txt; the slowest:"
head -n 15 tests/ctest_costs.txt | awk '{ c = $NF; NF -= 2; printf "  %7.1f s  %s\n", c, $0 }'
awk '$NF >= 10 { n++; s += $NF } { t += $NF } END { printf "  %d tests of 10 s or more (label slow): %.0f s of %.0f s in all\n", n, s, t }' tests/ctest_costs.txt
