#pragma once
// The collective suite run as real processes (one per rank): every collective and point-to-point op of the
// communication layer against a single-process reference, on host tensors (gloo) or CUDA tensors (NCCL).
// No Catch2 (the GPU machine has none): each check throws dtensor::Error naming the rank and the case, and
// run_suite() prints one line per case and returns the number of failures.
//
// Fixed-size ops go through the typed front end (collectives.hpp, p2p.hpp); variable-size ops (uneven
// all_gather / reduce_scatter, split all_to_all, gather, scatter) call the Backend directly, with their
// counts and displacements. The last case runs DTensor redistributions (dtensor_cases.hpp).
// Values are small integers, so every reduction is exact in every element type and order (avg on floats
// is compared with a tolerance: NCCL scales by 1/n before summing).

#include "dtensor/backends/backend.hpp"
#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/p2p.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

namespace suite {

using namespace dtensor;
using dtensor::half; // in nvcc TUs, CUDA's cuda_fp16.h (via Thrust) also declares a global ::half

struct Ctx {
  ProcessGroup world;
  Device device;
  int rank = 0;
  int size = 1;
};

template <class T>
T val(double v) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<std::int64_t>(v));
  } else {
    return T(static_cast<float>(v));
  }
}

template <class T>
double dbl(T v) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<double>(v);
  } else {
    return static_cast<double>(static_cast<float>(v));
  }
}

/// A 1-d tensor of `n` elements with f(i), on the context's device.
template <class T>
Tensor<T, 1> make(const Ctx& c, std::int64_t n, const std::function<double(std::int64_t)>& f) {
  auto h = Tensor<T, 1>({n});
  for (std::int64_t i = 0; i < n; ++i) {
    h.data()[i] = val<T>(f(i));
  }
  return c.device.is_cpu() ? h : h.to(c.device);
}

template <class T>
Tensor<T, 1> host(const Tensor<T, 1>& t) {
  return t.device().is_cpu() ? t : t.to(Device::cpu());
}

template <class T>
void expect(const Ctx& c, const Tensor<T, 1>& t, const std::function<double(std::int64_t)>& f,
            const std::string& what, double rel_tol = 0) {
  auto h = host(t);
  for (std::int64_t i = 0; i < h.numel(); ++i) {
    const double got = dbl(h.data()[i]);
    const double want = dbl(val<T>(f(i)));
    const bool ok =
        rel_tol == 0 ? got == want : std::fabs(got - want) <= rel_tol * std::max(1.0, std::fabs(want));
    if (!ok) {
      throw Error("rank " + std::to_string(c.rank) + ": " + what + ": element " + std::to_string(i) + " is " +
                  std::to_string(got) + ", expected " + std::to_string(want));
    }
  }
}

inline void check(bool cond, const Ctx& c, const std::string& what) {
  if (!cond) {
    throw Error("rank " + std::to_string(c.rank) + ": " + what);
  }
}

template <class T>
BufferRef buf(const Tensor<T, 1>& t) {
  return BufferRef{t.data(), t.numel(), dtype_v<T>, t.device()};
}

inline std::vector<std::int64_t> displs_of(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> d(counts.size());
  std::exclusive_scan(counts.begin(), counts.end(), d.begin(), std::int64_t{0});
  return d;
}

/// torch.chunk sizes of `total` over n parts.
inline std::vector<std::int64_t> chunk_counts(std::int64_t total, int n) {
  const std::int64_t c = (total + n - 1) / n;
  std::vector<std::int64_t> out(n);
  for (int i = 0; i < n; ++i) {
    out[i] = std::max<std::int64_t>(0, std::min(total, (i + 1) * c) - i * c);
  }
  return out;
}

// ---- cases ---------------------------------------------------------------------------------------------

/// rank r holds (r + 1 + i % 3); the reference reduces that over every rank in double, then casts to T
/// (integer sums never overflow here; the uint8 product does and wraps, like the backends).
template <class T>
void all_reduce_ops(const Ctx& c) {
  const std::int64_t n = 7;
  auto value = [](int r, std::int64_t i) { return double(r + 1 + i % 3); };
  std::vector<ReduceOp> ops{ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::product};
  if constexpr (std::is_integral_v<T>) { // the bitwise ops: integer types only
    ops.insert(ops.end(), {ReduceOp::band, ReduceOp::bor, ReduceOp::bxor});
  }
  for (ReduceOp op : ops) {
    auto t = make<T>(c, n, [&](std::int64_t i) { return value(c.rank, i); });
    if (is_bitwise(op) && c.device.is_cuda()) { // NCCL has no bitwise reduction: refused before any launch
      std::string said;
      try {
        all_reduce(t, op, c.world);
      } catch (const Error& e) {
        said = e.what();
      }
      if (said.find("no bitwise reduction") == std::string::npos) {
        throw Error("rank " + std::to_string(c.rank) + ": all_reduce " + std::string(to_string(op)) +
                    " on NCCL was not refused (" + said + ")");
      }
      continue;
    }
    all_reduce(t, op, c.world);
    auto ref = [&](std::int64_t i) {
      double acc = value(0, i);
      std::uint64_t wrap = static_cast<std::uint64_t>(acc);
      std::uint64_t bits = wrap;
      for (int r = 1; r < c.size; ++r) {
        const double v = value(r, i);
        switch (op) {
        case ReduceOp::band:
          bits &= static_cast<std::uint64_t>(v);
          acc = static_cast<double>(bits);
          break;
        case ReduceOp::bor:
          bits |= static_cast<std::uint64_t>(v);
          acc = static_cast<double>(bits);
          break;
        case ReduceOp::bxor:
          bits ^= static_cast<std::uint64_t>(v);
          acc = static_cast<double>(bits);
          break;
        case ReduceOp::sum:
        case ReduceOp::avg:
          acc += v;
          break;
        case ReduceOp::max:
          acc = std::max(acc, v);
          break;
        case ReduceOp::min:
          acc = std::min(acc, v);
          break;
        case ReduceOp::product:
          acc *= v;
          wrap *= static_cast<std::uint64_t>(v);
          break;
        }
      }
      if (op == ReduceOp::avg) {
        acc = std::is_integral_v<T> ? std::trunc(acc / c.size) : acc / c.size;
      }
      if (op == ReduceOp::product && std::is_same_v<T, std::uint8_t>) {
        acc = static_cast<double>(wrap % 256);
      }
      return acc;
    };
    const double tol = op == ReduceOp::avg && !std::is_integral_v<T> ? (sizeof(T) == 2 ? 1e-2 : 1e-6) : 0;
    expect(c, t, ref,
           std::string("all_reduce ") + std::string(dtype_name(dtype_v<T>)) + " op " +
               std::to_string(static_cast<int>(op)),
           tol);
  }
}

inline void reduce_and_broadcast(const Ctx& c) {
  for (int root = 0; root < c.size; ++root) {
    auto t = make<float>(c, 5, [&](std::int64_t i) { return double(c.rank * 10 + i); });
    reduce(t, root, ReduceOp::sum, c.world);
    if (c.rank == root) {
      expect(
          c, t, [&](std::int64_t i) { return 10.0 * c.size * (c.size - 1) / 2 + double(i) * c.size; },
          "reduce to " + std::to_string(root));
    }
    auto b = make<std::int32_t>(c, 6, [&](std::int64_t i) { return double(c.rank == root ? 100 + i : -1); });
    broadcast(b, root, c.world);
    expect(
        c, b, [&](std::int64_t i) { return double(100 + i); }, "broadcast from " + std::to_string(root));
  }
}

inline void gather_scatter_tensor(const Ctx& c) {
  const std::int64_t k = 3;
  auto in = make<bfloat16>(c, k, [&](std::int64_t i) { return double(c.rank * k + i); });
  auto out = make<bfloat16>(c, k * c.size, [](std::int64_t) { return -1.0; });
  all_gather_into_tensor(out, in, c.world);
  expect(
      c, out, [](std::int64_t i) { return double(i); }, "all_gather_into_tensor");

  auto big = make<float>(c, k * c.size, [&](std::int64_t i) { return double(i + c.rank); });
  auto mine = make<float>(c, k, [](std::int64_t) { return -1.0; });
  reduce_scatter_tensor(mine, big, ReduceOp::sum, c.world);
  expect(
      c, mine,
      [&](std::int64_t i) { return double((c.rank * k + i) * c.size) + c.size * (c.size - 1) / 2.0; },
      "reduce_scatter_tensor sum");
  reduce_scatter_tensor(mine, big, ReduceOp::max, c.world);
  expect(
      c, mine, [&](std::int64_t i) { return double(c.rank * k + i + c.size - 1); },
      "reduce_scatter_tensor max");
}

/// all_gather and reduce_scatter with torch.chunk-uneven blocks (empty ones included), through the Backend.
inline void uneven_gather_scatter(const Ctx& c) {
  auto& b = c.world.impl();
  for (std::int64_t total : {std::int64_t(9), std::int64_t(5), std::int64_t(1)}) {
    const auto counts = chunk_counts(total, c.size);
    const auto displs = displs_of(counts);
    auto in =
        make<std::int64_t>(c, counts[c.rank], [&](std::int64_t i) { return double(displs[c.rank] + i); });
    auto out = make<std::int64_t>(c, total, [](std::int64_t) { return -1.0; });
    b.all_gather(buf(in), buf(out), counts, displs, {})->wait();
    expect(
        c, out, [](std::int64_t i) { return double(i); }, "uneven all_gather of " + std::to_string(total));

    auto full = make<float>(c, total, [&](std::int64_t i) { return double(i * (c.rank + 1)); });
    auto part = make<float>(c, counts[c.rank], [](std::int64_t) { return -1.0; });
    b.reduce_scatter(buf(full), buf(part), counts, displs, ReduceOp::sum, {})->wait();
    expect(
        c, part, [&](std::int64_t i) { return double((displs[c.rank] + i) * c.size * (c.size + 1) / 2); },
        "uneven reduce_scatter of " + std::to_string(total));
  }
}

inline void all_to_all_cases(const Ctx& c) {
  const int n = c.size;
  // Equal blocks through the front end: rank r sends (r, j) to rank j.
  auto in = make<std::int32_t>(c, 2 * n, [&](std::int64_t i) { return double(c.rank * 100 + i / 2); });
  auto out = make<std::int32_t>(c, 2 * n, [](std::int64_t) { return -1.0; });
  all_to_all_single(out, in, c.world);
  expect(
      c, out, [&](std::int64_t i) { return double((i / 2) * 100 + c.rank); }, "all_to_all_single");

  // Split sizes: rank s sends (s + d) % 3 elements to rank d, each = s * 1000 + d * 10 + k.
  auto cnt = [](int s, int d) { return std::int64_t((s + d) % 3); };
  std::vector<std::int64_t> sc(n), rc(n);
  for (int j = 0; j < n; ++j) {
    sc[j] = cnt(c.rank, j);
    rc[j] = cnt(j, c.rank);
  }
  const auto sd = displs_of(sc);
  const auto rd = displs_of(rc);
  std::vector<double> src, want;
  for (int j = 0; j < n; ++j) {
    for (std::int64_t k = 0; k < sc[j]; ++k) {
      src.push_back(c.rank * 1000 + j * 10 + k);
    }
    for (std::int64_t k = 0; k < rc[j]; ++k) {
      want.push_back(j * 1000 + c.rank * 10 + k);
    }
  }
  auto sin = make<float>(c, std::int64_t(src.size()), [&](std::int64_t i) { return src[i]; });
  auto sout = make<float>(c, std::int64_t(want.size()), [](std::int64_t) { return -1.0; });
  c.world.impl().all_to_all(buf(sin), sc, sd, buf(sout), rc, rd, {})->wait();
  expect(
      c, sout, [&](std::int64_t i) { return want[i]; }, "all_to_all with splits");
}

inline void gather_scatter_cases(const Ctx& c) {
  auto& b = c.world.impl();
  const int root = c.size - 1;
  std::vector<std::int64_t> counts(c.size);
  for (int i = 0; i < c.size; ++i) {
    counts[i] = i % 3; // 0, 1, 2, 0, ...
  }
  const auto displs = displs_of(counts);
  const std::int64_t total = displs.back() + counts.back();
  auto in = make<half>(c, counts[c.rank], [&](std::int64_t i) { return double(displs[c.rank] + i); });
  auto out = make<half>(c, total, [](std::int64_t) { return -1.0; });
  b.gather(buf(in), split_buffer(buf(out), counts, displs), root, {})->wait();
  if (c.rank == root) {
    expect(
        c, out, [](std::int64_t i) { return double(i); }, "gather");
  }
  auto all = make<half>(c, total, [&](std::int64_t i) { return c.rank == root ? double(2 * i) : -5.0; });
  auto mine = make<half>(c, counts[c.rank], [](std::int64_t) { return -1.0; });
  b.scatter(split_buffer(buf(all), counts, displs), buf(mine), root, {})->wait();
  expect(
      c, mine, [&](std::int64_t i) { return double(2 * (displs[c.rank] + i)); }, "scatter");
  barrier(c.world);
}

inline void p2p_cases(const Ctx& c) {
  const int n = c.size;
  if (n == 1) {
    return; // no peer
  }
  const int next = (c.rank + 1) % n;
  const int prev = (c.rank + n - 1) % n;
  // A ring in one batch: both directions posted before either waits.
  auto out = make<double>(c, 4, [&](std::int64_t i) { return double(c.rank * 10 + i); });
  auto in = make<double>(c, 4, [](std::int64_t) { return -1.0; });
  std::vector<P2POp> ops;
  ops.emplace_back(P2POp::irecv, in, prev, c.world);
  ops.emplace_back(P2POp::isend, out, next, c.world);
  for (auto& w : batch_isend_irecv(ops)) {
    w.wait();
  }
  expect(
      c, in, [&](std::int64_t i) { return double(prev * 10 + i); }, "ring batch_isend_irecv");
  // Blocking pairs (0<->1, 2<->3, ...): the lower rank sends first, twice, in order.
  const int peer = c.rank ^ 1;
  if (peer < n) {
    for (int round = 0; round < 2; ++round) {
      auto s =
          make<std::int32_t>(c, 3, [&](std::int64_t i) { return double(c.rank * 100 + round * 10 + i); });
      auto r = make<std::int32_t>(c, 3, [](std::int64_t) { return -1.0; });
      if (c.rank < peer) {
        send(s, peer, c.world);
        recv(r, peer, c.world);
      } else {
        recv(r, peer, c.world);
        send(s, peer, c.world);
      }
      expect(
          c, r, [&](std::int64_t i) { return double(peer * 100 + round * 10 + i); },
          "send/recv round " + std::to_string(round));
    }
  }
}

inline void group_cases(const Ctx& c) {
  // split: even and odd ranks, ordered by descending rank (key).
  auto half_group = c.world.split(c.rank % 2, -c.rank);
  check(half_group.is_member(), c, "split: not a member");
  const int members = (c.size + 1 - c.rank % 2) / 2;
  check(half_group.size() == members, c, "split: size " + std::to_string(half_group.size()));
  auto t = make<std::int32_t>(c, 2, [&](std::int64_t) { return double(c.rank); });
  all_reduce(t, ReduceOp::sum, half_group);
  double sum = 0;
  for (int r = c.rank % 2; r < c.size; r += 2) {
    sum += r;
  }
  expect(
      c, t, [&](std::int64_t) { return sum; }, "all_reduce on split group");
  check(half_group.ranks().front() == (c.size - 1 - ((c.size - 1) % 2 != c.rank % 2 ? 1 : 0)), c,
        "split: members are not ordered by key");

  // new_group of the first and the last rank; the others get a non-member handle.
  std::vector<int> ends = {0, c.size - 1};
  if (c.size == 1) {
    ends = {0};
  }
  auto g = c.world.new_group(ends);
  const bool member = c.rank == 0 || c.rank == c.size - 1;
  check(g.is_member() == member, c, "new_group membership");
  if (member) {
    auto x = make<float>(c, 3, [&](std::int64_t i) { return double(c.rank + i); });
    all_reduce(x, ReduceOp::max, g);
    expect(
        c, x, [&](std::int64_t i) { return double(c.size - 1 + i); }, "all_reduce on new_group");
  }
  barrier(c.world);
}

inline void async_cases(const Ctx& c) {
  auto a = make<float>(c, 1000, [&](std::int64_t i) { return double(i % 7 + c.rank); });
  auto b = make<float>(c, 10, [&](std::int64_t) { return double(c.rank); });
  Work wa = all_reduce(a, ReduceOp::sum, c.world, async_op);
  Work wb = all_reduce(b, ReduceOp::max, c.world, async_op);
  wb.wait();
  wa.wait();
  expect(
      c, a, [&](std::int64_t i) { return double((i % 7) * c.size) + c.size * (c.size - 1) / 2.0; },
      "async all_reduce sum");
  expect(
      c, b, [&](std::int64_t) { return double(c.size - 1); }, "async all_reduce max");
}

} // namespace suite

#include "dtensor_cases.hpp"

namespace suite {

/// Runs every case; prints "PASS name" / "FAIL name: why" (rank 0 prints passes, every rank its
/// failures). Returns the number of failed cases.
inline int run_suite(const Ctx& c) {
  struct Case {
    const char* name;
    std::function<void(const Ctx&)> fn;
  };
  const std::vector<Case> cases = {
      {"all_reduce float32", all_reduce_ops<float>},
      {"all_reduce float64", all_reduce_ops<double>},
      {"all_reduce bfloat16", all_reduce_ops<bfloat16>},
      {"all_reduce float16", all_reduce_ops<half>},
      {"all_reduce int32", all_reduce_ops<std::int32_t>},
      {"all_reduce int64", all_reduce_ops<std::int64_t>},
      {"all_reduce uint8", all_reduce_ops<std::uint8_t>},
      {"reduce + broadcast (every root)", reduce_and_broadcast},
      {"all_gather_into_tensor + reduce_scatter_tensor", gather_scatter_tensor},
      {"uneven all_gather + reduce_scatter", uneven_gather_scatter},
      {"all_to_all (equal, split sizes)", all_to_all_cases},
      {"gather + scatter + barrier", gather_scatter_cases},
      {"send/recv + batch_isend_irecv", p2p_cases},
      {"split + new_group", group_cases},
      {"async ops", async_cases},
      {"DTensor redistributions", dtensor_cases},
  };
  int failures = 0;
  for (const auto& k : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      k.fn(c);
      if (c.rank == 0) {
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        std::printf("PASS %-48s %8.1f ms\n", k.name, ms);
      }
    } catch (const std::exception& e) {
      ++failures;
      std::printf("FAIL %s: %s\n", k.name, e.what());
      std::fflush(stdout);
      throw; // a failed collective leaves the group unusable: stop here (the launcher stops the others)
    }
    std::fflush(stdout);
  }
  return failures;
}

} // namespace suite
