// Compile-fail cases for the compile-time vocabulary. Each `//! CASE name regex` line is one ctest case
// that compiles this file with -DCASE_name and expects its first error (the first line of the compiler's
// output with ": error:") to match regex: the intended message, from its start. A declaration is one line
// of at most 110 columns (clang-format wraps longer comments, and only the first line is read); write
// regex metacharacters as `.`. Without a case the file must compile.
#include <dtensor/layout/placement_check.hpp>
#include <dtensor/mesh/mesh_shape.hpp>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 4>>;

//! CASE zero_axis_size Axis<name, Size>: Size must be > 0; write Axis<.name.> for a size known only at run
#ifdef CASE_zero_axis_size
using Bad = MeshShape<Axis<"tp", 0>>;
constexpr int n = Bad::rank;
#endif

//! CASE empty_axis_name Axis<..>: a mesh axis needs a non-empty name
#ifdef CASE_empty_axis_name
constexpr int n = Axis<"">::size;
#endif

//! CASE duplicate_axis_names MeshShape: two axes have the same name; give every axis a unique name
#ifdef CASE_duplicate_axis_names
constexpr int n = MeshShape<Axis<"tp", 2>, Axis<"tp", 4>>::rank;
#endif

//! CASE not_an_axis MeshShape<...> takes Axis<.name., size> or Axis<.name.> arguments only
#ifdef CASE_not_an_axis
constexpr int n = MeshShape<int>::rank;
#endif

//! CASE unknown_axis_name MeshShape::index_of<.name.>: no mesh axis has this name
#ifdef CASE_unknown_axis_name
constexpr int n = Mesh::index_of<"pp">();
#endif

//! CASE too_few_placements wrong number of placements: give exactly one placement per mesh axis
#ifdef CASE_too_few_placements
constexpr bool ok = validate_placements<Mesh, 2, Shard<0>>();
#endif

//! CASE too_many_placements wrong number of placements: give exactly one placement per mesh axis
#ifdef CASE_too_many_placements
constexpr bool ok = validate_placements<Mesh, 2, Shard<0>, Replicate, Replicate>();
#endif

//! CASE shard_dim_too_large Shard<D>: D must be in .-rank, rank. of the tensor .use Shard<-1> for the last
#ifdef CASE_shard_dim_too_large
constexpr bool ok = validate_placements<Mesh, 2, Shard<2>, Replicate>();
#endif

//! CASE shard_dim_too_negative Shard<D>: D must be in .-rank, rank.
#ifdef CASE_shard_dim_too_negative
constexpr bool ok = validate_placements<Mesh, 2, Replicate, Shard<-3>>();
#endif

//! CASE mixed_partial_ops Partial placements with different ops on different mesh axes: only Partial<sum>
#ifdef CASE_mixed_partial_ops
constexpr bool ok = validate_placements<Mesh, 2, Partial<ReduceOp::sum>, Partial<ReduceOp::max>>();
#endif

//! CASE not_a_placement placements must be Shard<D>, Replicate or Partial<ReduceOp>
#ifdef CASE_not_a_placement
constexpr bool ok = validate_placements<Mesh, 2, Shard<0>, int>();
#endif

int main() {}
