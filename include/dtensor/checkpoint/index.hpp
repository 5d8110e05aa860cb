#pragma once
// index.json, the table of contents of a sharded checkpoint (checkpoint.hpp describes the directory):
//
//   {"format": "dtensor-checkpoint", "version": 1, "chunk_bytes": 1048576,
//    "tensors": {"<name>": {"dtype": "F32", "shape": [7, 5],
//                           "blocks": [{"file": "rank-0.safetensors", "key": "<name>/0", "offset": [0, 0],
//                                       "shape": [4, 3], "data_offsets": [0, 48], "crc32c": [...]}, ...]}},
//    "files": {"rank-0.safetensors": {"bytes": 184}, ...},
//    "weight_map": {"<name>/0": "rank-0.safetensors", ...}}
//
// Here: its name and version, what a reader keeps of one tensor, and helpers save and load share.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "dtensor/core/element_type.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"

namespace dtensor::checkpoint {

/// The format name and version index.json carries.
inline constexpr std::string_view index_format = "dtensor-checkpoint";
inline constexpr int index_version = 1;

/// What index.json says of one tensor.
struct SavedTensor {
  struct SavedBlock {
    std::string file;
    std::string key;
    Block block;
    std::uint64_t begin = 0; ///< data_offsets in the file's data section
    std::uint64_t end = 0;
    std::vector<std::uint32_t> crc32c; ///< one per chunk_bytes
  };
  DType dtype = DType::float32;
  Extents shape;
  std::vector<SavedBlock> blocks;
};

namespace detail {

/// True when some mesh axis of `list` is Partial (such tensors are neither saved nor loaded).
constexpr bool has_partial(const PlacementList& list) {
  for (const Placement& p : list) {
    if (p.is_partial()) {
      return true;
    }
  }
  return false;
}

/// A shape or offset as a JSON array: [7, 5].
inline nlohmann::json extents_json(const Extents& e) {
  auto j = nlohmann::json::array();
  for (std::int64_t v : e) {
    j.push_back(v);
  }
  return j;
}

/// The path next to `dir` named as it with `suffix` appended: "run/ckpt" + ".tmp" -> "run/ckpt.tmp".
inline std::filesystem::path sibling(const std::filesystem::path& dir, std::string_view suffix) {
  std::filesystem::path d = dir;
  if (!d.has_filename()) {
    d = d.parent_path(); // "ckpt/" names "ckpt"
  }
  return d.parent_path() / (d.filename().string() + std::string(suffix));
}

} // namespace detail

} // namespace dtensor::checkpoint
