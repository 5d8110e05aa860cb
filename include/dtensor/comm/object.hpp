#pragma once
// Object collectives, as in torch.distributed: all_gather_object, gather_object, broadcast_object_list,
// scatter_object_list, send_object_list and recv_object_list, for values instead of tensors. Synchronous.
//
//   auto names = dtensor::all_gather_object(std::string(host), world);  // one per member, in rank order
//   std::vector<Config> cfg;  if (rank == 0) cfg = {load()};
//   dtensor::broadcast_object_list(cfg, /*src=*/0, world);              // resized to src's length
//
// An object is encoded to bytes by ObjectCodec<T>: built in for trivially copyable types, std::string and
// std::vector of an encodable type; specialize dtensor::ObjectCodec for your own (encode appends to a byte
// vector, decode consumes from the front of a span; dtensor::encode_object / decode_object compose the
// members). Every message carries a fingerprint of T: members that pass different types get a
// dtensor::Error naming both ranks instead of garbage, and truncated or oversized bytes are an Error too.
//
// Each call is a few collectives on uint8 tensors (sizes first, then the bytes, padded to the largest);
// CommDebugMode sees them. The bytes live on options.device: the CPU for gloo; a CUDA device for NCCL
// groups (torch uses the current device there; here it is named, and a CPU device on NCCL is an Error).

#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/p2p.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

namespace dtensor {

/// How a value of type T becomes bytes and back (pointers have none: their values mean nothing in another
/// process). Specialize for your types:
///   template <> struct dtensor::ObjectCodec<Point> {
///     static void encode(const Point& p, std::vector<std::byte>& out) { dtensor::encode_object(p.name, out);
///     ... } static Point decode(std::span<const std::byte>& in) { Point p; p.name =
///     dtensor::decode_object<std::string>(in); ... }
///   };
template <class T, class = void>
struct ObjectCodec;

namespace detail {
template <class T>
concept HasObjectCodec = requires(const T& v, std::vector<std::byte>& out, std::span<const std::byte>& in) {
  ObjectCodec<T>::encode(v, out);
  { ObjectCodec<T>::decode(in) } -> std::same_as<T>;
};

inline std::span<const std::byte> take_bytes(std::span<const std::byte>& in, std::size_t n,
                                             const char* what) {
  DTENSOR_CHECK(n <= in.size(), std::string("decoding an object: ") + what + " needs " + std::to_string(n) +
                                    " bytes, " + std::to_string(in.size()) + " are left (truncated data)");
  auto head = in.first(n);
  in = in.subspan(n);
  return head;
}
} // namespace detail

/// Appends the encoding of `value` to `out`.
template <class T>
void encode_object(const T& value, std::vector<std::byte>& out) {
  static_assert(
      detail::HasObjectCodec<T>,
      "dtensor: this type has no ObjectCodec. Object collectives encode trivially copyable types, "
      "std::string and std::vector of encodable types; specialize dtensor::ObjectCodec<T> for others");
  ObjectCodec<T>::encode(value, out);
}

/// Decodes a T from the front of `in` and advances `in` past it.
template <class T>
T decode_object(std::span<const std::byte>& in) {
  static_assert(
      detail::HasObjectCodec<T>,
      "dtensor: this type has no ObjectCodec. Object collectives encode trivially copyable types, "
      "std::string and std::vector of encodable types; specialize dtensor::ObjectCodec<T> for others");
  return ObjectCodec<T>::decode(in);
}

template <class T>
struct ObjectCodec<T, std::enable_if_t<std::is_trivially_copyable_v<T> && !std::is_pointer_v<T>>> {
  static void encode(const T& v, std::vector<std::byte>& out) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  static T decode(std::span<const std::byte>& in) {
    T v;
    std::memcpy(&v, detail::take_bytes(in, sizeof(T), typeid(T).name()).data(), sizeof(T));
    return v;
  }
};

template <>
struct ObjectCodec<std::string> {
  static void encode(const std::string& s, std::vector<std::byte>& out) {
    encode_object(static_cast<std::uint64_t>(s.size()), out);
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    out.insert(out.end(), p, p + s.size());
  }
  static std::string decode(std::span<const std::byte>& in) {
    const auto n = decode_object<std::uint64_t>(in);
    auto bytes = detail::take_bytes(in, n, "a string");
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
};

template <class U, class A>
struct ObjectCodec<std::vector<U, A>, std::enable_if_t<detail::HasObjectCodec<U>>> {
  static void encode(const std::vector<U, A>& v, std::vector<std::byte>& out) {
    encode_object(static_cast<std::uint64_t>(v.size()), out);
    if constexpr (std::is_trivially_copyable_v<U> && !std::is_same_v<U, bool>) {
      const auto* p = reinterpret_cast<const std::byte*>(v.data());
      out.insert(out.end(), p, p + v.size() * sizeof(U));
    } else {
      for (const auto& x : v) {
        encode_object(x, out);
      }
    }
  }
  static std::vector<U, A> decode(std::span<const std::byte>& in) {
    const auto n = decode_object<std::uint64_t>(in);
    std::vector<U, A> v;
    if constexpr (std::is_trivially_copyable_v<U> && !std::is_same_v<U, bool>) {
      DTENSOR_CHECK(n <= in.size() / sizeof(U), "decoding an object: a vector of " + std::to_string(n) +
                                                    " elements of " + std::to_string(sizeof(U)) + " bytes, " +
                                                    std::to_string(in.size()) +
                                                    " bytes are left (truncated data)");
      v.resize(n);
      std::memcpy(v.data(), detail::take_bytes(in, n * sizeof(U), "a vector").data(), n * sizeof(U));
    } else {
      DTENSOR_CHECK(n <= in.size(), "decoding an object: a vector of " + std::to_string(n) + " elements, " +
                                        std::to_string(in.size()) + " bytes are left (truncated data)");
      v.reserve(n);
      for (std::uint64_t i = 0; i < n; ++i) {
        v.push_back(decode_object<U>(in));
      }
    }
    return v;
  }
};

/// Where object collectives stage their bytes.
struct ObjectOptions {
  Device device = Device::cpu(); ///< a CUDA device for NCCL groups
};

namespace detail {

/// FNV-1a of T's mangled name: equal in every process of one program (and of programs built alike).
template <class T>
std::uint64_t object_type_tag() {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const char* c = typeid(T).name(); *c != '\0'; ++c) {
    h = (h ^ static_cast<unsigned char>(*c)) * 0x100000001b3ULL;
  }
  return h;
}

/// One message: the type tag, then the list's encoding.
template <class T>
std::vector<std::byte> encode_list(std::span<const T> objects) {
  std::vector<std::byte> out;
  encode_object(object_type_tag<T>(), out);
  encode_object(static_cast<std::uint64_t>(objects.size()), out);
  for (const auto& x : objects) {
    encode_object(x, out);
  }
  return out;
}

template <class T>
std::vector<T> decode_list(std::span<const std::byte> in, const ProcessGroup& group, const char* op,
                           int from) {
  const std::string where = op_context(group, op) + ": the bytes of rank " + std::to_string(from);
  DTENSOR_CHECK(in.size() >= 16,
                where + " are " + std::to_string(in.size()) + " long, too short for a header");
  const auto tag = decode_object<std::uint64_t>(in);
  DTENSOR_CHECK(tag == object_type_tag<T>(), where + " hold another type than this rank's " +
                                                 typeid(T).name() +
                                                 " (every member must pass the same type)");
  const auto n = decode_object<std::uint64_t>(in);
  DTENSOR_CHECK(n <= in.size(), where + " claim " + std::to_string(n) + " objects in " +
                                    std::to_string(in.size()) + " bytes");
  std::vector<T> out;
  out.reserve(n);
  try {
    for (std::uint64_t i = 0; i < n; ++i) {
      out.push_back(decode_object<T>(in));
    }
  } catch (const Error& e) {
    throw Error(where + ": " + e.what());
  }
  DTENSOR_CHECK(in.empty(), where + " have " + std::to_string(in.size()) + " bytes past their objects");
  return out;
}

inline void check_object_device(const ProcessGroup& group, const ObjectOptions& options, const char* op) {
  DTENSOR_CHECK(
      !(group.backend_name() == "nccl" && options.device.is_cpu()),
      op_context(group, op) +
          ": NCCL moves only CUDA memory; pass ObjectOptions{Device::cuda(i)} for the objects' bytes");
  DTENSOR_CHECK(!options.device.is_meta(), op_context(group, op) +
                                               ": objects are data, which a meta tensor does not hold; pass "
                                               "the host (ObjectOptions{Device::cpu()}) or a GPU");
}

/// The bytes of `message` in a uint8 tensor of `padded` elements on `device`.
inline Tensor<std::uint8_t, 1> bytes_tensor(const std::vector<std::byte>& message, std::int64_t padded,
                                            Device device) {
  auto host = Tensor<std::uint8_t, 1>::zeros({padded});
  if (!message.empty()) {
    std::memcpy(host.data(), message.data(), message.size());
  }
  return device.is_cpu() ? host : host.to(device);
}

inline Tensor<std::int64_t, 1> on_device(Tensor<std::int64_t, 1> t, Device device) {
  return device.is_cpu() ? t : t.to(device);
}

template <class T, int Rank>
Tensor<T, Rank> on_host(const Tensor<T, Rank>& t) {
  return t.device().is_cpu() ? t : t.to(Device::cpu());
}

inline std::span<const std::byte> byte_span(const Tensor<std::uint8_t, 1>& host, std::int64_t offset,
                                            std::int64_t n) {
  return {reinterpret_cast<const std::byte*>(host.data()) + offset, static_cast<std::size_t>(n)};
}

/// Every member's message length (all_gather of one int64).
inline std::vector<std::int64_t> gather_lengths(std::int64_t mine, const ProcessGroup& group, Device device) {
  const int n = group.size();
  auto in = on_device(Tensor<std::int64_t, 1>::full({1}, mine), device);
  auto all = on_device(Tensor<std::int64_t, 1>::full({n}, -1), device);
  all_gather_into_tensor(all, in, group);
  auto host = on_host(all);
  return {host.data(), host.data() + n};
}

inline std::int64_t max_of(const std::vector<std::int64_t>& v) {
  std::int64_t m = 0;
  for (auto x : v) {
    m = std::max(m, x);
  }
  return m;
}

} // namespace detail

/// Every member's `object`, in rank order.
template <class T>
std::vector<T> all_gather_object(const T& object, const ProcessGroup& group, ObjectOptions options = {}) {
  detail::check_object_device(group, options, "all_gather_object");
  const auto message = detail::encode_list<T>(std::span<const T>(&object, 1));
  const auto lengths =
      detail::gather_lengths(static_cast<std::int64_t>(message.size()), group, options.device);
  const std::int64_t width = detail::max_of(lengths);
  const int n = group.size();
  auto in = detail::bytes_tensor(message, width, options.device);
  auto out = detail::bytes_tensor({}, width * n, options.device);
  all_gather_into_tensor(out, in, group);
  const auto host = detail::on_host(out);
  std::vector<T> objects;
  objects.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    auto one =
        detail::decode_list<T>(detail::byte_span(host, r * width, lengths[static_cast<std::size_t>(r)]),
                               group, "all_gather_object", r);
    DTENSOR_CHECK(one.size() == 1, detail::op_context(group, "all_gather_object") + ": rank " +
                                       std::to_string(r) + " sent " + std::to_string(one.size()) +
                                       " objects");
    objects.push_back(std::move(one.front()));
  }
  return objects;
}

/// torch's form: object_list = every member's `object`, in rank order (resized to the group's size).
template <class T>
void all_gather_object(std::vector<T>& object_list, const T& object, const ProcessGroup& group,
                       ObjectOptions options = {}) {
  object_list = all_gather_object(object, group, options);
}

/// On `dst`: every member's `object`, in rank order; elsewhere an empty vector.
template <class T>
std::vector<T> gather_object(const T& object, int dst, const ProcessGroup& group,
                             ObjectOptions options = {}) {
  detail::check_object_device(group, options, "gather_object");
  const int n = group.size();
  DTENSOR_CHECK(dst >= 0 && dst < n, detail::op_context(group, "gather_object") + ": dst " +
                                         std::to_string(dst) + " is not a rank of a group of " +
                                         std::to_string(n));
  const auto message = detail::encode_list<T>(std::span<const T>(&object, 1));
  const auto lengths =
      detail::gather_lengths(static_cast<std::int64_t>(message.size()), group, options.device);
  const std::int64_t width = detail::max_of(lengths);
  auto in = detail::bytes_tensor(message, width, options.device);
  const bool root = group.rank() == dst;
  std::vector<Tensor<std::uint8_t, 1>> blocks;
  if (root) {
    for (int r = 0; r < n; ++r) {
      blocks.push_back(detail::bytes_tensor({}, width, options.device));
    }
  }
  gather(in, root ? &blocks : nullptr, dst, group);
  std::vector<T> objects;
  if (root) {
    for (int r = 0; r < n; ++r) {
      const auto host = detail::on_host(blocks[static_cast<std::size_t>(r)]);
      auto one = detail::decode_list<T>(detail::byte_span(host, 0, lengths[static_cast<std::size_t>(r)]),
                                        group, "gather_object", r);
      DTENSOR_CHECK(one.size() == 1, detail::op_context(group, "gather_object") + ": rank " +
                                         std::to_string(r) + " sent " + std::to_string(one.size()) +
                                         " objects");
      objects.push_back(std::move(one.front()));
    }
  }
  return objects;
}

/// object_list = `src`'s object_list on every member (resized to its length).
template <class T>
void broadcast_object_list(std::vector<T>& object_list, int src, const ProcessGroup& group,
                           ObjectOptions options = {}) {
  detail::check_object_device(group, options, "broadcast_object_list");
  const int n = group.size();
  DTENSOR_CHECK(src >= 0 && src < n, detail::op_context(group, "broadcast_object_list") + ": src " +
                                         std::to_string(src) + " is not a rank of a group of " +
                                         std::to_string(n));
  const bool root = group.rank() == src;
  const auto message = root ? detail::encode_list<T>(object_list) : std::vector<std::byte>{};
  auto length = detail::on_device(
      Tensor<std::int64_t, 1>::full({1}, static_cast<std::int64_t>(message.size())), options.device);
  broadcast(length, src, group);
  const std::int64_t bytes = detail::on_host(length).data()[0];
  auto data = detail::bytes_tensor(message, bytes, options.device);
  broadcast(data, src, group);
  if (!root) {
    object_list = detail::decode_list<T>(detail::byte_span(detail::on_host(data), 0, bytes), group,
                                         "broadcast_object_list", src);
  }
}

/// The element `rank` of `src`'s input_list (which must hold one object per member; ignored elsewhere).
template <class T>
T scatter_object_list(const std::vector<T>& input_list, int src, const ProcessGroup& group,
                      ObjectOptions options = {}) {
  detail::check_object_device(group, options, "scatter_object_list");
  const int n = group.size();
  DTENSOR_CHECK(src >= 0 && src < n, detail::op_context(group, "scatter_object_list") + ": src " +
                                         std::to_string(src) + " is not a rank of a group of " +
                                         std::to_string(n));
  const bool root = group.rank() == src;
  if (root) {
    DTENSOR_CHECK(input_list.size() == static_cast<std::size_t>(n),
                  detail::op_context(group, "scatter_object_list") + ": src " + std::to_string(src) +
                      " needs one object per member (" + std::to_string(n) + "), got " +
                      std::to_string(input_list.size()));
  }
  // src's lengths go out first (a broadcast), then the padded messages (a scatter).
  std::vector<std::vector<std::byte>> messages;
  auto lengths = Tensor<std::int64_t, 1>::full({n}, 0);
  if (root) {
    for (int r = 0; r < n; ++r) {
      messages.push_back(
          detail::encode_list<T>(std::span<const T>(&input_list[static_cast<std::size_t>(r)], 1)));
      lengths.data()[r] = static_cast<std::int64_t>(messages.back().size());
    }
  }
  auto lengths_dev = detail::on_device(lengths, options.device);
  broadcast(lengths_dev, src, group);
  const auto lengths_host = detail::on_host(lengths_dev);
  const std::vector<std::int64_t> all(lengths_host.data(), lengths_host.data() + n);
  const std::int64_t width = detail::max_of(all);
  std::vector<Tensor<std::uint8_t, 1>> blocks;
  for (const auto& m : messages) {
    blocks.push_back(detail::bytes_tensor(m, width, options.device));
  }
  auto out = detail::bytes_tensor({}, width, options.device);
  scatter(out, blocks, src, group);
  const int me = group.rank();
  auto one =
      detail::decode_list<T>(detail::byte_span(detail::on_host(out), 0, all[static_cast<std::size_t>(me)]),
                             group, "scatter_object_list", src);
  DTENSOR_CHECK(one.size() == 1, detail::op_context(group, "scatter_object_list") + ": src sent " +
                                     std::to_string(one.size()) + " objects to rank " + std::to_string(me));
  return std::move(one.front());
}

/// Sends `object_list` to `dst` (which calls recv_object_list): its length, then its bytes.
template <class T>
void send_object_list(const std::vector<T>& object_list, int dst, const ProcessGroup& group, int tag = 0,
                      ObjectOptions options = {}) {
  detail::check_object_device(group, options, "send_object_list");
  const auto message = detail::encode_list<T>(object_list);
  send(detail::on_device(Tensor<std::int64_t, 1>::full({1}, static_cast<std::int64_t>(message.size())),
                         options.device),
       dst, group, tag);
  send(detail::bytes_tensor(message, static_cast<std::int64_t>(message.size()), options.device), dst, group,
       tag);
}

/// object_list = the list `src` sent with send_object_list (resized to its length).
template <class T>
void recv_object_list(std::vector<T>& object_list, int src, const ProcessGroup& group, int tag = 0,
                      ObjectOptions options = {}) {
  detail::check_object_device(group, options, "recv_object_list");
  auto length = detail::on_device(Tensor<std::int64_t, 1>::full({1}, -1), options.device);
  recv(length, src, group, tag);
  const std::int64_t bytes = detail::on_host(length).data()[0];
  auto data = detail::bytes_tensor({}, bytes, options.device);
  recv(data, src, group, tag);
  object_list = detail::decode_list<T>(detail::byte_span(detail::on_host(data), 0, bytes), group,
                                       "recv_object_list", src);
}

} // namespace dtensor
