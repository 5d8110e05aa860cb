#pragma once
// checkpoint::save: named DTensors into a checkpoint directory, atomically (checkpoint.hpp has the
// overview). Collective over the tensors' world.

#include <stdio.h> // renameat2

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "dtensor/checkpoint/crc32c.hpp"
#include "dtensor/checkpoint/index.hpp"
#include "dtensor/checkpoint/safetensors.hpp"
#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/object.hpp"
#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor::checkpoint {

/// One DTensor to save, under a name (any string; a "/" is allowed).
class Named {
public:
  template <class T, int Rank, class Shape, class... P>
  Named(std::string name, const DTensor<T, Rank, Shape, P...>& t)
      : name_(std::move(name)), world_(mesh_world(t.mesh())),
        global_(dtensor::detail::to_extents(t.global_shape())),
        block_(spec_block(global_, t.spec, t.mesh().sizes(), t.mesh().coordinate())),
        local_(t.local().device().is_cpu() ? t.local() : t.local().to(Device::cpu())),
        device_(t.local().device()) {
    static_assert(!detail::has_partial(DTensor<T, Rank, Shape, P...>::placements),
                  "checkpoint::save: a Partial DTensor holds partial values, not the tensor; redistribute it "
                  "to Replicate or Shard first");
    // The first replica of a block writes it: coordinate 0 of every axis that does not shard.
    for (int a = 0; a < t.placements.size(); ++a) {
      writes_ = writes_ && (t.placements[a].is_shard() || t.mesh().coordinate()[a] == 0);
    }
  }

  const std::string& name() const noexcept { return name_; }
  /// The ranks of the tensor's mesh: the root's world, or a sub-mesh's own group (a pipeline stage's mesh
  /// saves its part while the other stages save theirs).
  const ProcessGroup& world() const noexcept { return world_; }
  const Extents& global() const noexcept { return global_; }
  const Block& block() const noexcept { return block_; }
  const AnyTensor& local() const noexcept { return local_; }
  Device device() const noexcept { return device_; }
  /// True on the one rank that writes this block.
  bool writes() const noexcept { return writes_; }
  /// The same, holding its own copy of this rank's values (on the host): what an asynchronous save writes
  /// while the source changes.
  Named snapshot() const {
    Named copy = *this;
    if (device_.is_cpu() && writes_) { // a device tensor's host copy is already its own
      copy.local_ = local_.clone();
    }
    return copy;
  }

private:
  static ProcessGroup mesh_world(const DeviceMeshBase& mesh) {
    std::int64_t size = 1;
    for (int a = 0; a < mesh.num_axes(); ++a) {
      size *= mesh.sizes()[a];
    }
    return size == mesh.world().size() ? mesh.world()
                                       : mesh.group_over(static_cast<AxisMask>((1u << mesh.num_axes()) - 1));
  }

  std::string name_;
  ProcessGroup world_;
  Extents global_;
  Block block_;
  AnyTensor local_; ///< on the host
  Device device_;
  bool writes_ = true;
};

/// Options of save().
struct SaveOptions {
  /// Granularity of the checksums, and so the least a load reads of a block it touches.
  std::uint64_t chunk_bytes = std::uint64_t{1} << 20;
  /// Called on rank 0 after each stage: "files" (every rank's file is written and synced) and "index"
  /// (the index is written and synced; the swap comes next). An exception it throws abandons the save on
  /// every rank as a crash there would: the previous checkpoint stays (progress reports, fault tests).
  std::function<void(std::string_view stage)> on_stage;
};

namespace detail {

inline std::string file_name(int rank) {
  return "rank-" + std::to_string(rank) + ".safetensors";
}

/// CRC-32C of every `chunk` bytes of [data, data + n).
inline std::vector<std::uint32_t> chunk_checksums(const std::byte* data, std::uint64_t n,
                                                  std::uint64_t chunk) {
  std::vector<std::uint32_t> sums;
  for (std::uint64_t at = 0; at < n; at += chunk) {
    sums.push_back(crc32c(data + at, std::min(chunk, n - at)));
  }
  return sums;
}

/// Runs `fn` on rank 0 and gives every rank its outcome: an exception there is rethrown on all ranks.
inline void on_rank0(const ProcessGroup& world, Device device, const std::function<void()>& fn) {
  std::vector<std::string> error(1);
  if (world.rank() == 0) {
    try {
      fn();
    } catch (const std::exception& e) {
      error[0] = e.what();
      if (error[0].empty()) {
        error[0] = "unknown error";
      }
    }
  }
  broadcast_object_list(error, 0, world, {device});
  DTENSOR_CHECK(error[0].empty(), error[0]);
}

/// Moves `tmp` to `dir`, replacing what is there atomically where the file system allows.
inline void swap_in(const std::filesystem::path& tmp, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  if (!fs::exists(dir)) {
    fs::rename(tmp, dir);
  } else if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp); // now the previous checkpoint
  } else {
    const fs::path old = sibling(dir, ".old");
    fs::remove_all(old);
    fs::rename(dir, old);
    fs::rename(tmp, dir);
    fs::remove_all(old);
  }
  sync_directory(dir.parent_path().empty() ? fs::path(".") : dir.parent_path());
}

} // namespace detail

namespace detail {

/// The checks every rank makes before a save (no communication).
inline void check_save(const std::filesystem::path& dir, const std::vector<Named>& tensors,
                       const SaveOptions& options) {
  DTENSOR_CHECK(!tensors.empty(), "checkpoint::save " + dir.string() + ": no tensors to save");
  DTENSOR_CHECK(options.chunk_bytes > 0, "checkpoint::save: chunk_bytes must be positive");
  const ProcessGroup& world = tensors.front().world();
  for (const Named& t : tensors) {
    DTENSOR_CHECK(t.world().size() == world.size(),
                  "checkpoint::save " + dir.string() + ": tensor '" + t.name() + "' lives on a world of " +
                      std::to_string(t.world().size()) + " ranks, '" + tensors.front().name() +
                      "' on one of " + std::to_string(world.size()));
  }
}

/// Rank 0's part of starting a save: unique names, and `tmp` made empty.
inline void prepare_save(const std::filesystem::path& dir, const std::filesystem::path& tmp,
                         const std::vector<Named>& tensors) {
  std::map<std::string_view, int> seen;
  for (const Named& t : tensors) {
    DTENSOR_CHECK(seen[t.name()]++ == 0,
                  "checkpoint::save " + dir.string() + ": two tensors named '" + t.name() + "'");
  }
  std::filesystem::remove_all(tmp);
  std::filesystem::create_directories(tmp);
}

/// Writes rank `rank`'s file of `tensors` (its unique blocks, in the order given) into `tmp` and syncs it;
/// returns what the index needs of it (file, bytes, blocks with their checksums) as JSON text.
inline std::string write_rank_file(const std::filesystem::path& tmp, const std::vector<Named>& tensors,
                                   int rank, std::uint64_t chunk_bytes) {
  std::vector<TensorEntry> entries;
  nlohmann::json blocks = nlohmann::json::array();
  std::uint64_t at = 0;
  for (const Named& t : tensors) {
    if (!t.writes()) {
      continue;
    }
    const std::uint64_t n = t.local().nbytes();
    const std::string key = t.name() + "/" + std::to_string(rank);
    entries.push_back({key, t.local().dtype(), t.block().shape, at, at + n});
    blocks.push_back(
        {{"name", t.name()},
         {"dtype", safetensors_dtype(t.local().dtype())},
         {"global", extents_json(t.global())},
         {"key", key},
         {"offset", extents_json(t.block().offset)},
         {"shape", extents_json(t.block().shape)},
         {"data_offsets", {at, at + n}},
         {"crc32c", chunk_checksums(static_cast<const std::byte*>(t.local().data()), n, chunk_bytes)}});
    at += n;
  }
  const std::string file = file_name(rank);
  File out(tmp / file, O_WRONLY | O_CREAT | O_TRUNC);
  const std::string header = encode_header(entries, {{"format", "pt"}});
  out.write_all(header.data(), header.size());
  for (const Named& t : tensors) {
    if (t.writes()) {
      out.write_all(t.local().data(), t.local().nbytes());
    }
  }
  out.sync();
  return nlohmann::json{{"file", file}, {"bytes", header.size() + at}, {"blocks", std::move(blocks)}}.dump();
}

/// Rank 0's part of finishing a save: the index of every rank's blocks (`all`: write_rank_file's
/// descriptions) written into `tmp` and synced with the directory (not yet swapped in).
inline void write_index(const std::filesystem::path& dir, const std::filesystem::path& tmp,
                        const std::vector<Named>& tensors, const std::vector<std::string>& all,
                        std::uint64_t chunk_bytes) {
  nlohmann::ordered_json tensors_json = nlohmann::ordered_json::object();
  nlohmann::ordered_json files = nlohmann::ordered_json::object();
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (const Named& t : tensors) {
    tensors_json[t.name()] = {{"dtype", safetensors_dtype(t.local().dtype())},
                              {"shape", extents_json(t.global())},
                              {"blocks", nlohmann::ordered_json::array()}};
  }
  for (const std::string& text : all) {
    const auto part = nlohmann::json::parse(text);
    files[part["file"].get<std::string>()] = {{"bytes", part["bytes"]}};
    for (const auto& b : part["blocks"]) {
      const std::string name = b["name"];
      DTENSOR_CHECK(tensors_json.contains(name) && tensors_json[name]["dtype"] == b["dtype"] &&
                        tensors_json[name]["shape"] == b["global"],
                    "checkpoint::save " + dir.string() + ": " + part["file"].get<std::string>() +
                        " holds tensor '" + name + "' as " + b["dtype"].dump() + " " + b["global"].dump() +
                        ", which rank 0 does not save alike (every rank must pass the same tensors)");
      weight_map[b["key"].get<std::string>()] = part["file"];
      tensors_json[name]["blocks"].push_back({{"file", part["file"]},
                                              {"key", b["key"]},
                                              {"offset", b["offset"]},
                                              {"shape", b["shape"]},
                                              {"data_offsets", b["data_offsets"]},
                                              {"crc32c", b["crc32c"]}});
    }
  }
  const nlohmann::ordered_json index = {{"format", index_format},     {"version", index_version},
                                        {"chunk_bytes", chunk_bytes}, {"tensors", std::move(tensors_json)},
                                        {"files", std::move(files)},  {"weight_map", std::move(weight_map)}};
  const std::string text = index.dump(1) + "\n";
  {
    File out(tmp / "index.json", O_WRONLY | O_CREAT | O_TRUNC);
    out.write_all(text.data(), text.size());
    out.sync();
  }
  sync_directory(tmp);
}

} // namespace detail

/// Saves `tensors` into the directory `dir`, replacing a previous checkpoint there atomically.
/// Collective: every rank of the tensors' world calls it with the same names in the same order.
inline void save(const std::filesystem::path& dir, const std::vector<Named>& tensors,
                 SaveOptions options = {}) {
  detail::check_save(dir, tensors, options);
  const ProcessGroup& world = tensors.front().world();
  const Device device = tensors.front().device();
  const std::filesystem::path tmp = detail::sibling(dir, ".tmp");
  detail::on_rank0(world, device, [&] { detail::prepare_save(dir, tmp, tensors); });
  const std::string mine = detail::write_rank_file(tmp, tensors, world.rank(), options.chunk_bytes);
  // Rank 0 assembles the index from every rank's blocks, writes it, and swaps the directory in.
  const auto all = gather_object(mine, 0, world, {device});
  detail::on_rank0(world, device, [&] {
    if (options.on_stage) {
      options.on_stage("files");
    }
    detail::write_index(dir, tmp, tensors, all, options.chunk_bytes);
    if (options.on_stage) {
      options.on_stage("index");
    }
    detail::swap_in(tmp, dir);
  });
}

} // namespace dtensor::checkpoint
