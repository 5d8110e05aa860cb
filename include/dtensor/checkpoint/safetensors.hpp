#pragma once
// The safetensors file format (https://huggingface.co/docs/safetensors), written and read with checks:
//
//   8 bytes    N, little-endian uint64: the length of the header
//   N bytes    a JSON object: {"<tensor>": {"dtype": "F32", "shape": [7, 5], "data_offsets": [b, e]}, ...,
//              "__metadata__": {"<key>": "<string>"}}, padded with spaces so the data starts 8-aligned
//   the data   every tensor's bytes, row-major, little-endian, at [b, e) relative to the data's start;
//              the tensors tile the data with no gap and no overlap
//
// Python reads such a file with safetensors.torch.load_file, or with json and struct alone. This header
// holds the format (header encoding, parsing, validation) and the file primitives the checkpoint code
// uses (whole writes, positioned reads, fsync); checkpoint.hpp builds sharded checkpoints on it.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dtensor/core/checked_int.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/layout/algebra.hpp"

namespace dtensor::checkpoint {

static_assert(std::endian::native == std::endian::little,
              "dtensor checkpoints store little-endian bytes as safetensors requires; big-endian hosts would "
              "need a byte swap on save and load");

/// The safetensors name of a dtype: "F32", "F64", "BF16", "F16", "I32", "I64", "U8", "F8_E4M3", "F8_E5M2".
constexpr std::string_view safetensors_dtype(DType d) noexcept {
  switch (d) {
  case DType::float32:
    return "F32";
  case DType::float64:
    return "F64";
  case DType::bfloat16:
    return "BF16";
  case DType::float16:
    return "F16";
  case DType::int32:
    return "I32";
  case DType::int64:
    return "I64";
  case DType::uint8:
    return "U8";
  case DType::float8_e4m3:
    return "F8_E4M3";
  case DType::float8_e5m2:
    return "F8_E5M2";
  }
  return "?";
}

/// The dtype a safetensors name stands for; empty for names dtensor has no element type for (BOOL, I8...).
inline std::optional<DType> dtype_from_safetensors(std::string_view name) {
  for (DType d : {DType::float32, DType::float64, DType::bfloat16, DType::float16, DType::int32, DType::int64,
                  DType::uint8, DType::float8_e4m3, DType::float8_e5m2}) {
    if (safetensors_dtype(d) == name) {
      return d;
    }
  }
  return std::nullopt;
}

/// One tensor of a safetensors file: its bytes are [begin, end) of the data section.
struct TensorEntry {
  std::string name;
  DType dtype = DType::float32;
  Extents shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

/// A parsed, validated header.
struct Header {
  std::vector<TensorEntry> tensors;            ///< in data order
  std::map<std::string, std::string> metadata; ///< "__metadata__"
  std::uint64_t data_start = 0;                ///< file offset of the data section: 8 + N

  /// The entry named `name`, or nullptr.
  const TensorEntry* find(std::string_view name) const {
    auto it =
        std::find_if(tensors.begin(), tensors.end(), [&](const TensorEntry& t) { return t.name == name; });
    return it == tensors.end() ? nullptr : &*it;
  }
};

/// The largest header this reader accepts (the reference implementation's limit is 100 MB too).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

/// The 8-byte length and the JSON header of a file holding `tensors` (their begin/end set by the caller,
/// tiling the data in order), padded with spaces so the data starts at a multiple of 8.
inline std::string encode_header(const std::vector<TensorEntry>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    h["__metadata__"] = metadata;
  }
  for (const TensorEntry& t : tensors) {
    auto shape = nlohmann::ordered_json::array();
    for (std::int64_t s : t.shape) {
      shape.push_back(s);
    }
    h[t.name] = {{"dtype", safetensors_dtype(t.dtype)}, {"shape", shape}, {"data_offsets", {t.begin, t.end}}};
  }
  std::string json = h.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  std::uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json;
}

namespace detail {

inline std::string errno_text() {
  return std::strerror(errno);
}

} // namespace detail

/// A file descriptor, closed on destruction.
class File {
public:
  File() = default;
  File(const std::filesystem::path& path, int flags, mode_t mode = 0644) : path_(path) {
    fd_ = ::open(path.c_str(), flags | O_CLOEXEC, mode);
    DTENSOR_CHECK(fd_ >= 0, "cannot open " + path.string() + ": " + detail::errno_text());
  }
  File(File&& o) noexcept : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)) {}
  File& operator=(File&& o) noexcept {
    std::swap(fd_, o.fd_);
    std::swap(path_, o.path_);
    return *this;
  }
  ~File() {
    if (fd_ >= 0) {
      ::close(fd_);
    }
  }

  const std::filesystem::path& path() const noexcept { return path_; }

  std::uint64_t size() const {
    struct stat st {};
    DTENSOR_CHECK(::fstat(fd_, &st) == 0, "cannot stat " + path_.string() + ": " + detail::errno_text());
    return static_cast<std::uint64_t>(st.st_size);
  }

  /// Writes all `n` bytes at the current position.
  void write_all(const void* data, std::uint64_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, std::min<std::uint64_t>(n, 1u << 30));
      if (w < 0 && errno == EINTR) {
        continue;
      }
      DTENSOR_CHECK(w > 0, "cannot write " + path_.string() + ": " + detail::errno_text());
      p += w;
      n -= static_cast<std::uint64_t>(w);
    }
  }

  /// Reads exactly `n` bytes at `offset`; a short file is an Error naming `what`.
  void read_at(void* data, std::uint64_t n, std::uint64_t offset, std::string_view what) const {
    auto* p = static_cast<char*>(data);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, std::min<std::uint64_t>(n, 1u << 30), static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) {
        continue;
      }
      DTENSOR_CHECK(r >= 0, "cannot read " + path_.string() + ": " + detail::errno_text());
      DTENSOR_CHECK(r > 0, path_.string() + ": the file ends at byte " + std::to_string(offset) + " inside " +
                               std::string(what) + " (truncated file)");
      p += r;
      n -= static_cast<std::uint64_t>(r);
      offset += static_cast<std::uint64_t>(r);
    }
  }

  /// Flushes the file's data to the device (a directory's too: its entries).
  void sync() const {
    DTENSOR_CHECK(::fsync(fd_) == 0, "cannot fsync " + path_.string() + ": " + detail::errno_text());
  }

private:
  int fd_ = -1;
  std::filesystem::path path_;
};

/// fsync of a directory, so the names created in it survive a crash.
inline void sync_directory(const std::filesystem::path& dir) {
  File(dir, O_RDONLY | O_DIRECTORY).sync();
}

namespace detail {

inline Extents parse_shape(const nlohmann::json& j, const std::string& where) {
  DTENSOR_CHECK(j.is_array(), where + ": 'shape' must be an array of sizes");
  DTENSOR_CHECK(j.size() <= static_cast<std::size_t>(max_tensor_rank),
                where + ": 'shape' has " + std::to_string(j.size()) + " dims, dtensor supports at most " +
                    std::to_string(max_tensor_rank));
  Extents e;
  for (const auto& s : j) {
    DTENSOR_CHECK(s.is_number_integer() && s.get<std::int64_t>() >= 0,
                  where + ": 'shape' holds " + s.dump() + ", not a size");
    e.push_back(s.get<std::int64_t>());
  }
  return e;
}

inline std::uint64_t parse_offset(const nlohmann::json& j, const std::string& where) {
  DTENSOR_CHECK(j.is_number_unsigned() || (j.is_number_integer() && j.get<std::int64_t>() >= 0),
                where + ": 'data_offsets' holds " + j.dump() + ", not a byte offset");
  return j.get<std::uint64_t>();
}

/// Bytes of a tensor of `shape` and `dtype`; an Error naming `where` when that does not fit in int64.
inline std::uint64_t tensor_bytes(const Extents& shape, DType dtype, const std::string& where) {
  std::int64_t n = static_cast<std::int64_t>(dtype_size(dtype));
  for (std::int64_t s : shape) {
    DTENSOR_CHECK(dtensor::detail::checked_mul(n, s, n), where + ": the shape's byte size overflows int64");
  }
  return static_cast<std::uint64_t>(n);
}

} // namespace detail

/// Reads and validates the header of the safetensors file `file`: the length fits the file, the JSON
/// parses, every tensor has a known dtype, a shape and data offsets whose length is the shape's bytes, the
/// tensors tile the data section, and the file holds all of it. Errors name the file and the tensor.
inline Header read_header(const File& file) {
  const std::string path = file.path().string();
  const std::uint64_t size = file.size();
  DTENSOR_CHECK(size >= 8, path + ": " + std::to_string(size) +
                               " bytes, too short for a safetensors header length (truncated file)");
  std::uint64_t n = 0;
  file.read_at(&n, 8, 0, "the header length");
  DTENSOR_CHECK(n <= max_header_bytes, path + ": bad header: its length " + std::to_string(n) +
                                           " exceeds the limit of " + std::to_string(max_header_bytes) +
                                           " bytes (not a safetensors file?)");
  DTENSOR_CHECK(n <= size - 8, path + ": bad header: its length " + std::to_string(n) +
                                   " runs past the end of " + "the file (" + std::to_string(size) +
                                   " bytes; truncated file?)");
  std::string text(n, '\0');
  file.read_at(text.data(), n, 8, "the header");
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  DTENSOR_CHECK(j.is_object(), path + ": bad header: not a JSON object (not a safetensors file?)");
  Header h;
  h.data_start = 8 + n;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string where = path + ": tensor '" + it.key() + "'";
    if (it.key() == "__metadata__") {
      DTENSOR_CHECK(it->is_object(), path + ": bad header: '__metadata__' must be an object of strings");
      for (auto m = it->begin(); m != it->end(); ++m) {
        DTENSOR_CHECK(m->is_string(),
                      path + ": bad header: '__metadata__' entry '" + m.key() + "' is not a string");
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    DTENSOR_CHECK(it->is_object() && it->contains("dtype") && it->contains("shape") &&
                      it->contains("data_offsets"),
                  where + ": bad header: needs 'dtype', 'shape' and 'data_offsets'");
    const auto& dt = (*it)["dtype"];
    const auto dtype = dt.is_string() ? dtype_from_safetensors(dt.get<std::string>()) : std::nullopt;
    DTENSOR_CHECK(dtype.has_value(), where + ": unsupported dtype " + dt.dump());
    TensorEntry e{it.key(), *dtype, detail::parse_shape((*it)["shape"], where), 0, 0};
    const auto& off = (*it)["data_offsets"];
    DTENSOR_CHECK(off.is_array() && off.size() == 2, where + ": 'data_offsets' must be [begin, end]");
    e.begin = detail::parse_offset(off[0], where);
    e.end = detail::parse_offset(off[1], where);
    DTENSOR_CHECK(e.begin <= e.end && e.end - e.begin == detail::tensor_bytes(e.shape, e.dtype, where),
                  where + ": 'data_offsets' [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                      ") do not hold the " + std::to_string(detail::tensor_bytes(e.shape, e.dtype, where)) +
                      " bytes of its shape and dtype");
    h.tensors.push_back(std::move(e));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t at = 0;
  for (const TensorEntry& e : h.tensors) {
    DTENSOR_CHECK(e.begin == at, path + ": tensor '" + e.name + "' starts at data byte " +
                                     std::to_string(e.begin) + ", expected " + std::to_string(at) +
                                     " (tensors must tile the data)");
    at = e.end;
  }
  DTENSOR_CHECK(at == size - h.data_start, path + ": the header describes " + std::to_string(at) +
                                               " bytes of data, the file holds " +
                                               std::to_string(size - h.data_start) +
                                               (at > size - h.data_start ? " (truncated file)" : ""));
  return h;
}

} // namespace dtensor::checkpoint
