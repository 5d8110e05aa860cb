// 02: the collectives of torch.distributed, in place, async and functional.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_02_collectives
//
// Each result is compared with the same computation done in one process.

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/functional.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/comm/p2p.hpp>
#include <dtensor/core/tensor_io.hpp>

#include <cstdio>
#include <string>
#include <vector>

using namespace dtensor;

int main() {
  ProcessGroup world = init_process_group();
  const int r = world.rank();
  const int n = world.size();
  int failures = 0;
  auto check = [&](bool ok, const char* what) {
    if (!ok) {
      std::fprintf(stderr, "rank %d: %s is wrong\n", r, what);
      ++failures;
    } else if (r == 0) {
      std::printf("%-34s ok\n", what);
    }
  };

  // all_reduce, in place: every rank contributes r + i; the sum is n(n-1)/2 + n i.
  auto t = Tensor<float, 1>::from_values({4}, {0.0f + r, 1.0f + r, 2.0f + r, 3.0f + r});
  all_reduce(t, ReduceOp::sum, world);
  check(t(3) == n * (n - 1) / 2.0f + 3.0f * n, "all_reduce(sum)");

  // all_gather_into_tensor: [n*2] from [2] per rank.
  auto mine = Tensor<int, 1>::from_values({2}, {2 * r, 2 * r + 1});
  auto gathered = Tensor<int, 1>::full({2 * n}, -1);
  all_gather_into_tensor(gathered, mine, world);
  bool ok = true;
  for (int i = 0; i < 2 * n; ++i) {
    ok = ok && gathered(i) == i;
  }
  check(ok, "all_gather_into_tensor");

  // reduce_scatter_tensor, asynchronously: rank q gets the sum of block q of every rank's input.
  auto input = Tensor<double, 1>::full({3 * static_cast<std::int64_t>(n)}, 1.0 + r);
  auto output = Tensor<double, 1>::full({3}, -1.0);
  Work w = reduce_scatter_tensor(output, input, ReduceOp::sum, world, async_op);
  w.wait();
  check(output(0) == n * (n + 1) / 2.0, "reduce_scatter_tensor (async)");

  // all_to_all_single with uneven splits: rank r sends q + 1 elements (value 100 r + q) to rank q.
  std::vector<std::int64_t> in_splits(n);
  std::vector<std::int64_t> out_splits(n, r + 1);
  std::int64_t in_total = 0;
  for (int q = 0; q < n; ++q) {
    in_splits[q] = q + 1;
    in_total += q + 1;
  }
  Tensor<int, 1> send({in_total});
  for (int q = 0, at = 0; q < n; ++q) {
    for (int k = 0; k <= q; ++k) {
      send(at++) = 100 * r + q;
    }
  }
  auto recv = Tensor<int, 1>::full({static_cast<std::int64_t>(n) * (r + 1)}, -1);
  all_to_all_single(recv, send, out_splits, in_splits, world);
  ok = true;
  for (int q = 0; q < n; ++q) {
    for (int k = 0; k <= r; ++k) {
      ok = ok && recv(q * (r + 1) + k) == 100 * q + r;
    }
  }
  check(ok, "all_to_all_single (uneven splits)");

  // broadcast from the last rank, functional form (the input is left untouched).
  auto b = functional::broadcast(Tensor<float, 1>::full({2}, static_cast<float>(r)), n - 1, world);
  check(b(0) == n - 1.0f, "functional::broadcast");

  // A ring of send/recv in both directions at once, without deadlock.
  auto right = Tensor<int, 1>::full({1}, -1);
  auto left = Tensor<int, 1>::full({1}, -1);
  auto me = Tensor<int, 1>::full({1}, r);
  std::vector<P2POp> ops{{P2POp::isend, me, (r + 1) % n, world},
                         {P2POp::isend, me, (r + n - 1) % n, world},
                         {P2POp::irecv, left, (r + n - 1) % n, world},
                         {P2POp::irecv, right, (r + 1) % n, world}};
  for (Work& op : batch_isend_irecv(ops)) {
    op.wait();
  }
  check(left(0) == (r + n - 1) % n && right(0) == (r + 1) % n, "batch_isend_irecv ring");

  barrier(world);
  auto total = Tensor<int, 1>::full({1}, failures);
  all_reduce(total, ReduceOp::sum, world);
  if (r == 0) {
    std::printf("%s\n", total(0) == 0 ? "all collectives match the reference" : "MISMATCH");
  }
  return total(0) == 0 ? 0 : 1;
}
