#!/usr/bin/env bash
# The layer picture (docs/design.md, Layering), checked: a header may include only headers of its own layer or
# of the layers below it. core <- layout <- local <- rendezvous <- backends <- comm <- mesh, plan <- exec <-
# tensor <- backward <- ops, checkpoint <- nn <- train <- testing (mesh and plan, ops and checkpoint are side
# by side and do not include each other). nn/ holds layers and models (the model contract), train/ what trains
# them (the trainers, FSDP, DDP, optimizers, pipelines, the training state). layout/ holds placements and the
# layout algebra: how the blocks of a tensor sit on a mesh (ShardSpec: one dim split over several axes) and
# how one layout's blocks map onto another's (the exchange geometry). local/ holds the kernels a rank runs on
# its own tensors (copies, maps, reductions, GEMM, random fills). backward/ holds what a backward pass is made
# of: WithBackward, the dual of a placement and of a redistribution, collectives paired with their adjoint.
#
# No cycle: every edge between two folders goes to a strictly lower floor (an edge within a folder is not one
# of the folder graph), so the folder graph is a DAG; a cycle would need an edge that goes up or sideways,
# which this check reports. Only the umbrella headers at the top (dtensor.hpp, ops.hpp, nn.hpp, train.hpp,
# parallel.hpp: no folder, no floor) may include any folder; a header in a folder that includes an umbrella,
# or a header of a higher floor or of a side-by-side folder, is reported. An unknown folder has no floor and
# is reported too, whether a header lives in it or is included from it, so a new folder must be given one
# here.
#
# usage: tests/check_layers.sh [include dir]
set -euo pipefail
root=${1:-"$(dirname "$0")/../include"}
declare -A floor=([core]=0 [layout]=1 [local]=2 [rendezvous]=3 [backends]=4 [comm]=5 [mesh]=6 [plan]=6 [exec]=7
  [tensor]=8 [backward]=9 [ops]=10 [checkpoint]=10 [nn]=11 [train]=12 [testing]=13)
bad=0
checked=0
# Every include of every header at once: "file:dtensor/included/path" (no process per include).
while IFS= read -r line; do
  f=${line%%:*}
  inc=${line#*:}
  inc=${inc#*dtensor/}
  rel=${f#"$root/dtensor/"}
  [[ $rel == */* ]] || continue # an umbrella header includes everything
  if [[ $inc != */* ]]; then
    echo "layering: dtensor/$rel includes dtensor/$inc, an umbrella header: include the header it needs"
    bad=1
    continue
  fi
  layer=${rel%%/*}
  used=${inc%%/*}
  mine=${floor[$layer]:--1}
  if ((mine < 0)); then
    echo "layering: dtensor/$rel is in $layer/, a folder with no floor: give it one in tests/check_layers.sh"
    bad=1
    continue
  fi
  theirs=${floor[$used]:--1}
  checked=$((checked + 1))
  if ((theirs < 0)); then
    echo "layering: dtensor/$rel includes dtensor/$inc, in $used/, a folder with no floor"
    bad=1
  elif ((theirs > mine)) || { [[ $layer != "$used" ]] && ((theirs == mine)); }; then
    echo "layering: dtensor/$rel ($layer) includes dtensor/$inc ($used), a layer above or beside it"
    bad=1
  fi
done < <(find "$root/dtensor" -name '*.hpp' | sort | xargs grep -oHE '#include ["<]dtensor/[^">]+' |
  sed -E 's/#include ["<]//')
# A header in a folder with no floor and no includes of its own is caught too.
while IFS= read -r f; do
  rel=${f#"$root/dtensor/"}
  [[ $rel == */* ]] || continue
  layer=${rel%%/*}
  if [[ -z ${floor[$layer]:-} ]]; then
    echo "layering: dtensor/$rel is in $layer/, a folder with no floor: give it one in tests/check_layers.sh"
    bad=1
  fi
done < <(find "$root/dtensor" -name '*.hpp' | sort)
echo "layering: $checked includes checked"
if ((bad == 0)); then
  echo "layering: every edge between folders goes down a floor, so the folder graph has no cycle"
fi
exit $bad
