#pragma once
// Reading checkpoints (checkpoint.hpp has the overview): checkpoint::Reader, load, load_into (no
// collective: every rank reads the chunks its block meets) and consolidate (one process, one file).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dtensor/checkpoint/crc32c.hpp"
#include "dtensor/checkpoint/index.hpp"
#include "dtensor/checkpoint/safetensors.hpp"
#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/exchange.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor::checkpoint {

namespace detail {

/// Row-major strides of `shape`, in elements.
constexpr Extents row_major_strides(const Extents& shape) {
  Extents s(shape.size(), 1);
  for (int d = shape.size() - 2; d >= 0; --d) {
    s[d] = s[d + 1] * shape[d + 1];
  }
  return s;
}

} // namespace detail

/// A checkpoint directory opened for reading: the index is parsed and checked on construction, files
/// are opened (and their headers checked against the index) when first read from.
class Reader {
public:
  explicit Reader(std::filesystem::path dir) : dir_(std::move(dir)) {
    const std::filesystem::path path = dir_ / "index.json";
    File file(path, O_RDONLY);
    std::string text(file.size(), '\0');
    file.read_at(text.data(), text.size(), 0, "the index");
    const auto index = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    const std::string where = path.string();
    DTENSOR_CHECK(index.is_object() && index.value("format", "") == index_format,
                  where +
                      ": not a dtensor checkpoint index (bad JSON or no \"format\": \"dtensor-checkpoint\")");
    DTENSOR_CHECK(index.value("version", 0) == index_version,
                  where + ": version " + index.value("version", nlohmann::json()).dump() +
                      ", this reader reads " + std::to_string(index_version));
    try {
      chunk_bytes_ = index.at("chunk_bytes").get<std::uint64_t>();
      DTENSOR_CHECK(chunk_bytes_ > 0, where + ": chunk_bytes is 0");
      for (const auto& [name, f] : index.at("files").items()) {
        DTENSOR_CHECK(name.find('/') == std::string::npos && name != ".." && name != ".",
                      where + ": file '" + name + "' is not a plain file name");
        file_bytes_[name] = f.at("bytes").get<std::uint64_t>();
      }
      for (const auto& [name, t] : index.at("tensors").items()) {
        tensors_[name] = parse_tensor(t, where + ": tensor '" + name + "'");
      }
    } catch (const nlohmann::json::exception& e) {
      throw Error(where + ": bad index: " + e.what());
    }
  }

  const std::filesystem::path& dir() const noexcept { return dir_; }
  const std::map<std::string, SavedTensor, std::less<>>& tensors() const noexcept { return tensors_; }

  /// The tensor `name`; an Error listing the saved names when there is none.
  const SavedTensor& tensor(std::string_view name) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      std::string names;
      for (const auto& [n, t] : tensors_) {
        names += (names.empty() ? "" : ", ") + ("'" + n + "'");
      }
      throw Error("checkpoint " + dir_.string() + ": no tensor '" + std::string(name) + "' (it holds " +
                  names + ")");
    }
    return it->second;
  }

  /// Fills `out` (contiguous, row-major, dtype `dtype`) with the block `target` of tensor `name`, reading
  /// only the checksum chunks of saved blocks that `target` meets and checking them.
  void read(std::string_view name, DType dtype, const Block& target, void* out) {
    const SavedTensor& t = tensor(name);
    const std::string what = "checkpoint " + dir_.string() + ": tensor '" + std::string(name) + "'";
    DTENSOR_CHECK(t.dtype == dtype, what + " is " + std::string(safetensors_dtype(t.dtype)) + " (" +
                                        std::string(dtype_name(t.dtype)) + "), read as " +
                                        std::string(dtype_name(dtype)) +
                                        "; load it with its own element type");
    DTENSOR_CHECK(target.shape.size() == t.shape.size(),
                  what + " has shape " + AnyTensor::to_string(t.shape) + ", read as a rank-" +
                      std::to_string(target.shape.size()) + " tensor");
    std::int64_t copied = 0;
    for (const SavedTensor::SavedBlock& b : t.blocks) {
      copied += read_intersection(t, b, target, static_cast<std::byte*>(out));
    }
    DTENSOR_CHECK(copied == numel(target.shape), what + ": the saved blocks cover " + std::to_string(copied) +
                                                     " of the " + std::to_string(numel(target.shape)) +
                                                     " elements read");
  }

  /// Bytes of tensor data read so far (headers and the index not counted): what read() and load() cost.
  std::uint64_t bytes_read() const noexcept { return bytes_read_; }

  /// This rank's part of tensor `name`, as a DTensor `DT` on `mesh` (its local tensor on `device`).
  /// No collective: every rank reads what it holds.
  template <class DT>
  DT load(std::string_view name, const typename DT::mesh_type& mesh, Device device = Device::cpu()) {
    static_assert(!detail::has_partial(DT::placements),
                  "checkpoint::load: a checkpoint holds tensors, not partial "
                  "values; load into Replicate or Shard and redistribute");
    const SavedTensor& t = tensor(name);
    DTENSOR_CHECK(t.shape.size() == DT::rank, "checkpoint " + dir_.string() + ": tensor '" +
                                                  std::string(name) + "' has shape " +
                                                  AnyTensor::to_string(t.shape) + ", loaded as a rank-" +
                                                  std::to_string(DT::rank) + " tensor");
    const Block target = spec_block(t.shape, DT::spec, mesh.sizes(), mesh.coordinate());
    typename DT::local_type local(dtensor::detail::to_array<DT::rank>(target.shape));
    read(name, dtype_v<typename DT::value_type>, target, local.data());
    return DT(mesh, device.is_cpu() ? local : local.to(device), dtensor::detail::to_array<DT::rank>(t.shape));
  }

  /// Gives `t` (already laid out: a model's parameters, say) its part of tensor `name`; the saved global
  /// shape must be `t`'s. Its local tensor is replaced by a new one on the same device. No collective.
  template <class T, int Rank, class Shape, class... P>
  void load_into(std::string_view name, DTensor<T, Rank, Shape, P...>& t) {
    static_assert(
        !detail::has_partial(DTensor<T, Rank, Shape, P...>::placements),
        "checkpoint::load_into: a checkpoint holds tensors, not partial values; load into Replicate "
        "or Shard and redistribute");
    const SavedTensor& s = tensor(name);
    const Extents global = dtensor::detail::to_extents(t.global_shape());
    DTENSOR_CHECK(s.shape == global, "checkpoint " + dir_.string() + ": tensor '" + std::string(name) +
                                         "' has shape " + AnyTensor::to_string(s.shape) +
                                         ", loaded into a DTensor of shape " + AnyTensor::to_string(global));
    const Block target = spec_block(global, t.spec, t.mesh().sizes(), t.mesh().coordinate());
    Tensor<T, Rank> local(dtensor::detail::to_array<Rank>(target.shape));
    read(name, dtype_v<T>, target, local.data());
    const Device device = t.local().device();
    t = DTensor<T, Rank, Shape, P...>(t.mesh(), device.is_cpu() ? local : local.to(device), t.global_shape());
  }

private:
  static Extents parse_extents(const nlohmann::json& j, const std::string& where, const char* field) {
    DTENSOR_CHECK(j.is_array() && j.size() <= static_cast<std::size_t>(max_tensor_rank),
                  where + ": '" + field + "' is not a list of at most " + std::to_string(max_tensor_rank) +
                      " sizes");
    Extents e;
    for (const auto& v : j) {
      DTENSOR_CHECK(v.is_number_integer() && v.get<std::int64_t>() >= 0,
                    where + ": '" + field + "' holds " + v.dump() + ", not a size");
      e.push_back(v.get<std::int64_t>());
    }
    return e;
  }

  SavedTensor parse_tensor(const nlohmann::json& j, const std::string& where) const {
    SavedTensor t;
    const auto dtype = dtype_from_safetensors(j.at("dtype").get<std::string>());
    DTENSOR_CHECK(dtype.has_value(), where + ": unsupported dtype " + j.at("dtype").dump());
    t.dtype = *dtype;
    t.shape = parse_extents(j.at("shape"), where, "shape");
    (void)checkpoint::detail::tensor_bytes(t.shape, t.dtype, where); // its sizes, multiplied, fit int64
    std::int64_t covered = 0;
    for (const auto& b : j.at("blocks")) {
      SavedTensor::SavedBlock s;
      s.file = b.at("file").get<std::string>();
      s.key = b.at("key").get<std::string>();
      const std::string at = where + ", block '" + s.key + "'";
      DTENSOR_CHECK(file_bytes_.count(s.file) == 1,
                    at + ": file '" + s.file + "' is not in the index's \"files\"");
      s.block = {parse_extents(b.at("shape"), at, "shape"), parse_extents(b.at("offset"), at, "offset")};
      DTENSOR_CHECK(s.block.shape.size() == t.shape.size() && s.block.offset.size() == t.shape.size(),
                    at + ": its shape and offset do not have the tensor's " + std::to_string(t.shape.size()) +
                        " dims");
      for (int d = 0; d < t.shape.size(); ++d) {
        DTENSOR_CHECK(s.block.offset[d] <= t.shape[d] && s.block.shape[d] <= t.shape[d] - s.block.offset[d],
                      at + ": offset " + AnyTensor::to_string(s.block.offset) + " shape " +
                          AnyTensor::to_string(s.block.shape) + " leaves the tensor's shape " +
                          AnyTensor::to_string(t.shape));
      }
      s.begin = b.at("data_offsets").at(0).get<std::uint64_t>();
      s.end = b.at("data_offsets").at(1).get<std::uint64_t>();
      const std::uint64_t bytes = checkpoint::detail::tensor_bytes(s.block.shape, t.dtype, at);
      DTENSOR_CHECK(s.begin <= s.end && s.end - s.begin == bytes,
                    at + ": data_offsets [" + std::to_string(s.begin) + ", " + std::to_string(s.end) +
                        ") do not hold its " + std::to_string(bytes) + " bytes");
      s.crc32c = b.at("crc32c").get<std::vector<std::uint32_t>>();
      DTENSOR_CHECK(s.crc32c.size() == (bytes + chunk_bytes_ - 1) / chunk_bytes_,
                    at + ": " + std::to_string(s.crc32c.size()) + " checksums for " + std::to_string(bytes) +
                        " bytes in chunks of " + std::to_string(chunk_bytes_));
      for (const auto& other : t.blocks) {
        DTENSOR_CHECK(numel(intersect(other.block, s.block).shape) == 0,
                      at + ": overlaps block '" + other.key + "'");
      }
      covered += numel(s.block.shape);
      t.blocks.push_back(std::move(s));
    }
    DTENSOR_CHECK(covered == numel(t.shape), where + ": its blocks cover " + std::to_string(covered) +
                                                 " of its " + std::to_string(numel(t.shape)) + " elements");
    return t;
  }

  /// The open file `name` and its header, checked against the index the first time.
  const std::pair<File, Header>& open(const std::string& name) {
    auto it = files_.find(name);
    if (it != files_.end()) {
      return it->second;
    }
    File f(dir_ / name, O_RDONLY);
    const std::uint64_t size = f.size();
    const std::uint64_t expected = file_bytes_.at(name);
    DTENSOR_CHECK(size == expected, f.path().string() + ": " + std::to_string(size) +
                                        " bytes, the index says " + std::to_string(expected) +
                                        (size < expected ? " (truncated file)" : ""));
    Header h = read_header(f);
    return files_.emplace(name, std::make_pair(std::move(f), std::move(h))).first->second;
  }

  /// Copies the elements of `target` that block `b` holds into `out` (laid out as `target`); returns
  /// how many. Reads the chunks of `b` they lie in (merged into runs of consecutive chunks) and checks
  /// each chunk's CRC-32C.
  std::int64_t read_intersection(const SavedTensor& t, const SavedTensor::SavedBlock& b, const Block& target,
                                 std::byte* out) {
    const Block common = intersect(target, b.block);
    const std::int64_t count = numel(common.shape);
    if (count == 0) {
      return 0;
    }
    const auto& [file, header] = open(b.file);
    const TensorEntry* entry = header.find(b.key);
    const std::string in_file = file.path().string() + ": tensor '" + b.key + "'";
    DTENSOR_CHECK(entry != nullptr, in_file + " is in the index but not in the file");
    DTENSOR_CHECK(entry->dtype == t.dtype && entry->shape == b.block.shape && entry->begin == b.begin &&
                      entry->end == b.end,
                  in_file + ": the header says " + std::string(safetensors_dtype(entry->dtype)) + " " +
                      AnyTensor::to_string(entry->shape) + " at [" + std::to_string(entry->begin) + ", " +
                      std::to_string(entry->end) + "), the index " + std::string(safetensors_dtype(t.dtype)) +
                      " " + AnyTensor::to_string(b.block.shape) + " at [" + std::to_string(b.begin) + ", " +
                      std::to_string(b.end) + ")");
    const auto esize = static_cast<std::int64_t>(dtype_size(t.dtype));
    const int rank = common.shape.size();
    // Rows: runs along the last dim (a rank-0 tensor is one run of one element).
    const std::int64_t row = rank == 0 ? 1 : common.shape[rank - 1];
    const std::int64_t rows = count / row;
    const Extents bstride = detail::row_major_strides(b.block.shape);
    const Extents tstride = detail::row_major_strides(target.shape);
    struct Run {
      std::int64_t src; // element index in the block
      std::int64_t dst; // element index in target
    };
    std::vector<Run> runs;
    runs.reserve(static_cast<std::size_t>(rows));
    Extents idx(rank, 0);
    for (std::int64_t r = 0; r < rows; ++r) {
      Run run{0, 0};
      for (int d = 0; d < rank; ++d) {
        run.src += (common.offset[d] + idx[d] - b.block.offset[d]) * bstride[d];
        run.dst += (common.offset[d] + idx[d] - target.offset[d]) * tstride[d];
      }
      runs.push_back(run);
      for (int d = rank - 2; d >= 0; --d) { // next row: odometer over all dims but the last
        if (++idx[d] < common.shape[d]) {
          break;
        }
        idx[d] = 0;
      }
    }
    const std::uint64_t bytes = b.end - b.begin;
    const std::uint64_t rowb = static_cast<std::uint64_t>(row * esize);
    // Reads bytes [lo, hi) of the block (whole chunks first..last) into `to` and checks their checksums.
    const auto read_chunks = [&](std::byte* to, std::uint64_t first, std::uint64_t last) {
      const std::uint64_t lo = first * chunk_bytes_;
      const std::uint64_t hi = std::min(bytes, (last + 1) * chunk_bytes_);
      file.read_at(to, hi - lo, header.data_start + b.begin + lo, "tensor '" + b.key + "'");
      bytes_read_ += hi - lo;
      for (std::uint64_t c = first; c <= last; ++c) {
        const std::uint64_t at = c * chunk_bytes_ - lo;
        const std::uint64_t n = std::min(chunk_bytes_, hi - lo - at);
        DTENSOR_CHECK(crc32c(to + at, n) == b.crc32c[c],
                      in_file + ": checksum mismatch in bytes [" + std::to_string(lo + at) + ", " +
                          std::to_string(lo + at + n) + ") of the tensor (corrupt file)");
      }
      return hi;
    };
    // All of the block, contiguous in `target` too (same layout, or a block of whole rows): straight in.
    if (count == numel(b.block.shape) && runs.back().dst - runs.front().dst == (rows - 1) * row) {
      read_chunks(out + runs.front().dst * esize, 0, b.crc32c.size() - 1);
      return count;
    }
    // Otherwise the chunks the runs touch, as ranges of consecutive chunks, through a buffer.
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges; // [first, last] chunk
    for (const Run& run : runs) {
      const std::uint64_t lo = static_cast<std::uint64_t>(run.src * esize) / chunk_bytes_;
      const std::uint64_t hi = (static_cast<std::uint64_t>(run.src * esize) + rowb - 1) / chunk_bytes_;
      if (!ranges.empty() && lo <= ranges.back().second + 1) {
        ranges.back().second = std::max(ranges.back().second, hi);
      } else {
        ranges.push_back({lo, hi});
      }
    }
    std::uint64_t largest = 0;
    for (const auto& [first, last] : ranges) {
      largest = std::max(largest, (last + 1 - first) * chunk_bytes_);
    }
    const auto buffer = std::make_unique_for_overwrite<std::byte[]>(std::min(largest, bytes));
    std::size_t next = 0; // the first run not yet copied (runs are in increasing src order)
    for (const auto& [first, last] : ranges) {
      const std::uint64_t lo = first * chunk_bytes_;
      const std::uint64_t hi = read_chunks(buffer.get(), first, last);
      for (; next < runs.size() && static_cast<std::uint64_t>(runs[next].src * esize) < hi; ++next) {
        std::memcpy(out + runs[next].dst * esize, buffer.get() + (runs[next].src * esize - lo), rowb);
      }
    }
    return count;
  }

  std::filesystem::path dir_;
  std::uint64_t chunk_bytes_ = 0;
  std::map<std::string, std::uint64_t> file_bytes_;
  std::map<std::string, SavedTensor, std::less<>> tensors_;
  std::map<std::string, std::pair<File, Header>> files_;
  std::uint64_t bytes_read_ = 0;
};

/// This rank's part of tensor `name` of the checkpoint in `dir`, as a DTensor `DT` on `mesh`.
template <class DT>
DT load(const std::filesystem::path& dir, std::string_view name, const typename DT::mesh_type& mesh,
        Device device = Device::cpu()) {
  return Reader(dir).template load<DT>(name, mesh, device);
}

/// Gives `t` its part of tensor `name` of the checkpoint in `dir` (Reader::load_into).
template <class T, int Rank, class Shape, class... P>
void load_into(const std::filesystem::path& dir, std::string_view name, DTensor<T, Rank, Shape, P...>& t) {
  Reader(dir).load_into(name, t);
}

/// Writes every tensor of the checkpoint in `dir`, whole, into the one safetensors file `out` (atomically:
/// through "<out>.tmp" and a rename), in name order, with metadata {"format": "pt"} as PyTorch's
/// safetensors files have. One process; it holds one whole tensor in memory at a time.
inline void consolidate(const std::filesystem::path& dir, const std::filesystem::path& out) {
  Reader reader(dir);
  std::vector<TensorEntry> entries;
  std::uint64_t at = 0;
  for (const auto& [name, t] : reader.tensors()) {
    const std::uint64_t n = detail::tensor_bytes(t.shape, t.dtype, name);
    entries.push_back({name, t.dtype, t.shape, at, at + n});
    at += n;
  }
  const std::filesystem::path tmp = detail::sibling(out, ".tmp");
  {
    File f(tmp, O_WRONLY | O_CREAT | O_TRUNC);
    const std::string header = encode_header(entries, {{"format", "pt"}});
    f.write_all(header.data(), header.size());
    std::vector<std::byte> buffer;
    for (const TensorEntry& e : entries) {
      buffer.resize(e.end - e.begin);
      reader.read(e.name, e.dtype, Block{e.shape, Extents(e.shape.size(), 0)}, buffer.data());
      f.write_all(buffer.data(), buffer.size());
    }
    f.sync();
  }
  std::filesystem::rename(tmp, out);
  sync_directory(out.parent_path().empty() ? std::filesystem::path(".") : out.parent_path());
}

} // namespace dtensor::checkpoint
