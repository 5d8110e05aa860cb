// bench_train: the training step of the library (nn::LanguageModel of nn::MlpBlock trained by nn::DdpTrainer
// or nn::FsdpTrainer, the model of examples/06_train.cpp) per layout, timed, with every operator new counted
// (bench/common/alloc_counter.hpp), so it also reports the heap per rank: live before training, the peak over
// the steps after the first (AdamW's state exists by then), live after. bench/train/train_vs_torch.sh runs it
// with --no-check --json FILE for each layout next to bench/train/torch_train.py; BENCHMARKS.md ("Training
// step") has the numbers.
//
//   dtensor-run --nproc-per-node 4 ./bench_train --layout tp|ddp|fsdp|hsdp|fsdp_tp [--steps N]
//       [--tokens T --hidden H --ffn F --vocab V] [--checkpoint] [--no-check] [--json FILE]
//
// The step's T tokens are 8 sequences of T / 8 (the batch over the batch axes, the sequence over tp), float.
// Step 1 warms up; steps 2, 7, 12, ... run with overlap off (FsdpScheduleOptions::overlap and
// DDPOptions::overlap: every asynchronous collective waited for when issued) and measure the whole
// data-parallel communication ("comm"); the other steps give the step time and its exposed part (the
// training thread's time waiting on the data-parallel communication: FSDP's all_gathers and reduce_scatters,
// DDP's buckets and the reductions over the other axes). The tensor-parallel collectives run inside the
// layers and count as compute. --checkpoint (tp, ddp): every block nn::Checkpointed. With the check (default;
// --no-check skips it) the same training runs on one rank in this process and the losses of every step must
// agree within 1e-4 (relative): exit 1 otherwise.
#include "../common/alloc_counter.hpp"

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/parallel/fsdp.hpp>
#include <dtensor/parallel/layers/mlp_block.hpp>
#include <dtensor/parallel/layers/model.hpp>
#include <dtensor/parallel/layers/trainer.hpp>
#include <dtensor/parallel/optim.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <sys/resource.h>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"tp">>;
using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using Model = nn::LanguageModel<float, L, nn::MlpBlock>;
template <class T, class Layout>
using CheckpointedBlock = nn::Checkpointed<nn::MlpBlock<T, Layout>>;
constexpr int kBlocks = 3;
constexpr std::int64_t kBatch = 8;

struct Options {
  std::string layout = "fsdp_tp", json;
  int steps = 12;
  std::int64_t tokens = 512;
  nn::TransformerConfig model{.vocab = 2048, .hidden = 256, .ffn = 1024, .norm_eps = 1e-6, .init_std = 0.02};
  bool check = true, checkpoint = false;
};

nn::ids_t<L> tokens(const DeviceMesh<Mesh>& mesh, const Options& o, int step, bool targets) {
  const std::int64_t seq = o.tokens / kBatch;
  return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
    return from_global_index<std::int64_t, Q...>(mesh, {kBatch, seq}, [&](const auto& i) {
      const std::uint64_t z =
          (std::uint64_t(step) * 1000003u + std::uint64_t(i[0] * seq + i[1]) * 7919u) * 2654435761u;
      const std::int64_t id = std::int64_t((z >> 16) % std::uint64_t(o.model.vocab));
      return targets ? (3 * id + 1) % o.model.vocab : id;
    });
  }(static_cast<nn::ids_t<L>*>(nullptr));
}

double minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_minflt);
}

/// What a run measured (rank 0's means over the steps of each kind, in seconds).
struct Measured {
  std::vector<double> losses;
  double step = 0, exposed = 0, serial_step = 0, comm = 0, faults = 0;
  std::int64_t heap_start = 0, heap_peak = 0, heap_end = 0, state_bytes = 0;
};

template <class Trainer>
Measured run(Trainer& trainer, const Options& o, std::int64_t param_elements) {
  optim::AdamW opt({.lr = 1e-2, .weight_decay = 0.01});
  Measured m;
  m.heap_start = bench::alloc::live();
  m.state_bytes = param_elements * std::int64_t(sizeof(float)) * 4; // parameter, gradient, 2 moments
  int overlapped = 0, serial = 0;
  for (int s = 0; s < o.steps; ++s) {
    const bool serial_step = s % 5 == 1; // 2, 7, 12, ... (1-based): overlap off
    trainer.options().ddp.overlap = trainer.options().schedule.overlap = !serial_step;
    const auto ids = tokens(trainer.mesh(), o, s, false), targets = tokens(trainer.mesh(), o, s, true);
    if (s == 1) {
      bench::alloc::reset_peak();
    }
    const double f0 = minor_faults();
    const auto t0 = std::chrono::steady_clock::now();
    const nn::StepResult r = trainer.step(ids, targets, opt);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    m.losses.push_back(r.loss);
    if (s == 0) {
      continue; // warm-up
    }
    if (serial_step) {
      m.serial_step += took, m.comm += r.blocked_seconds, ++serial;
    } else {
      m.step += took, m.exposed += r.blocked_seconds, m.faults += minor_faults() - f0, ++overlapped;
    }
  }
  m.heap_peak = o.steps > 1 ? bench::alloc::peak() : 0;
  m.heap_end = bench::alloc::live();
  const double a = std::max(1, overlapped), b = std::max(1, serial);
  m.step /= a, m.exposed /= a, m.faults /= a, m.serial_step /= b, m.comm /= b;
  return m;
}

Measured train_layout(const DeviceMesh<Mesh>& mesh, const std::string& layout, const Options& o) {
  init::InitKeys keys(2024);
  // 4 KiB buckets as torch_train.py's DDP (bucket_cap_mb), a clip that binds early.
  const nn::TrainerOptions options{.max_norm = 0.5,
                                   .ddp = {.bucket_cap_bytes = 4096, .first_bucket_cap_bytes = 2048}};
  auto sharded = [&](auto& t) {
    std::int64_t n = 0;
    std::apply(
        [&](auto& e, auto& blocks, auto& h) {
          n += e.local_param().numel() + h.local_param().numel();
          for (auto& g : blocks) {
            n += g.local_param().numel();
          }
        },
        t.state());
    return run(t, o, n);
  };
  if (layout == "fsdp" || layout == "fsdp_tp") {
    nn::FsdpTrainer<Model, Fsdp<"dp">> t(mesh, Model(mesh, o.model, kBlocks, keys), options);
    return sharded(t);
  } else if (layout == "hsdp") {
    nn::FsdpTrainer<Model, Hsdp<"rep", "dp">> t(mesh, Model(mesh, o.model, kBlocks, keys), options);
    return sharded(t);
  }
  auto replicated = [&](auto& t) {
    std::int64_t n = 0;
    nn::for_each_tensor(std::get<0>(t.state()), [&](const auto& w) { n += w.local().numel(); });
    return run(t, o, n);
  };
  if (o.checkpoint) { // every block keeps its input only and runs again in the backward
    using Ckpt = nn::LanguageModel<float, L, CheckpointedBlock>;
    nn::DdpTrainer<Ckpt, "dp"> t(mesh, Ckpt(mesh, o.model, kBlocks, keys), options);
    return replicated(t);
  }
  nn::DdpTrainer<Model, "dp"> t(mesh, Model(mesh, o.model, kBlocks, keys), options);
  return replicated(t);
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(
      stderr,
      "bench_train: %s\nusage: bench_train [--layout tp|ddp|fsdp|hsdp|fsdp_tp] [--steps N] [--tokens T] "
      "[--hidden H] [--ffn F] [--vocab V] [--no-check] [--json FILE]\n",
      why.c_str());
  std::exit(2);
}

} // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-check") {
      o.check = false;
      continue;
    }
    if (a == "--checkpoint") {
      o.checkpoint = true;
      continue;
    }
    if (i + 1 >= argc) {
      usage(a + " needs a value");
    }
    const std::string v = argv[++i];
    if (a == "--layout") {
      o.layout = v;
    } else if (a == "--json") {
      o.json = v;
    } else if (a == "--steps") {
      o.steps = std::atoi(v.c_str());
    } else if (a == "--tokens" || a == "--hidden" || a == "--ffn" || a == "--vocab") {
      std::int64_t& x = a == "--tokens"   ? o.tokens
                        : a == "--hidden" ? o.model.hidden
                        : a == "--ffn"    ? o.model.ffn
                                          : o.model.vocab;
      x = std::atoll(v.c_str());
    } else {
      usage("unknown flag " + a);
    }
  }
  if (o.tokens % kBatch != 0 || o.tokens <= 0 || o.steps < 1) {
    usage("--tokens must be a positive multiple of 8 (8 sequences a step) and --steps at least 1");
  }
  ProcessGroup world = init_process_group();
  const int n = world.size();
  int rep = o.layout == "hsdp" ? 2 : 1, tp = o.layout == "tp" ? n : o.layout == "fsdp_tp" ? 2 : 1;
  const int dp = n / (rep * tp);
  if ((o.layout != "tp" && o.layout != "ddp" && o.layout != "fsdp" && o.layout != "hsdp" &&
       o.layout != "fsdp_tp") ||
      rep * dp * tp != n) {
    usage("layout " + o.layout + " on " + std::to_string(n) + " ranks");
  }
  const bool print = world.rank() == 0;
  const Measured got = train_layout(init_device_mesh<Mesh>(world, rep, dp, tp), o.layout, o);
  // The heap: the largest over the ranks.
  Tensor<double, 1> heap({3});
  heap(0) = double(got.heap_start), heap(1) = double(got.heap_peak), heap(2) = double(got.heap_end);
  all_reduce(heap, ReduceOp::max, world);
  bool ok = true;
  double loss_diff = 0;
  if (o.check) {
    const ProcessGroup one = world.new_group({world.rank()});
    const Measured want = train_layout(init_device_mesh<Mesh>(one, 1, 1, 1), "ddp", o);
    for (int s = 0; s < o.steps; ++s) {
      loss_diff = std::max(loss_diff, std::abs(got.losses[s] - want.losses[s]) / std::abs(want.losses[s]));
    }
    ok = loss_diff <= 1e-4;
  }
  if (print) {
    const double ms = 1e3;
    std::printf("%s on (rep=%d, dp=%d, tp=%d): time per step on rank 0: %.2f ms = compute %.2f ms + exposed "
                "data-parallel communication %.2f ms; that communication %.2f ms (in the steps with overlap "
                "off, %.2f ms a step)\n",
                o.layout.c_str(), rep, dp, tp, got.step * ms, (got.step - got.exposed) * ms, got.exposed * ms,
                got.comm * ms, got.serial_step * ms);
    std::printf("minor page faults per step on rank 0: %.0f\n", got.faults);
    std::printf(
        "heap per rank (largest over ranks): %.3f MB before training, peak %.3f MB in the steps, %.3f MB "
        "after; parameters, gradients and AdamW state %.3f MB\n",
        heap(0) / 1e6, heap(1) / 1e6, heap(2) / 1e6, double(got.state_bytes) / 1e6);
    if (o.check) {
      std::printf("against one rank: max relative difference of the losses %.1e (tolerance 1e-4): %s\n",
                  loss_diff, ok ? "OK" : "MISMATCH");
    }
    if (!o.json.empty()) {
      std::FILE* f = std::fopen(o.json.c_str(), "w");
      if (f == nullptr) {
        std::fprintf(stderr, "bench_train: cannot write %s\n", o.json.c_str());
        return 1;
      }
      std::fprintf(
          f,
          "{\"suite\": \"train\", \"layout\": \"%s\", \"dtype\": \"float32\", \"device\": \"cpu\", "
          "\"ranks\": %d, \"mesh\": [%d, %d, %d], \"blocks\": %d, \"tokens\": %lld, \"hidden\": %lld, "
          "\"ffn\": %lld, \"vocab\": %lld, \"steps\": %d, \"step_ms\": %.4f, \"compute_ms\": %.4f, "
          "\"exposed_ms\": %.4f, \"comm_ms\": %.4f, \"serial_step_ms\": %.4f, "
          "\"minor_faults_per_step\": %.1f, \"heap_start_bytes\": %.0f, \"heap_peak_bytes\": %.0f, "
          "\"heap_end_bytes\": %.0f, \"state_bytes\": %lld, \"losses\": [",
          o.layout.c_str(), n, rep, dp, tp, kBlocks, (long long)o.tokens, (long long)o.model.hidden,
          (long long)o.model.ffn, (long long)o.model.vocab, o.steps, got.step * ms,
          (got.step - got.exposed) * ms, got.exposed * ms, got.comm * ms, got.serial_step * ms, got.faults,
          heap(0), heap(1), heap(2), (long long)got.state_bytes);
      for (int s = 0; s < o.steps; ++s) {
        std::fprintf(f, "%s%.8g", s ? ", " : "", got.losses[s]);
      }
      std::fprintf(f, "], \"check\": \"%s\"}\n", !ok ? "FAILED" : o.check ? "one-rank reference" : "none");
      std::fclose(f);
    }
  }
  return ok ? 0 : 1;
}
