// Sharded checkpoints (checkpoint/): round trips across meshes, placements and rank counts (bit for bit),
// consolidation, every validation error, and atomic saves.

#include <catch2/catch.hpp>

#include <dtensor/checkpoint/async_save.hpp>
#include <dtensor/checkpoint/checkpoint.hpp>
#include <dtensor/local/copy.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/tensor/dtensor.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

using namespace dtensor;
namespace ckpt = dtensor::checkpoint;
namespace fs = std::filesystem;

namespace {

using Mesh1 = MeshShape<Axis<"x">>;
using Mesh2 = MeshShape<Axis<"dp">, Axis<"tp">>;

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

/// A fresh directory under the build tree, removed with its contents at scope exit.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) : path(fs::current_path() / ("checkpoint_test_" + name)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

/// Non-integer values (bit patterns a conversion or a sum in another order would change).
template <class T>
Tensor<T, 2> reference(std::int64_t rows, std::int64_t cols, int seed = 0) {
  Tensor<T, 2> t({rows, cols});
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      t(i, j) = static_cast<T>(std::sin(static_cast<double>(i * cols + j + seed)) * 3.0 + 1.0 / 3.0);
    }
  }
  return t;
}

template <class T, int R>
bool same_bits(const Tensor<T, R>& a, const Tensor<T, R>& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

ckpt::SaveOptions chunks_of(std::uint64_t bytes) {
  ckpt::SaveOptions o;
  o.chunk_bytes = bytes;
  return o;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

} // namespace

TEST_CASE("crc32c gives the standard check value", "[checkpoint]") {
  CHECK(ckpt::crc32c("123456789", 9) == 0xe3069283u);
  CHECK(ckpt::crc32c("", 0) == 0u);
  // Continuing a checksum equals checksumming the whole.
  CHECK(ckpt::crc32c("56789", 5, ckpt::crc32c("1234", 4)) == 0xe3069283u);
}

TEST_CASE("save and load round trips at 1 to 4 ranks with uneven and empty shards", "[checkpoint]") {
  TempDir tmp("round_trip");
  const auto a = reference<float>(7, 5);
  const auto b = reference<std::int64_t>(3, 2, 7); // 3 rows on 4 ranks: an empty shard
  const auto c = reference<double>(2, 9, 3);
  for (int n : {1, 2, 3, 4}) {
    const fs::path dir = tmp.path / ("n" + std::to_string(n));
    testing::run_ranks(n, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      auto da = distribute_tensor<Shard<0>>(mesh, a, replicated_source);
      auto db = distribute_tensor<Shard<0>>(mesh, b, replicated_source);
      auto dc = distribute_tensor<Replicate>(mesh, c, replicated_source);
      ckpt::save(dir, {{"a", da}, {"b", db}, {"layer.0/c", dc}}, chunks_of(16));
    });
    // Replicas are written once: the index has one block per shard of a and b, one for c.
    ckpt::Reader reader(dir);
    CHECK(reader.tensor("a").blocks.size() == static_cast<std::size_t>(n));
    CHECK(reader.tensor("layer.0/c").blocks.size() == 1u);
    for (int m : {1, 2, 3, 4}) {
      testing::run_ranks(m, [&](ProcessGroup& world) {
        auto mesh = init_device_mesh<Mesh1>(world);
        const std::string at = "saved on " + std::to_string(n) + ", loaded on " + std::to_string(m);
        auto la = ckpt::load<DTensor<float, 2, Mesh1, Shard<1>>>(dir, "a", mesh);
        expect(same_bits(la.local(), distribute_tensor<Shard<1>>(mesh, a, replicated_source).local()),
               at + ": a");
        auto lb = ckpt::load<DTensor<std::int64_t, 2, Mesh1, Shard<0>>>(dir, "b", mesh);
        expect(same_bits(lb.local(), distribute_tensor<Shard<0>>(mesh, b, replicated_source).local()),
               at + ": b");
        auto lc = ckpt::load<DTensor<double, 2, Mesh1, Replicate>>(dir, "layer.0/c", mesh);
        expect(same_bits(lc.local(), c), at + ": c");
      });
    }
  }
}

TEST_CASE("(2,2) [S(0),S(1)] to 3 ranks [S(1)] to 1 rank is bit for bit", "[checkpoint]") {
  TempDir tmp("mesh_change");
  const auto w = reference<float>(7, 5);
  const auto h = reference<bfloat16>(5, 6, 11);
  testing::run_ranks(4, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh2>(world, 2, 2);
    auto dw = distribute_tensor<Shard<0>, Shard<1>>(mesh, w, replicated_source);
    auto dh = distribute_tensor<Replicate, Shard<0>>(mesh, h, replicated_source);
    ckpt::save(tmp.path / "four", {{"w", dw}, {"h", dh}});
  });
  testing::run_ranks(3, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    auto lw = ckpt::load<DTensor<float, 2, Mesh1, Shard<1>>>(tmp.path / "four", "w", mesh);
    auto lh = ckpt::load<DTensor<bfloat16, 2, Mesh1, Shard<1>>>(tmp.path / "four", "h", mesh);
    expect(same_bits(lw.local(), distribute_tensor<Shard<1>>(mesh, w, replicated_source).local()), "w on 3");
    expect(same_bits(lh.local(), distribute_tensor<Shard<1>>(mesh, h, replicated_source).local()), "h on 3");
    expect(same_bits(lw.full_tensor(), w), "w gathered on 3");
    ckpt::save(tmp.path / "three", {{"w", lw}, {"h", lh}});
  });
  testing::run_ranks(1, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    auto lw = ckpt::load<DTensor<float, 2, Mesh1, Replicate>>(tmp.path / "three", "w", mesh);
    auto lh = ckpt::load<DTensor<bfloat16, 2, Mesh1, Shard<0>>>(tmp.path / "three", "h", mesh);
    expect(same_bits(lw.local(), w), "w on 1");
    expect(same_bits(lh.local(), h), "h on 1");
  });
}

TEST_CASE("a load reads only the checksum chunks its block meets", "[checkpoint]") {
  TempDir tmp("partial_reads");
  const auto w = reference<float>(8, 8);
  testing::run_ranks(2, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    ckpt::save(tmp.path, {{"w", distribute_tensor<Shard<0>>(mesh, w, replicated_source)}}, chunks_of(16));
  });
  // Each saved block is 4 rows of 32 bytes, two 16-byte chunks a row: the left half of the columns
  // ([S(1)] on 2 ranks, rank 0) is every other chunk, half of the bytes.
  ckpt::Reader reader(tmp.path);
  Tensor<float, 2> left({8, 4});
  reader.read("w", DType::float32, Block{{8, 4}, {0, 0}}, left.data());
  CHECK(reader.bytes_read() == 128u);
  Tensor<float, 2> expected({8, 4});
  for (std::int64_t i = 0; i < 8; ++i) {
    for (std::int64_t j = 0; j < 4; ++j) {
      expected(i, j) = w(i, j);
    }
  }
  CHECK(same_bits(left, expected));
  // One row in the middle of the second block: its two chunks.
  Tensor<float, 2> row({1, 8});
  reader.read("w", DType::float32, Block{{1, 8}, {5, 0}}, row.data());
  CHECK(reader.bytes_read() == 128u + 32u);
  CHECK(std::memcmp(row.data(), &w(5, 0), 32) == 0);
}

TEST_CASE("consolidate writes one safetensors file of whole tensors", "[checkpoint]") {
  TempDir tmp("consolidate");
  const auto w = reference<float>(7, 5);
  const auto v = reference<std::int32_t>(4, 3, 2);
  testing::run_ranks(3, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    ckpt::save(tmp.path / "ckpt", {{"w", distribute_tensor<Shard<1>>(mesh, w, replicated_source)},
                                   {"v", distribute_tensor<Shard<0>>(mesh, v, replicated_source)}});
  });
  const fs::path file = tmp.path / "model.safetensors";
  ckpt::consolidate(tmp.path / "ckpt", file);
  CHECK_FALSE(fs::exists(tmp.path / "model.safetensors.tmp"));
  ckpt::File f(file, O_RDONLY);
  const ckpt::Header header = ckpt::read_header(f);
  CHECK(header.data_start % 8 == 0);
  CHECK(header.metadata.at("format") == "pt");
  REQUIRE(header.tensors.size() == 2u);
  const ckpt::TensorEntry* e = header.find("w");
  REQUIRE(e != nullptr);
  CHECK(e->dtype == DType::float32);
  CHECK(e->shape == Extents{7, 5});
  Tensor<float, 2> back({7, 5});
  f.read_at(back.data(), back.nbytes(), header.data_start + e->begin, "w");
  CHECK(same_bits(back, w));
  e = header.find("v");
  REQUIRE(e != nullptr);
  Tensor<std::int32_t, 2> vb({4, 3});
  f.read_at(vb.data(), vb.nbytes(), header.data_start + e->begin, "v");
  CHECK(same_bits(vb, v));
}

TEST_CASE("loads check the index, the files and the checksums, and say what is wrong", "[checkpoint]") {
  TempDir tmp("errors");
  const auto w = reference<float>(6, 4);
  const fs::path good = tmp.path / "good";
  testing::run_ranks(2, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    ckpt::save(good, {{"w", distribute_tensor<Shard<0>>(mesh, w, replicated_source)}}, chunks_of(32));
  });
  // A copy to damage, and a load of all of "w" from it on one rank.
  const auto damaged = [&](const std::string& name) {
    const fs::path dir = tmp.path / name;
    fs::copy(good, dir);
    return dir;
  };
  const auto load_all = [](const fs::path& dir, const std::string& name) {
    ckpt::Reader reader(dir);
    Tensor<float, 2> out({6, 4});
    reader.read(name, DType::float32, Block{{6, 4}, {0, 0}}, out.data());
    return out;
  };
  const auto patch = [](const fs::path& file, std::uint64_t offset, const std::string& bytes) {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  CHECK(same_bits(load_all(good, "w"), w));

  SECTION("missing tensor") {
    const std::string e = error_of([&] { load_all(good, "bias"); });
    CHECK(contains(e, "no tensor 'bias'"));
    CHECK(contains(e, "it holds 'w'"));
  }
  SECTION("dtype mismatch") {
    const std::string e = error_of([&] {
      testing::run_ranks(1, [&](ProcessGroup& world) {
        auto mesh = init_device_mesh<Mesh1>(world);
        ckpt::load<DTensor<double, 2, Mesh1, Shard<0>>>(good, "w", mesh);
      });
    });
    CHECK(contains(e, "tensor 'w' is F32 (float32), read as float64"));
  }
  SECTION("shape mismatch") {
    const std::string e = error_of([&] {
      testing::run_ranks(1, [&](ProcessGroup& world) {
        auto mesh = init_device_mesh<Mesh1>(world);
        ckpt::load<DTensor<float, 3, Mesh1, Shard<0>>>(good, "w", mesh);
      });
    });
    CHECK(contains(e, "tensor 'w' has shape (6, 4), loaded as a rank-3 tensor"));
  }
  SECTION("load_into checks the global shape") {
    const std::string e = error_of([&] {
      testing::run_ranks(2, [&](ProcessGroup& world) {
        auto mesh = init_device_mesh<Mesh1>(world);
        auto into = distribute_tensor<Shard<1>>(mesh, reference<float>(7, 4), replicated_source);
        ckpt::load_into(good, "w", into);
      });
    });
    CHECK(contains(e, "tensor 'w' has shape (6, 4), loaded into a DTensor of shape (7, 4)"));
    testing::run_ranks(2, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      auto into = distribute_tensor<Shard<1>>(mesh, reference<float>(6, 4, 5), replicated_source);
      ckpt::load_into(good, "w", into);
      expect(same_bits(into.local(), distribute_tensor<Shard<1>>(mesh, w, replicated_source).local()),
             "load_into [S(1)]");
    });
  }
  SECTION("truncated file") {
    const fs::path dir = damaged("truncated");
    fs::resize_file(dir / "rank-1.safetensors", fs::file_size(dir / "rank-1.safetensors") - 4);
    const std::string e = error_of([&] { load_all(dir, "w"); });
    CHECK(contains(e, "rank-1.safetensors"));
    CHECK(contains(e, "(truncated file)"));
  }
  SECTION("bad header") {
    const fs::path dir = damaged("bad_header");
    patch(dir / "rank-0.safetensors", 8, "[");
    const std::string e = error_of([&] { load_all(dir, "w"); });
    CHECK(contains(e, "rank-0.safetensors: bad header: not a JSON object"));
    patch(dir / "rank-0.safetensors", 0, std::string("\xff\xff\xff\xff\xff\xff\x00\x00", 8));
    CHECK(contains(error_of([&] { load_all(dir, "w"); }), "bad header: its length"));
  }
  SECTION("header disagreeing with the index") {
    const fs::path dir = damaged("bad_shape");
    // Same length, another shape: [3,4] -> [4,3] keeps the byte count, so only the index check sees it.
    std::ifstream in(dir / "rank-1.safetensors", std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    in.close();
    const auto at = text.find("[3,4]");
    REQUIRE(at != std::string::npos);
    patch(dir / "rank-1.safetensors", at, "[4,3]");
    const std::string e = error_of([&] { load_all(dir, "w"); });
    CHECK(contains(e, "rank-1.safetensors: tensor 'w/1': the header says F32 (4, 3)"));
  }
  SECTION("checksum mismatch") {
    const fs::path dir = damaged("checksum");
    const auto size = fs::file_size(dir / "rank-1.safetensors");
    patch(dir / "rank-1.safetensors", size - 1, "\x7f");
    const std::string e = error_of([&] { load_all(dir, "w"); });
    CHECK(contains(e, "rank-1.safetensors: tensor 'w/1': checksum mismatch in bytes [32, 48)"));
    // A block read elsewhere (rows 0-2 live in rank-0's file) still loads: the damage is not read.
    ckpt::Reader reader(dir);
    Tensor<float, 2> top({3, 4});
    reader.read("w", DType::float32, Block{{3, 4}, {0, 0}}, top.data());
    CHECK(same_bits(top, reference<float>(3, 4))); // the first rows of w
  }
  SECTION("bad index") {
    const fs::path dir = damaged("bad_index");
    { std::ofstream(dir / "index.json") << "{\"format\": \"something else\"}"; }
    CHECK(contains(error_of([&] { load_all(dir, "w"); }), "index.json: not a dtensor checkpoint index"));
    fs::remove(dir / "index.json");
    CHECK(contains(error_of([&] { load_all(dir, "w"); }), "cannot open"));
  }
  SECTION("an index whose shapes overflow int64: an error, never undefined behaviour") {
    const fs::path dir = damaged("overflow");
    std::ifstream in(dir / "index.json");
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    in.close();
    for (const std::string shape : {"[4611686018427387904, 4]", "[1099511627776, 1099511627776]"}) {
      INFO(shape);
      std::string crafted = text;
      const auto at = crafted.find("\"shape\": [");
      crafted.replace(at, crafted.find(']', at) + 1 - at, "\"shape\": " + shape);
      { std::ofstream(dir / "index.json") << crafted; }
      const std::string e = error_of([&] { load_all(dir, "w"); });
      CHECK(contains(e, "tensor 'w'"));
      CHECK(contains(e, "the shape's byte size overflows int64"));
    }
  }
}

TEST_CASE("a save that fails midway leaves the previous checkpoint intact", "[checkpoint]") {
  TempDir tmp("atomic");
  const fs::path dir = tmp.path / "ckpt";
  const auto v1 = reference<float>(5, 3, 1);
  const auto v2 = reference<float>(5, 3, 2);
  const auto save = [&](const Tensor<float, 2>& value, const std::string& fail_at) {
    testing::run_ranks(2, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      ckpt::save(dir, {{"w", distribute_tensor<Shard<0>>(mesh, value, replicated_source)}},
                 {.on_stage = [&](std::string_view stage) {
                   if (stage == fail_at) {
                     throw Error("injected failure after " + std::string(stage));
                   }
                 }});
    });
  };
  const auto load = [&] {
    Tensor<float, 2> out({5, 3});
    ckpt::Reader(dir).read("w", DType::float32, Block{{5, 3}, {0, 0}}, out.data());
    return out;
  };
  save(v1, "");
  CHECK(same_bits(load(), v1));
  for (const char* stage : {"files", "index"}) {
    CHECK(contains(error_of([&] { save(v2, stage); }), std::string("injected failure after ") + stage));
    CHECK(same_bits(load(), v1));
    CHECK(fs::exists(tmp.path / "ckpt.tmp")); // what a crash leaves; the next save clears it
  }
  save(v2, "");
  CHECK(same_bits(load(), v2));
  CHECK_FALSE(fs::exists(tmp.path / "ckpt.tmp"));
  CHECK_FALSE(fs::exists(tmp.path / "ckpt.old"));
}

namespace {

/// Every file of checkpoint `a` has the bytes of the same file of `b`, and they hold the same files.
bool same_files(const fs::path& a, const fs::path& b) {
  std::vector<std::string> names_a, names_b;
  for (const auto& e : fs::directory_iterator(a)) {
    names_a.push_back(e.path().filename().string());
  }
  for (const auto& e : fs::directory_iterator(b)) {
    names_b.push_back(e.path().filename().string());
  }
  std::sort(names_a.begin(), names_a.end());
  std::sort(names_b.begin(), names_b.end());
  if (names_a != names_b) {
    return false;
  }
  const auto bytes = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  return std::all_of(names_a.begin(), names_a.end(),
                     [&](const std::string& n) { return bytes(a / n) == bytes(b / n); });
}

} // namespace

TEST_CASE("save_async writes what save writes, from the values of the call, at 1 to 4 ranks",
          "[checkpoint][async]") {
  TempDir tmp("async");
  const auto a = reference<float>(7, 5);
  const auto b = reference<std::int64_t>(3, 2, 7); // 3 rows on 4 ranks: an empty shard
  for (int n : {1, 2, 3, 4}) {
    const fs::path sync = tmp.path / ("sync" + std::to_string(n));
    const fs::path async = tmp.path / ("async" + std::to_string(n));
    testing::run_ranks(n, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      auto da = distribute_tensor<Shard<0>>(mesh, a, replicated_source);
      auto db = distribute_tensor<Replicate>(mesh, b, replicated_source);
      ckpt::save(sync, {{"a", da}, {"b", db}}, chunks_of(16));
      ckpt::PendingSave pending = ckpt::save_async(async, {{"a", da}, {"b", db}}, chunks_of(16));
      // The next step changes the tensors at once: the save holds the values of its call.
      local::fill(da.local(), -1.f);
      local::fill(db.local(), std::int64_t(-1));
      pending.wait();
      expect(pending.ready(), "a waited save is ready");
      pending.wait(); // empty now: returns
    });
    CHECK(same_files(sync, async));
    CHECK_FALSE(fs::exists(tmp.path / ("async" + std::to_string(n) + ".tmp")));
  }
}

TEST_CASE("an asynchronous save that fails midway leaves the previous checkpoint and throws on every rank",
          "[checkpoint][async]") {
  TempDir tmp("async_atomic");
  const fs::path dir = tmp.path / "ckpt";
  const auto v1 = reference<float>(5, 3, 1);
  const auto v2 = reference<float>(5, 3, 2);
  const auto save = [&](const Tensor<float, 2>& value, const std::string& fail_at) {
    std::atomic<int> errors{0};
    testing::run_ranks(3, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      ckpt::PendingSave pending =
          ckpt::save_async(dir, {{"w", distribute_tensor<Shard<0>>(mesh, value, replicated_source)}},
                           {.on_stage = [&](std::string_view stage) {
                             if (stage == fail_at) {
                               throw Error("injected failure after " + std::string(stage));
                             }
                           }});
      const std::string e = error_of([&] { pending.wait(); });
      expect(e.empty() == fail_at.empty(), "rank " + std::to_string(world.rank()) + ": " + e);
      errors += contains(e, "injected failure after " + fail_at) ? 1 : 0;
    });
    return errors.load();
  };
  const auto load = [&] {
    Tensor<float, 2> out({5, 3});
    ckpt::Reader(dir).read("w", DType::float32, Block{{5, 3}, {0, 0}}, out.data());
    return out;
  };
  CHECK(save(v1, "") == 0);
  CHECK(same_bits(load(), v1));
  for (const char* stage : {"files", "index"}) {
    CHECK(save(v2, stage) == 3); // the error on every rank
    CHECK(same_bits(load(), v1));
    CHECK(fs::exists(tmp.path / "ckpt.tmp")); // what a crash leaves; the next save clears it
  }
  CHECK(save(v2, "") == 0);
  CHECK(same_bits(load(), v2));
  CHECK_FALSE(fs::exists(tmp.path / "ckpt.tmp"));
}
