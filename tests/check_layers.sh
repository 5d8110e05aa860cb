#!/usr/bin/env bash
# The layer picture (docs/design.md, Layering), checked: a header may include only headers of its own layer or
# of the layers below it. core <- layout <- local <- rendezvous <- backends <- comm <- mesh, plan <- exec
# <- tensor <- backward <- ops, checkpoint <- parallel <- testing (mesh and plan, ops and checkpoint are
# side by side and do not include each other). layout/ holds placements and the layout algebra: how the
# blocks of a tensor sit on a mesh (ShardSpec: one dim split over several axes) and how one layout's
# blocks map onto another's (the exchange geometry). local/ holds the kernels a rank runs on its own
# tensors (copies, maps, reductions, GEMM, random fills). backward/ holds what a backward pass is made of:
# WithBackward, the dual of a placement and of a redistribution, collectives paired with their adjoint.
#
# No cycle: every edge between two folders goes to a strictly lower floor (an edge within a folder is not
# one of the folder graph), so the folder graph is a DAG; a cycle would need an edge that goes up or
# sideways, which this check reports. An unknown folder has no floor and is reported too, so a new folder
# must be given one here.
#
# Forwarding headers (a moved header's old path: "// Deprecated: moved to <dtensor/...>" and the include
# of the new path) are exempt, as the umbrella headers are: they point from the old floor to the new one.
# So that no real edge runs through one, nothing under the include dir may include a forwarding header.
#
# usage: tests/check_layers.sh [include dir]
set -euo pipefail
root=${1:-"$(dirname "$0")/../include"}
level() {
  case $1 in
    core) echo 0 ;; layout) echo 1 ;; local) echo 2 ;; rendezvous) echo 3 ;; backends) echo 4 ;;
    comm) echo 5 ;; mesh | plan) echo 6 ;; exec) echo 7 ;; tensor) echo 8 ;; backward) echo 9 ;;
    ops | checkpoint) echo 10 ;; parallel) echo 11 ;; testing) echo 12 ;; *) echo -1 ;;
  esac
}
bad=0
checked=0
forwarders=$(grep -lE '^// Deprecated: moved to <dtensor/' -r "$root/dtensor" --include='*.hpp' |
  sed -E "s#^$root/##" | sort || true)
while IFS= read -r f; do
  rel=${f#"$root/dtensor/"}
  while IFS= read -r inc; do
    if grep -qxF "dtensor/$inc" <<<"$forwarders"; then
      echo "layering: dtensor/$rel includes dtensor/$inc, a forwarding header: include its new path"
      bad=1
    fi
  done < <(grep -hoE '#include ["<]dtensor/[^">]+' "$f" | sed -E 's/#include ["<]dtensor\///')
  [[ $rel == */* ]] || continue # the umbrella header includes everything
  grep -qxF "dtensor/$rel" <<<"$forwarders" && continue # a forwarding header (above)
  layer=${rel%%/*}
  mine=$(level "$layer")
  if ((mine < 0)); then
    echo "layering: dtensor/$rel is in $layer/, a folder with no floor: give it one in tests/check_layers.sh"
    bad=1
    continue
  fi
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
echo "layering: $checked includes checked, $(grep -c . <<<"$forwarders") forwarding headers exempt"
if ((bad == 0)); then
  echo "layering: every edge between folders goes down a floor, so the folder graph has no cycle"
fi
exit $bad
