#!/usr/bin/env bash
# Refreshes tests/ctest_costs.txt (cmake/DtensorTestCosts.cmake: the order a clean clone's first ctest runs
# the tests in, and the `slow` label) from the cost data of the last full `scripts/test.sh` run in build/,
# and prints the slowest tests. Run it after a full run on the 2-core machine, and commit the file.
# ctest's own cost file loses tests whose names hold spaces (most Catch2 cases), so an entry of the committed
# file stays for each test of today's build that the run's data lacks; tests that no longer exist go.
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-build/Testing/Temporary/CTestCostData.txt}
[[ -f $data ]] || { echo "test_costs: no $data: run scripts/test.sh first" >&2; exit 1; }
build=$(cd "$(dirname "$data")/../.." && pwd)
ctest --test-dir "$build" --show-only=json-v1 | python3 -c '
import json, sys
names = {t["name"] for t in json.load(sys.stdin)["tests"]}
def entries(lines):  # "<name> <runs> <average seconds>"; names may hold spaces; "---" ends the tests
    found = {}
    for line in lines:
        if line.strip() == "---":
            break
        parts = line.rstrip("\n").rsplit(" ", 2)
        if len(parts) == 3 and parts[0] in names:
            found[parts[0]] = (parts[1], float(parts[2]))
    return found
costs = entries(open("tests/ctest_costs.txt"))
costs.update(entries(open(sys.argv[1])))
rows = sorted(costs.items(), key=lambda kv: -kv[1][1])
open("tests/ctest_costs.txt", "w").write("".join(f"{n} {r} {c:g}\n" for n, (r, c) in rows))
' "$data"
echo "test_costs: $(wc -l <tests/ctest_costs.txt) tests in tests/ctest_costs.txt; the slowest:"
head -n 15 tests/ctest_costs.txt | awk '{ c = $NF; NF -= 2; printf "  %7.1f s  %s\n", c, $0 }'
awk '$NF >= 10 { n++; s += $NF } { t += $NF } END { printf "  %d tests of 10 s or more (label slow): %.0f s of %.0f s in all\n", n, s, t }' tests/ctest_costs.txt
