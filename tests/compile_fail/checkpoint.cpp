// Compile-fail cases for checkpoints (checkpoint/checkpoint.hpp; format: see vocabulary.cpp).
#include <dtensor/checkpoint/checkpoint.hpp>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;

// The control: Shard and Replicate tensors save and load.
void control(const DTensor<float, 2, Mesh, Shard<0>, Replicate>& x, const DeviceMesh<Mesh>& mesh) {
  checkpoint::save("ckpt", {{"x", x}});
  (void)checkpoint::load<DTensor<float, 2, Mesh, Replicate, Shard<1>>>("ckpt", "x", mesh);
}

//! CASE save_partial checkpoint::save: a Partial DTensor holds partial values, not the tensor; redistribute
#ifdef CASE_save_partial
void bad(const DTensor<float, 2, Mesh, Partial<>, Replicate>& x) {
  checkpoint::save("ckpt", {{"x", x}});
}
#endif

//! CASE load_partial checkpoint::load: a checkpoint holds tensors, not partial values; load into Replicate
#ifdef CASE_load_partial
void bad(const DeviceMesh<Mesh>& mesh) {
  (void)checkpoint::load<DTensor<float, 2, Mesh, Replicate, Partial<>>>("ckpt", "x", mesh);
}
#endif
