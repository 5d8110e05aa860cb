// 12: replicas that drop out and rejoin without stopping the others (train/replicas.hpp). Each replica of
// a small regression network trains on its part of every step's batch and the replicas reduce their
// gradients over the step's quorum; kill a rank and its replica drops out at once, the others redo the
// step without it and go on, and dtensor-run starts the replica again, which copies the state from a
// survivor and rejoins.
//
//   dtensor-run --nproc-per-node 4 --replica-size 1 --max-restarts 2 ./example_12_replicas   # DDP
//   dtensor-run --nproc-per-node 4 --replica-size 2 --max-restarts 2 ./example_12_replicas   # 2 x 2
//   ./example_12_replicas --reference                  # one process, the whole batch: the same result
//
//   --steps N       steps (default 60)
//   --pace-ms M     make each step last at least M ms (the network is small: room for a restart to rejoin)
//   --out FILE      write the final parameters (raw float64), and the steps, rounds and aborted steps of
//                   this replica to FILE.txt (with --replica-size: FILE.replica<R>)
//   --reference     train in this process alone on the whole batch of every step
//
// The data of a step is a function of the step, and the batch of 48 rows is split among the quorum's
// replicas (and a replica's rows among its ranks) by row index: a gradient summed over the rows and divided
// by 48 is the same for any number of replicas, so the result matches --reference to rounding whatever
// drops out and rejoins, with no sample lost or counted twice.
#include <dtensor/comm/collectives.hpp>
#include <dtensor/core/tensor.hpp>
#include <dtensor/train/replicas.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

using namespace dtensor;

namespace {

constexpr std::int64_t kBatch = 48, kIn = 8, kHidden = 32, kOut = 2;
// The parameters in one flat vector: W1 (hidden x in), b1, W2 (out x hidden), b2.
constexpr std::int64_t kW1 = 0, kB1 = kW1 + kHidden * kIn, kW2 = kB1 + kHidden, kB2 = kW2 + kOut * kHidden,
                       kParams = kB2 + kOut;

double input(std::int64_t step, std::int64_t row, std::int64_t k) {
  const std::uint64_t z =
      (std::uint64_t(step) * 1000003u + std::uint64_t(row) * 131u + std::uint64_t(k)) * 0x9E3779B97F4A7C15u;
  return double(z >> 11) / double(1ull << 53) * 2.0 - 1.0;
}

double target(std::int64_t step, std::int64_t row, std::int64_t o) {
  const double a = input(step, row, 0), b = input(step, row, 1), c = input(step, row, 2);
  return o == 0 ? std::sin(a + b) * c : a * b - c * c / 2;
}

/// Adds the gradient of 1/2 mean squared error over rows [lo, hi) of step `step`'s batch (divided by the
/// whole batch) to g[0, kParams), and the rows' loss to g[kParams].
void accumulate(const double* w, std::int64_t step, std::int64_t lo, std::int64_t hi, double* g) {
  for (std::int64_t r = lo; r < hi; ++r) {
    double x[kIn], h[kHidden], y[kOut];
    for (std::int64_t k = 0; k < kIn; ++k) {
      x[k] = input(step, r, k);
    }
    for (std::int64_t j = 0; j < kHidden; ++j) {
      double z = w[kB1 + j];
      for (std::int64_t k = 0; k < kIn; ++k) {
        z += w[kW1 + j * kIn + k] * x[k];
      }
      h[j] = std::tanh(z);
    }
    for (std::int64_t o = 0; o < kOut; ++o) {
      y[o] = w[kB2 + o];
      for (std::int64_t j = 0; j < kHidden; ++j) {
        y[o] += w[kW2 + o * kHidden + j] * h[j];
      }
      const double d = y[o] - target(step, r, o);
      g[kParams] += 0.5 * d * d / kBatch;
      y[o] = d / kBatch; // dL/dy
    }
    for (std::int64_t j = 0; j < kHidden; ++j) {
      double dh = 0;
      for (std::int64_t o = 0; o < kOut; ++o) {
        g[kW2 + o * kHidden + j] += y[o] * h[j];
        dh += w[kW2 + o * kHidden + j] * y[o];
      }
      const double dz = dh * (1 - h[j] * h[j]);
      g[kB1 + j] += dz;
      for (std::int64_t k = 0; k < kIn; ++k) {
        g[kW1 + j * kIn + k] += dz * x[k];
      }
    }
    for (std::int64_t o = 0; o < kOut; ++o) {
      g[kB2 + o] += y[o];
    }
  }
}

/// SGD with momentum 0.9, learning rate 0.1.
void apply(double* w, double* v, const double* g) {
  for (std::int64_t i = 0; i < kParams; ++i) {
    v[i] = 0.9 * v[i] + g[i];
    w[i] -= 0.1 * v[i];
  }
}

Tensor<double, 1> initial_parameters() {
  auto w = Tensor<double, 1>::zeros({kParams});
  for (std::int64_t i = 0; i < kB1; ++i) { // uniform, scaled by the fan-in; the biases zero
    w.data()[i] = input(-1, i, 0) / std::sqrt(double(kIn));
  }
  for (std::int64_t i = kW2; i < kB2; ++i) {
    w.data()[i] = input(-1, i, 0) / std::sqrt(double(kHidden));
  }
  return w;
}

void write(const std::string& file, const Tensor<double, 1>& w, const std::string& summary) {
  std::ofstream(file, std::ios::binary)
      .write(reinterpret_cast<const char*>(w.data()), static_cast<std::streamsize>(kParams * sizeof(double)));
  std::ofstream(file + ".txt") << summary << "\n";
}

} // namespace

int main(int argc, char** argv) {
  int steps = 60, pace_ms = 0;
  std::string out;
  bool reference = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (a == "--pace-ms" && i + 1 < argc) {
      pace_ms = std::atoi(argv[++i]);
    } else if (a == "--out" && i + 1 < argc) {
      out = argv[++i];
    } else if (a == "--reference") {
      reference = true;
    } else {
      std::fprintf(stderr, "usage: 12_replicas [--steps N] [--pace-ms M] [--out FILE] [--reference]\n");
      return 2;
    }
  }
  auto w = initial_parameters();
  auto v = Tensor<double, 1>::zeros({kParams});
  auto g = Tensor<double, 1>::zeros({kParams + 1}); // the gradient, then the loss

  if (reference) {
    for (int s = 0; s < steps; ++s) {
      g.fill(0.0);
      accumulate(w.data(), s, 0, kBatch, g.data());
      apply(w.data(), v.data(), g.data());
      if (s % 10 == 0 || s + 1 == steps) {
        std::printf("step %d/%d  loss %.6f\n", s + 1, steps, g.data()[kParams]);
      }
    }
    if (!out.empty()) {
      write(out, w, "steps " + std::to_string(steps));
    }
    return 0;
  }

  ReplicaManager ft;
  ft.register_state(w);
  ft.register_state(v);
  const int ranks = ft.replica_group().size(), local = ft.replica_group().rank();
  int rounds = 0, aborted = 0;
  for (;;) {
    const auto began = std::chrono::steady_clock::now();
    const Quorum q = ft.start_quorum();
    ++rounds;
    const std::int64_t s = ft.step();
    if (s >= steps) {
      break;
    }
    // This rank's rows: the replica's part of the batch, then this rank's part of the replica's.
    const std::int64_t lo = kBatch * q.replica_rank / q.replica_count,
                       hi = kBatch * (q.replica_rank + 1) / q.replica_count;
    g.fill(0.0);
    accumulate(w.data(), s, lo + (hi - lo) * local / ranks, lo + (hi - lo) * (local + 1) / ranks, g.data());
    if (ranks > 1) {
      all_reduce(g, ReduceOp::sum, ft.replica_group()); // the replica's ranks: each summed another part
    }
    ft.all_reduce(g, ReduceOp::sum); // over the quorum; a failure here makes should_commit() false
    if (pace_ms > 0) {
      std::this_thread::sleep_until(began + std::chrono::milliseconds(pace_ms));
    }
    if (!ft.should_commit()) {
      ++aborted;
      continue;
    }
    apply(w.data(), v.data(), g.data());
    if (local == 0) {
      std::printf("step %lld/%d  replicas %d  loss %.6f%s\n", static_cast<long long>(s + 1), steps,
                  q.replica_count, g.data()[kParams], q.healed ? "  (state copied from a member)" : "");
      std::fflush(stdout);
    }
  }
  ft.finish();
  if (!out.empty() && local == 0) {
    write(out + ".replica" + std::to_string(ft.replica()), w,
          "steps " + std::to_string(ft.step()) + " rounds " + std::to_string(rounds) + " aborted " +
              std::to_string(aborted) + " start " + std::to_string(ft.incarnation()));
  }
  return 0;
}
