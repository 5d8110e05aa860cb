#!/usr/bin/env bash
# The layer picture (docs/design.md, Layering), checked: a header includes only headers of its own layer or
# of the layers below it. core <- rendezvous <- backends <- comm <- mesh, plan <- exec <- tensor <- ops, checkpoint
# <- parallel <- testing (mesh and plan, ops and checkpoint are side by side and do not include each other).
# usage: tests/check_layers.sh [include dir]
set -euo pipefail
root=${1:-"$(dirname "$0")/../include"}
level() {
  case $1 in
    core) echo 0 ;; rendezvous) echo 1 ;; backends) echo 2 ;; comm) echo 3 ;; mesh | plan) echo 4 ;;
    exec) echo 5 ;; tensor) echo 6 ;; ops | checkpoint) echo 7 ;; parallel) echo 8 ;; testing) echo 9 ;; *) echo -1 ;;
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
