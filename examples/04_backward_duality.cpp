// 04: backward by duality. A two-layer Megatron MLP block, y = relu(x W1) W2, on a tensor-parallel group,
// trained for one step by hand: the forward's collectives come from dtensor::autograd, each returning the
// context of its backward, so the backward pass calls the dual collective without an autograd engine.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_04_backward_duality
//
//   tensor parallel     x replicated -> copy_to -> x W1[:, mine] -> relu -> h W2[mine, :] -> reduce_from
//                       forward: one all_reduce (reduce_from); backward: one all_reduce (copy_to's)
//   sequence parallel   x sharded on the sequence dim -> gather_from_sequence -> ... ->
//                       reduce_scatter_to_sequence
//                       forward: all_gather + reduce_scatter; backward: reduce_scatter + all_gather
//
// The loss is 0.5 * sum(y^2), so dL/dy = y. The output, dx, and each rank's shard of dW1 and dW2 are checked
// against the same forward and backward computed in one process. Data are small integers, so every product
// and sum is an integer far below 2^24 and float arithmetic is exact in any order: results must be equal,
// not close. The ffn size (6 over 4 ranks: 2, 2, 2, 0) and the sequence (5 over 4: 2, 2, 1, 0) give uneven
// and empty shards.

#include <dtensor/backward/collectives.hpp>
#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/core/tensor.hpp>
#include <dtensor/layout/algebra.hpp>

#include <cstdio>
#include <string>

using namespace dtensor;
namespace ag = dtensor::autograd;
using Matrix = Tensor<float, 2>;

namespace {

constexpr std::int64_t kHidden = 4, kFfn = 6, kBatch = 3, kSequence = 5;

/// Small integers in [-2, 2], the same on every rank for the same seed.
Matrix integers(std::int64_t rows, std::int64_t cols, int seed) {
  Matrix m({rows, cols});
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      m(i, j) = static_cast<float>((seed * 7 + i * 5 + j * 3 + i * j) % 5 - 2);
    }
  }
  return m;
}

/// a b, or a^T b / a b^T with the flags.
Matrix matmul(const Matrix& a, const Matrix& b, bool ta = false, bool tb = false) {
  const std::int64_t m = ta ? a.shape(1) : a.shape(0), k = ta ? a.shape(0) : a.shape(1);
  const std::int64_t n = tb ? b.shape(0) : b.shape(1);
  auto out = Matrix::zeros({m, n});
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      float s = 0;
      for (std::int64_t l = 0; l < k; ++l) {
        s += (ta ? a(l, i) : a(i, l)) * (tb ? b(j, l) : b(l, j));
      }
      out(i, j) = s;
    }
  }
  return out;
}

Matrix relu(const Matrix& a) {
  Matrix out = a.clone();
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    out.data()[i] = out.data()[i] > 0 ? out.data()[i] : 0.0f;
  }
  return out;
}

/// d relu(pre) given d out: passes where pre > 0.
Matrix relu_backward(const Matrix& pre, const Matrix& grad) {
  Matrix out = grad.clone();
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    if (!(pre.data()[i] > 0)) {
      out.data()[i] = 0.0f;
    }
  }
  return out;
}

/// Rank r's torch.chunk piece of m along dim.
Matrix piece(const Matrix& m, int dim, int ranks, int r) {
  const std::int64_t n = m.shape(dim);
  return m.narrow(dim, chunk_offset(n, ranks, r), chunk_size(n, ranks, r)).clone();
}

bool equal(const Matrix& a, const Matrix& b) {
  if (a.shape() != b.shape()) {
    return false;
  }
  const Matrix x = a.contiguous(), y = b.contiguous();
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    if (x.data()[i] != y.data()[i]) {
      return false;
    }
  }
  return true;
}

/// The block's forward and backward in one process, on the full weights.
struct Reference {
  Matrix y, dx, dw1, dw2;
};
Reference reference(const Matrix& x, const Matrix& w1, const Matrix& w2) {
  const Matrix pre = matmul(x, w1);
  const Matrix h = relu(pre);
  const Matrix y = matmul(h, w2);
  const Matrix& gy = y; // d(0.5 sum y^2)/dy
  const Matrix dpre = relu_backward(pre, matmul(gy, w2, false, true));
  return {y, matmul(dpre, w1, false, true), matmul(x, dpre, true), matmul(h, gy, true)};
}

/// The local part of the block on this rank's shards, between the entry and exit regions:
/// z = relu(xin W1_r) W2_r (a partial sum over ranks), and its backward from dz.
struct Local {
  Matrix pre, h;
  Matrix forward(const Matrix& xin, const Matrix& w1, const Matrix& w2) {
    pre = matmul(xin, w1);
    h = relu(pre);
    return matmul(h, w2);
  }
  /// Returns d xin (partial over ranks); sets dw1, dw2 (this rank's shards).
  Matrix backward(const Matrix& xin, const Matrix& w1, const Matrix& w2, const Matrix& dz, Matrix& dw1,
                  Matrix& dw2) const {
    dw2 = matmul(h, dz, true);
    const Matrix dpre = relu_backward(pre, matmul(dz, w2, false, true));
    dw1 = matmul(xin, dpre, true);
    return matmul(dpre, w1, false, true);
  }
};

} // namespace

int main() {
  ProcessGroup tp = init_process_group();
  const int r = tp.rank(), n = tp.size();
  int failures = 0;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) {
      std::fprintf(stderr, "rank %d: %s is wrong\n", r, what.c_str());
      ++failures;
    } else if (r == 0) {
      std::printf("%-58s ok\n", what.c_str());
    }
  };
  auto expect_comm = [&](const CommDebugMode& mode, std::int64_t all_reduces, std::int64_t all_gathers,
                         std::int64_t reduce_scatters, const std::string& what) {
    if (r == 0) {
      std::printf("%s:\n%s", what.c_str(), mode.to_string().c_str());
    }
    check(mode.count("all_reduce") == all_reduces && mode.count("all_gather") == all_gathers &&
              mode.count("reduce_scatter") == reduce_scatters &&
              mode.total_count() == all_reduces + all_gathers + reduce_scatters,
          what + " communication");
  };

  const Matrix w1 = integers(kHidden, kFfn, 1), w2 = integers(kFfn, kHidden, 2);
  const Matrix w1_r = piece(w1, 1, n, r); // column parallel: output features
  const Matrix w2_r = piece(w2, 0, n, r); // row parallel: input features

  { // tensor parallel: x replicated
    const Matrix x = integers(kBatch, kHidden, 3);
    const Reference ref = reference(x, w1, w2);
    Local mlp;
    Matrix dw1, dw2, dx;

    CommDebugMode forward;
    auto [xin, copy_back] = ag::copy_to(x, tp);
    auto [y, reduce_back] = ag::reduce_from(mlp.forward(xin, w1_r, w2_r), tp);
    expect_comm(forward, 1, 0, 0, "tensor parallel forward");

    CommDebugMode backward;
    const Matrix& gy = y;
    const Matrix dz = reduce_back(gy);
    dx = copy_back(mlp.backward(xin, w1_r, w2_r, dz, dw1, dw2));
    expect_comm(backward, 1, 0, 0, "tensor parallel backward");

    check(equal(y, ref.y), "tensor parallel y");
    check(equal(dx, ref.dx), "tensor parallel dx");
    check(equal(dw1, piece(ref.dw1, 1, n, r)), "tensor parallel dW1 shard");
    check(equal(dw2, piece(ref.dw2, 0, n, r)), "tensor parallel dW2 shard");
  }

  { // sequence parallel: x sharded on the sequence dim (0), so is y
    const Matrix x = integers(kSequence, kHidden, 4);
    const Reference ref = reference(x, w1, w2);
    const Matrix x_r = piece(x, 0, n, r);
    Local mlp;
    Matrix dw1, dw2;

    CommDebugMode forward;
    auto [xin, gather_back] = ag::gather_from_sequence(x_r, kSequence, tp);
    auto [y_r, scatter_back] = ag::reduce_scatter_to_sequence(mlp.forward(xin, w1_r, w2_r), tp);
    expect_comm(forward, 0, 1, 1, "sequence parallel forward");

    CommDebugMode backward;
    const Matrix& gy_r = y_r;
    const Matrix dz = scatter_back(gy_r);
    const Matrix dx_r = gather_back(mlp.backward(xin, w1_r, w2_r, dz, dw1, dw2));
    expect_comm(backward, 0, 1, 1, "sequence parallel backward");

    check(equal(y_r, piece(ref.y, 0, n, r)), "sequence parallel y shard");
    check(equal(dx_r, piece(ref.dx, 0, n, r)), "sequence parallel dx shard");
    check(equal(dw1, piece(ref.dw1, 1, n, r)), "sequence parallel dW1 shard");
    check(equal(dw2, piece(ref.dw2, 0, n, r)), "sequence parallel dW2 shard");
  }

  auto total = Tensor<int, 1>::full({1}, failures);
  all_reduce(total, ReduceOp::sum, tp);
  if (r == 0) {
    std::printf("%s\n",
                total(0) == 0 ? "forward and backward match the single-process computation" : "MISMATCH");
  }
  return total(0) == 0 ? 0 : 1;
}
