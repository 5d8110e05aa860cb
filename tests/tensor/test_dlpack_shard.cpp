// A DTensor's shard through DLPack: to_dlpack(x.to_local()) exports the shard's own memory, and a shard
// imported with from_dlpack is a local tensor like any other (from_local, then a collective).

#include <catch2/catch.hpp>

#include <dtensor/core/dlpack.hpp>
#include <dtensor/core/tensor_io.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/tensor/dtensor.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <string>

using namespace dtensor;

namespace {

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

using Mesh1 = MeshShape<Axis<"x">>;

Tensor<float, 2> reference() {
  Tensor<float, 2> t({4, 6});
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = static_cast<float>(i);
  }
  return t;
}

} // namespace

TEST_CASE("a shard goes out and comes back through DLPack without a copy", "[dlpack][dtensor]") {
  testing::run_ranks(2, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    const auto full = reference();
    auto x = distribute_tensor<Shard<1>>(mesh, full); // [S(1)] local (4, 3)
    DLManagedTensor* out = to_dlpack(x.to_local());
    expect(out->dl_tensor.data == x.local().data(), "to_dlpack exported a copy of the shard");
    auto shard = from_dlpack<float, 2>(out); // as a consumer would see it
    expect(equal(shard, full.narrow(1, 3 * world.rank(), 3)), "the shard's values");
    shard.fill(static_cast<float>(world.rank() + 1)); // writes into x's shard
    auto y = DTensor<float, 2, Mesh1, Shard<1>>::from_local(mesh, shard);
    auto expected = Tensor<float, 2>::full({4, 6}, 1.0f);
    expected.narrow(1, 3, 3).fill(2.0f);
    expect(equal(y.full_tensor(), expected), "an imported shard in a collective");
    expect(equal(x.full_tensor(), expected), "the write reached x's own shard");
  });
}
