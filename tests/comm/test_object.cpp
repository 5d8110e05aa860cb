// Object collectives (issue 18): all_gather_object, gather_object, broadcast_object_list,
// scatter_object_list and send/recv_object_list at 1-4 ranks, with objects of different lengths on each
// rank (empty ones too), trivially copyable structs, strings, nested vectors and a type with its own
// ObjectCodec, against what each rank computes locally; members passing different types get an Error on
// every rank naming the other rank, and damaged bytes an Error, never garbage.

#include "common.hpp"
#include "dtensor/comm/object.hpp"

#include <catch2/catch.hpp>

#include <map>

using namespace comm_test;

namespace {

struct Pod {
  std::int32_t a;
  double b;
  friend bool operator==(const Pod&, const Pod&) = default;
};

/// A type with its own codec (a map: not trivially copyable, not a vector).
struct Inventory {
  std::map<std::string, std::int64_t> counts;
  friend bool operator==(const Inventory&, const Inventory&) = default;
};

/// Rank r's objects: lengths vary with the rank, and rank 1's are empty.
std::string text_of(int r) {
  return r == 1 ? std::string() : std::string(static_cast<std::size_t>(3 * r + 2), char('a' + r));
}
std::vector<std::string> words_of(int r) {
  std::vector<std::string> w;
  for (int i = 0; i < (r + 2) % 4; ++i) {
    w.push_back(text_of(r + i));
  }
  return w;
}
Inventory inventory_of(int r) {
  Inventory v;
  for (int i = 0; i <= r; ++i) {
    v.counts["item" + std::to_string(i)] = 100 * r + i;
  }
  return v;
}

template <class T>
void expect_equal(const T& got, const T& want, const std::string& what) {
  if (!(got == want)) {
    throw Error(what + ": wrong object");
  }
}

} // namespace

template <>
struct dtensor::ObjectCodec<Inventory> {
  static void encode(const Inventory& v, std::vector<std::byte>& out) {
    encode_object(static_cast<std::uint64_t>(v.counts.size()), out);
    for (const auto& [k, c] : v.counts) {
      encode_object(k, out);
      encode_object(c, out);
    }
  }
  static Inventory decode(std::span<const std::byte>& in) {
    Inventory v;
    const auto n = decode_object<std::uint64_t>(in);
    for (std::uint64_t i = 0; i < n; ++i) {
      auto k = decode_object<std::string>(in);
      v.counts[k] = decode_object<std::int64_t>(in);
    }
    return v;
  }
};

TEST_CASE("all_gather_object and gather_object return every member's object in rank order",
          "[comm][object]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    auto texts = all_gather_object(text_of(r), g);
    auto pods = all_gather_object(Pod{r, r + 0.5}, g);
    std::vector<std::vector<std::string>> words;
    all_gather_object(words, words_of(r), g); // torch's form
    auto inventories = all_gather_object(inventory_of(r), g);
    if (texts.size() != static_cast<std::size_t>(n) || words.size() != static_cast<std::size_t>(n)) {
      throw Error("all_gather_object: wrong count");
    }
    for (int i = 0; i < n; ++i) {
      expect_equal(texts[i], text_of(i), "all_gather_object string " + std::to_string(i));
      expect_equal(pods[i], Pod{i, i + 0.5}, "all_gather_object pod " + std::to_string(i));
      expect_equal(words[i], words_of(i), "all_gather_object vector<string> " + std::to_string(i));
      expect_equal(inventories[i], inventory_of(i), "all_gather_object codec " + std::to_string(i));
    }
    for (int dst = 0; dst < n; ++dst) {
      auto got = gather_object(words_of(r), dst, g);
      if (r != dst) {
        expect_equal(got.size(), std::size_t{0}, "gather_object off the root");
        continue;
      }
      expect_equal(got.size(), static_cast<std::size_t>(n), "gather_object count");
      for (int i = 0; i < n; ++i) {
        expect_equal(got[i], words_of(i), "gather_object " + std::to_string(i));
      }
    }
  });
}

TEST_CASE("broadcast_object_list and scatter_object_list deliver src's objects", "[comm][object]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    for (int src = 0; src < n; ++src) {
      // Receivers start with lists of another length (even empty): they are resized to src's.
      std::vector<Inventory> list(static_cast<std::size_t>(r % 2 == 0 ? 5 : 0));
      if (r == src) {
        list = {inventory_of(src), Inventory{}, inventory_of(src + 1)};
      }
      broadcast_object_list(list, src, g);
      expect_equal(list, std::vector<Inventory>{inventory_of(src), Inventory{}, inventory_of(src + 1)},
                   "broadcast_object_list from " + std::to_string(src));

      std::vector<std::string> empty;
      if (r == src) {
        empty.clear();
      }
      broadcast_object_list(empty, src, g);
      expect_equal(empty.size(), std::size_t{0}, "broadcast_object_list of an empty list");

      std::vector<std::vector<std::string>> input;
      if (r == src) {
        for (int i = 0; i < n; ++i) {
          input.push_back(words_of(i + src));
        }
      }
      expect_equal(scatter_object_list(input, src, g), words_of(r + src),
                   "scatter_object_list from " + std::to_string(src));
    }
  });
}

TEST_CASE("send_object_list and recv_object_list pass lists of any length per tag", "[comm][object]") {
  const int world = GENERATE(2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    const int right = (r + 1) % n, left = (r + n - 1) % n;
    std::vector<std::string> got{"stale", "stale", "stale", "stale", "stale", "stale"};
    std::vector<Pod> pods;
    if (r % 2 == 0) {
      send_object_list(words_of(r), right, g);
      send_object_list(std::vector<Pod>{{r, 1.0}, {r, 2.0}}, right, g, /*tag=*/3);
      recv_object_list(got, left, g);
      recv_object_list(pods, left, g, 3);
    } else {
      recv_object_list(got, left, g);
      recv_object_list(pods, left, g, 3);
      send_object_list(words_of(r), right, g);
      send_object_list(std::vector<Pod>{{r, 1.0}, {r, 2.0}}, right, g, 3);
    }
    expect_equal(got, words_of(left), "recv_object_list");
    expect_equal(pods, std::vector<Pod>{{left, 1.0}, {left, 2.0}}, "recv_object_list with a tag");
  });
}

TEST_CASE("object collectives with different types on different members fail on every member",
          "[comm][object]") {
  const int world = GENERATE(2, 3);
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  testing::run_ranks(world, [&](ProcessGroup& g) {
    const int r = g.rank();
    try {
      if (r == 1) {
        all_gather_object(std::int64_t{r}, g);
      } else {
        all_gather_object(std::string("x"), g);
      }
    } catch (const Error& e) {
      messages[static_cast<std::size_t>(r)] = e.what();
      return;
    }
    throw Error("a type mismatch went through");
  });
  for (int r = 0; r < world; ++r) {
    INFO(messages[r]);
    // Each rank names a member whose type differs from its own.
    const std::string other = r == 1 ? "rank 0" : "rank 1";
    CHECK_THAT(messages[r], Catch::Contains("all_gather_object") && Catch::Contains(other) &&
                                Catch::Contains("another type"));
  }
}

TEST_CASE("decoding damaged object bytes is an Error, never garbage", "[comm][object]") {
  std::vector<std::byte> bytes;
  encode_object(std::vector<std::string>{"alpha", "beta"}, bytes);
  for (std::size_t cut = 0; cut < bytes.size(); ++cut) { // every truncation
    std::span<const std::byte> in(bytes.data(), cut);
    CHECK_THROWS_AS(decode_object<std::vector<std::string>>(in), Error);
  }
  std::span<const std::byte> whole(bytes);
  CHECK(decode_object<std::vector<std::string>>(whole) == std::vector<std::string>{"alpha", "beta"});
  CHECK(whole.empty());
  // A length field claiming more elements than bytes left.
  std::vector<std::byte> huge;
  encode_object(std::uint64_t{1} << 60, huge);
  std::span<const std::byte> h(huge);
  CHECK_THROWS_WITH(decode_object<std::vector<double>>(h), Catch::Contains("truncated"));
}
