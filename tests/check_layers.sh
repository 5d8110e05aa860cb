#!/usr/bin/env bash
# The layer picture (docs/design.md, Layering), checked: a header may include only headers of its own layer or
# of the layers below it. core <- local <- rendezvous <- backends <- comm <- mesh, plan <- exec <- tensor
# <- ops, checkpoint <- parallel <- testing (mesh and plan, ops and checkpoint are side by side and do not
# include each other). local/ holds the kernels a rank runs on its own tensors (copies, maps, reductions,
# GEMM, random fills): they need only core/, and every layer above may use them.
# usage: tests/check_layers.sh [include dir]
set -euo pipefail
root=${1:-"$(dirname "$0")/../include"}
level() {
  case $1 in
    core) echo 0 ;; local) echo 1 ;; rendezvous) echo 2 ;; backends) echo 3 ;; comm) echo 4 ;;
    mesh | plan) echo 5 ;; exec) echo 6 ;; tensor) echo 7 ;; ops | checkpoint) echo 8 ;; parallel) echo 9 ;;
    testing) echo 10 ;; *) echo -1 ;;
  esac
}
bad=0
checked=0
while IFS= read -r f; do
  rel=${f#"$root/dtensor/"}
  [[ $rel == */* ]] || continue # the umbrella header includes everything
  layer=${rel%%/*}
  mine=$(level "$layer")
  while IFS= read -r inc; do
    used=${inc%%/*}
    theirs=$(level "$used")
    checked=$((checked + 1))
    if ((theirs < 0 || theirs > mine)) || { [[ $layer != "$used" ]] && ((theirs == mine)); }; then
      echo "layering: dtensor/$rel ($layer) includes dtensor/$inc ($used), a layer above or beside it"
      bad=1
    fi
  done < <(grep -hoE '#include ["<]dtensor/[a-z_]+/[^">]+' "$f" | sed -E 's/#include ["<]dtensor\///')
done < <(find "$root/dtensor" -name '*.hpp' | sort)
echo "layering: $checked includes checked"
exit $bad
