// Checkpoint save and load bandwidth per rank, next to plain file I/O of the same bytes in the same run:
// save [S(0)] (safetensors file per rank, CRC-32C, index, fsync, directory swap) vs memcpy + write + fsync
// of each rank's shard to its own file; load [S(0)] (the saved layout) and [S(1)] (every rank reads a
// column band of every saved block; Reader::read into a tensor allocated once) vs pread of the same number
// of bytes into the same tensor. 4 in-process ranks (threads) on
// gloo, float32; loads come from the page cache (the files were just written), saves reach the device.
//
//   bench_checkpoint [--scale S] [--smoke] [--out DIR] [--max-bytes B] [--dir PATH]
//   writes DIR/checkpoint.json (default bench/results); PATH (default: the system temp folder) holds the
//   files

#include <fcntl.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "dtensor/checkpoint/checkpoint.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/testing/run_ranks.hpp"

#include "../common/harness.hpp"

namespace {

using namespace dtensor;
namespace ckpt = dtensor::checkpoint;
namespace fs = std::filesystem;
using Mesh = MeshShape<Axis<"x">>;
using Rows = DTensor<float, 2, Mesh, Shard<0>>;
using Cols = DTensor<float, 2, Mesh, Shard<1>>;

struct Case {
  std::int64_t rows, cols;
  std::uint64_t chunk_bytes;
};

Rows make_rows(const DeviceMesh<Mesh>& mesh, std::int64_t rows, std::int64_t cols) {
  const Block b = spec_block(Extents{rows, cols}, Rows::spec, mesh.sizes(), mesh.coordinate());
  Tensor<float, 2> t({b.shape[0], b.shape[1]});
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = static_cast<float>(i % 1000) * 0.001f + static_cast<float>(mesh.rank());
  }
  return Rows(mesh, t, {rows, cols});
}

} // namespace

int main(int argc, char** argv) {
  const bench::Options opt = bench::parse_options(argc, argv);
  fs::path root = fs::temp_directory_path() / "dtensor_bench_checkpoint";
  for (std::size_t i = 0; i + 1 < opt.args.size(); ++i) {
    if (opt.args[i] == "--dir") {
      root = opt.args[i + 1];
    }
  }
  const int ranks = 4;
  const Case cases[] = {
      {256, 256, 1 << 20}, {1024, 1024, 1 << 20}, {4096, 2048, 1 << 20}, {4096, 2048, 4096}};
  bench::Table table{{"case", "MiB/rank", "ours MB/s", "plain MB/s", "ratio", "read MiB/rank"}};
  bench::Results results;
  for (const Case& cs : cases) {
    const std::int64_t total = cs.rows * cs.cols * 4;
    if ((opt.smoke && cs.rows > 256) || total > opt.max_bytes * ranks) {
      continue;
    }
    const std::string shape = std::to_string(cs.rows) + " x " + std::to_string(cs.cols);
    const std::string chunk = cs.chunk_bytes >= (1 << 20) ? std::to_string(cs.chunk_bytes >> 20) + " MiB"
                                                          : std::to_string(cs.chunk_bytes >> 10) + " KiB";
    fs::remove_all(root);
    fs::create_directories(root / "plain");
    const fs::path dir = root / "ckpt";
    std::mutex m;
    testing::run_ranks(ranks, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh>(world);
      const Rows x = make_rows(mesh, cs.rows, cs.cols);
      const std::uint64_t bytes = x.local().nbytes();
      const fs::path plain = root / "plain" / ("rank-" + std::to_string(world.rank()) + ".bin");
      ckpt::SaveOptions so;
      so.chunk_bytes = cs.chunk_bytes;
      std::vector<std::byte> staging(bytes);
      const auto save = [&] { ckpt::save(dir, {{"w", x}}, so); };
      const auto plain_save = [&] {
        std::memcpy(staging.data(), x.local().data(), bytes);
        ckpt::File f(plain, O_WRONLY | O_CREAT | O_TRUNC);
        f.write_all(staging.data(), bytes);
        f.sync();
        barrier(world); // done when every rank is, as a save is
      };
      // Loads fill a tensor allocated once (the same one on both sides): what is measured is reading,
      // checking and placing the bytes, not the first-touch page faults of new memory that load<DT>()
      // adds (they cost as much as the rest on this VM).
      Tensor<float, 2> dst(x.local().shape());
      const auto plain_load = [&] { ckpt::File(plain, O_RDONLY).read_at(dst.data(), bytes, 0, "the shard"); };
      std::uint64_t read_rows = 0;
      std::uint64_t read_cols = 0;
      const Extents global{cs.rows, cs.cols};
      const auto load_rows = [&] {
        ckpt::Reader r(dir);
        r.read("w", DType::float32, spec_block(global, Rows::spec, mesh.sizes(), mesh.coordinate()),
               dst.data());
        read_rows = r.bytes_read();
      };
      const auto load_cols = [&] {
        ckpt::Reader r(dir);
        r.read("w", DType::float32, spec_block(global, Cols::spec, mesh.sizes(), mesh.coordinate()),
               dst.data());
        read_cols = r.bytes_read();
      };
      bench::SamplePlan p;
      p.warmup = opt.smoke ? 0 : 1;
      p.samples = bench::scaled(opt, 7);
      const auto [s_save, r_save] = bench::compare(p, save, plain_save);
      // The loaded bands are checked against the saved rows once.
      const Cols y = ckpt::load<Cols>(dir, "w", mesh);
      DTENSOR_CHECK(
          std::memcmp(y.full_tensor().data(), x.full_tensor().data(), static_cast<std::size_t>(total)) == 0,
          "bench_checkpoint: the [S(1)] load differs from what was saved");
      const auto [s_rows, r_rows] = bench::compare(p, load_rows, plain_load);
      const auto [s_cols, r_cols] = bench::compare(p, load_cols, plain_load);
      barrier(world);
      if (world.rank() != 0) {
        return;
      }
      std::lock_guard lock(m);
      const double mib = static_cast<double>(bytes) / (1 << 20);
      const auto add = [&](const std::string& op, const std::string& ref_name, const bench::Stats& s,
                           const bench::Stats& r, std::uint64_t read) {
        const std::string name = op + " " + shape + ", chunks " + chunk;
        bench::Record rec{"checkpoint", name, "gloo", ranks, static_cast<std::int64_t>(bytes), s,
                          ref_name,     r,    {}};
        rec.add_num("MBps_per_rank", static_cast<double>(bytes) / s.median)
            .add_num("ref_MBps_per_rank", static_cast<double>(bytes) / r.median)
            .add_num("bytes_read_per_rank", static_cast<double>(read))
            .add_num("chunk_bytes", static_cast<double>(cs.chunk_bytes));
        table.row({name, bench::fmt("%.2f", mib), bench::fmt("%.0f", static_cast<double>(bytes) / s.median),
                   bench::fmt("%.0f", static_cast<double>(bytes) / r.median),
                   bench::fmt("%.3f", s.paired_ratio),
                   read ? bench::fmt("%.2f", static_cast<double>(read) / (1 << 20)) : "-"});
        results.add(std::move(rec));
      };
      add("save [S(0)]", "memcpy+write+fsync", s_save, r_save, 0);
      add("load [S(0)]", "pread", s_rows, r_rows, read_rows);
      add("load [S(1)]", "pread", s_cols, r_cols, read_cols);
    });
    fs::remove_all(root);
  }
  std::printf(
      "checkpoint save/load per rank vs plain file I/O of the same bytes, 4 in-process ranks on gloo, "
      "float32 [S(0)] saved; MB/s = bytes per rank / median time; ratio = median of paired time "
      "ratios (ours/plain); loads from the page cache\n");
  table.print();
  results.write(opt, "checkpoint.json");
  return 0;
}
