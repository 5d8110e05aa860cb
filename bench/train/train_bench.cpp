// bench_train: the training step of the library (an nn::LanguageModel trained by nn::DdpTrainer or
// nn::FsdpTrainer) per layout, timed, with every operator new counted (dtensor/testing/heap_counter.hpp), so
// it also reports the heap per rank: live before training, the peak over the steps after the first (AdamW's
// state exists by then), live after. Two models: --model mlp (default), the model of examples/06_train.cpp
// (3 nn::MlpBlocks), and --model gpt, the GPT of examples/09_gpt.cpp (3 nn::TransformerBlocks: causal
// attention with grouped-query heads and RoPE, a SwiGLU MLP). bench/train/train_vs_torch.sh runs the mlp
// model (--model gpt: the GPT) with --no-check --json FILE for each layout next to
// bench/train/torch_train.py; BENCHMARKS.md ("Training step", "GPT training step and memory per rank") has
// the numbers. Linked with MPI where dtensor found it: under mpirun the step runs on MPI
// (init_process_group's "auto"), under dtensor-run on gloo; the printout and the JSON name the backend.
//
//   dtensor-run --nproc-per-node 4 ./bench_train --layout tp|tp_cm|ddp|fsdp|hsdp|fsdp_tp [--model mlp|gpt]
//       [--steps N] [--tokens T --hidden H --ffn F --vocab V --heads N --kv-heads N]
//       [--recompute selective|none|full | --checkpoint] [--mixed] [--prefetch N] [--max-reductions N]
//       [--save-every K [--save sync|async] [--save-dir DIR]] [--no-check] [--json FILE]
//
// The step's T tokens are 8 sequences of T / 8 (the batch over the batch axes, the sequence over tp), float.
// Step 1 warms up; steps 2, 7, 12, ... run with overlap off (FsdpScheduleOptions::overlap and
// DDPOptions::overlap: every asynchronous collective waited for when issued) and measure the whole
// data-parallel communication ("comm"); the other steps give the step time and its exposed part (the
// training thread's time waiting on the data-parallel communication: FSDP's all_gathers and reduce_scatters,
// DDP's buckets and the reductions over the other axes). The tensor-parallel collectives run inside the
// layers and count as compute there; "blocked" is the thread's time blocked in any communication
// (CommWaitTimer: tensor-parallel included), the step's exposed communication; layout tp_cm (--model mlp) is
// tp with nn::CollectiveMatmul (the all_gather into and the reduce_scatter out of each tensor-parallel region
// overlapped with its GEMMs), to compare with tp in one run.
// --recompute: what every block keeps for its backward (nn::Recompute: selective, the bound, by default;
// none, every op's inputs; full, the block's input only, its forward run again in the backward);
// --checkpoint is --recompute full (the FSDP layouts recompute a unit's forward in its backward anyway). --mixed (fsdp, fsdp_tp): parameters kept in float shards,
// gathered and computed in bfloat16, gradients reduced in float. --prefetch and --max-reductions: the FSDP
// schedule's (nn::FsdpScheduleOptions; 1 and 2 by default). With the check (default; --no-check skips
// it) the same model trains in float on one rank in this process and the losses of every step must agree
// within 1e-4 (relative; 5e-2 with --mixed, bfloat16 keeps 8 bits of mantissa): exit 1 otherwise.
// --save-every K (--model gpt): the training state saved into a CheckpointFolder (--save-dir, one state
// kept) after every K-th step, in the background (--save async, the default: the step waits for the host
// copy) or not (sync: the step waits for the disk); the save call counts in its step's time, and the wait
// for the last save after the steps is reported apart (bench/train/async_save.sh: none, sync and async).
#include "train_bench.hpp"
#include <dtensor/testing/heap_counter.hpp>

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

using namespace dtensor;

namespace {

using namespace bench::train;

const char* recompute_suffix(nn::Recompute r) {
  return r == nn::Recompute::full   ? " (checkpointed blocks: Recompute::full)"
         : r == nn::Recompute::none ? " (Recompute::none: every op keeps its inputs)"
                                    : "";
}

const char* recompute_name(nn::Recompute r) {
  return r == nn::Recompute::full ? "full" : r == nn::Recompute::none ? "none" : "selective";
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(
      stderr,
      "bench_train: %s\nusage: bench_train [--layout tp|tp_cm|ddp|fsdp|hsdp|fsdp_tp] [--model mlp|gpt] "
      "[--steps N] "
      "[--tokens T] [--hidden H] [--ffn F] [--vocab V] [--heads N] [--kv-heads N] "
      "[--recompute selective|none|full | --checkpoint] [--mixed] "
      "[--prefetch N] [--max-reductions N] [--save-every K [--save sync|async] [--save-dir DIR]] "
      "[--no-check] [--json FILE]\n",
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
      o.recompute = nn::Recompute::full;
      continue;
    }
    if (a == "--mixed") {
      o.mixed = true;
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
    } else if (a == "--prefetch") {
      o.schedule.prefetch = std::atoi(v.c_str());
    } else if (a == "--max-reductions") {
      o.schedule.max_reductions = std::atoi(v.c_str());
    } else if (a == "--recompute") {
      if (v != "selective" && v != "none" && v != "full") {
        usage("--recompute is selective, none or full, not " + v);
      }
      o.recompute = v == "none"   ? nn::Recompute::none
                    : v == "full" ? nn::Recompute::full
                                  : nn::Recompute::selective;
    } else if (a == "--save-every") {
      o.save_every = std::atoi(v.c_str());
    } else if (a == "--save") {
      if (v != "sync" && v != "async") {
        usage("--save is sync or async, not " + v);
      }
      o.save_async = v == "async";
    } else if (a == "--save-dir") {
      o.save_dir = v;
    } else if (a == "--model") {
      o.model_kind = v;
    } else if (a == "--steps") {
      o.steps = std::atoi(v.c_str());
    } else if (a == "--tokens" || a == "--hidden" || a == "--ffn" || a == "--vocab" || a == "--heads" ||
               a == "--kv-heads") {
      std::int64_t& x = a == "--tokens"   ? o.tokens
                        : a == "--hidden" ? o.model.hidden
                        : a == "--ffn"    ? o.model.ffn
                        : a == "--vocab"  ? o.model.vocab
                        : a == "--heads"  ? o.model.heads
                                          : o.model.kv_heads;
      x = std::atoll(v.c_str());
    } else {
      usage("unknown flag " + a);
    }
  }
  if (o.tokens % kBatch != 0 || o.tokens <= 0 || o.steps < 1) {
    usage("--tokens must be a positive multiple of 8 (8 sequences a step) and --steps at least 1");
  }
  if (o.model_kind != "mlp" && o.model_kind != "gpt") {
    usage("--model is mlp or gpt, not " + o.model_kind);
  }
  if (o.model_kind == "mlp" && o.save_every > 0) {
    usage(
        "--save-every is built for --model gpt only (the state's save for every trainer costs compile time)");
  }
  if (o.model_kind == "gpt" && o.layout == "tp_cm") {
    usage("--layout tp_cm is built for --model mlp only");
  }
  if (o.model_kind == "gpt" && o.model.heads == 0) { // 8 heads sharing 4 kv heads, as examples/09_gpt.cpp
    o.model.heads = 8, o.model.kv_heads = o.model.kv_heads ? o.model.kv_heads : 4;
  }
  if (o.mixed && o.layout != "fsdp" && o.layout != "fsdp_tp") {
    usage("--mixed is a policy of the FSDP layouts fsdp and fsdp_tp");
  }
  const auto train = o.model_kind == "gpt" ? &train_gpt : &train_mlp;
  ProcessGroup world = init_process_group();
  const int n = world.size();
  int rep = o.layout == "hsdp" ? 2 : 1;
  int tp = o.layout == "tp" || o.layout == "tp_cm" ? n : o.layout == "fsdp_tp" ? 2 : 1;
  const int dp = n / (rep * tp);
  if ((o.layout != "tp" && o.layout != "tp_cm" && o.layout != "ddp" && o.layout != "fsdp" &&
       o.layout != "hsdp" && o.layout != "fsdp_tp") ||
      rep * dp * tp != n) {
    usage("layout " + o.layout + " on " + std::to_string(n) + " ranks");
  }
  const bool print = world.rank() == 0;
  const std::string backend(world.backend_name()); // gloo under dtensor-run, MPI under mpirun where linked
  const Measured got = train(init_device_mesh<Mesh>(world, rep, dp, tp), o.layout, o);
  // The heap: the largest over the ranks.
  Tensor<double, 1> heap({3});
  heap(0) = double(got.heap_start), heap(1) = double(got.heap_peak), heap(2) = double(got.heap_end);
  all_reduce(heap, ReduceOp::max, world);
  bool ok = true;
  double loss_diff = 0;
  const double tolerance = o.mixed ? 5e-2 : 1e-4;
  if (o.check) {
    const ProcessGroup one = world.new_group({world.rank()});
    Options plain = o; // float, no recompute
    plain.mixed = false;
    plain.recompute = nn::Recompute::selective;
    plain.save_every = 0; // one rank per process: no shared folder
    const Measured want = train(init_device_mesh<Mesh>(one, 1, 1, 1), "ddp", plain);
    for (int s = 0; s < o.steps; ++s) {
      loss_diff = std::max(loss_diff, std::abs(got.losses[s] - want.losses[s]) / std::abs(want.losses[s]));
    }
    ok = loss_diff <= tolerance;
  }
  if (print) {
    const double ms = 1e3;
    std::printf(
        "%s model, %s%s%s on (rep=%d, dp=%d, tp=%d), %s: time per step on rank 0: %.2f ms = compute %.2f "
        "ms + exposed "
        "data-parallel communication %.2f ms; that communication %.2f ms (in the steps with overlap "
        "off, %.2f ms a step)\n",
        o.model_kind.c_str(), o.layout.c_str(), o.mixed ? " (bfloat16 compute)" : "",
        recompute_suffix(o.recompute), rep, dp, tp, backend.c_str(), got.step * ms,
        (got.step - got.exposed) * ms, got.exposed * ms, got.comm * ms, got.serial_step * ms);
    std::printf(
        "all communication, tensor-parallel included, blocked rank 0's training thread %.2f ms a step "
        "(%.1f %% of the step)\n",
        got.blocked * ms, 100 * got.blocked / got.step);
    std::printf("  by op (group):");
    for (const auto& [key, s] : got.blocked_by_op) {
      std::printf(" %s(%s) %.2f ms", key.first.c_str(), key.second.c_str(), s * ms);
    }
    std::printf("\n");
    std::printf("minor page faults per step on rank 0: %.0f\n", got.faults);
    std::printf(
        "heap per rank (largest over ranks): %.3f MB before training, peak %.3f MB in the steps, %.3f MB "
        "after; parameters, gradients and AdamW state %.3f MB\n",
        heap(0) / 1e6, heap(1) / 1e6, heap(2) / 1e6, double(got.state_bytes) / 1e6);
    if (o.save_every > 0) {
      std::printf(
          "%d saves (%s, every %d steps): %.2f ms a save call on rank 0, %.2f ms waiting for the last "
          "one after the steps\n",
          got.saves, o.save_async ? "async" : "sync", o.save_every, got.save_call * ms, got.final_wait * ms);
    }
    if (o.check) {
      std::printf(
          "against one rank in float: max relative difference of the losses %.1e (tolerance %.0e): %s\n",
          loss_diff, tolerance, ok ? "OK" : "MISMATCH");
    }
    if (!o.json.empty()) {
      std::FILE* f = std::fopen(o.json.c_str(), "w");
      if (f == nullptr) {
        std::fprintf(stderr, "bench_train: cannot write %s\n", o.json.c_str());
        return 1;
      }
      std::fprintf(
          f,
          "{\"suite\": \"train\", \"model\": \"%s\", \"layout\": \"%s\", \"dtype\": \"float32\", "
          "\"compute_dtype\": \"%s\", \"checkpoint\": %s, \"recompute\": \"%s\", \"backend\": \"%s\", "
          "\"device\": \"cpu\", "
          "\"ranks\": %d, "
          "\"mesh\": [%d, %d, %d], \"blocks\": %d, \"tokens\": %lld, \"hidden\": %lld, \"ffn\": %lld, "
          "\"vocab\": %lld, \"heads\": %lld, \"kv_heads\": %lld, \"steps\": %d, \"step_ms\": %.4f, "
          "\"compute_ms\": %.4f, "
          "\"exposed_ms\": %.4f, \"blocked_ms\": %.4f, \"comm_ms\": %.4f, \"serial_step_ms\": %.4f, "
          "\"minor_faults_per_step\": %.1f, \"heap_start_bytes\": %.0f, \"heap_peak_bytes\": %.0f, "
          "\"heap_end_bytes\": %.0f, \"state_bytes\": %lld, \"save_every\": %d, \"save\": \"%s\", "
          "\"saves\": %d, \"save_call_ms\": %.4f, \"final_wait_ms\": %.4f, \"losses\": [",
          o.model_kind.c_str(), o.layout.c_str(), o.mixed ? "bfloat16" : "float32",
          o.recompute == nn::Recompute::full ? "true" : "false", recompute_name(o.recompute), backend.c_str(),
          n, rep, dp, tp, kBlocks, (long long)o.tokens, (long long)o.model.hidden, (long long)o.model.ffn,
          (long long)o.model.vocab, (long long)o.model.heads, (long long)o.model.kv_head_count(), o.steps,
          got.step * ms, (got.step - got.exposed) * ms, got.exposed * ms, got.blocked * ms, got.comm * ms,
          got.serial_step * ms, got.faults, heap(0), heap(1), heap(2), (long long)got.state_bytes,
          o.save_every,
          o.save_every == 0 ? "none"
          : o.save_async    ? "async"
                            : "sync",
          got.saves, got.save_call * ms, got.final_wait * ms);
      for (int s = 0; s < o.steps; ++s) {
        std::fprintf(f, "%s%.8g", s ? ", " : "", got.losses[s]);
      }
      std::fprintf(f, "], \"blocked_by_op_ms\": {");
      const char* sep = "";
      for (const auto& [key, s] : got.blocked_by_op) {
        std::fprintf(f, "%s\"%s(%s)\": %.4f", sep, key.first.c_str(), key.second.c_str(), s * ms);
        sep = ", ";
      }
      std::fprintf(f, "}, \"check\": \"%s\"}\n", !ok ? "FAILED" : o.check ? "one-rank reference" : "none");
      std::fclose(f);
    }
  }
  return ok ? 0 : 1;
}
