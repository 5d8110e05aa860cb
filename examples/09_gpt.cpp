// 09: a GPT trained on real text: a character-level decoder (token embedding, RoPE, causal attention with
// grouped-query heads, SwiGLU MLPs, RMSNorm, an untied head) written with the layers of dtensor::nn, trained
// on the fortune cookies Debian ships (package `fortunes`, /usr/share/games/fortunes) in a parallel layout
// chosen on the command line, with a train/validation split, a generated sample at the end, and the loss
// curves written as CSV.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_09_gpt --layout fsdp_tp --steps 450
// (scripts/demo.sh does that and plots the loss curves). The defaults: 4 blocks, hidden 128, 8 heads sharing
// 4 kv heads, ffn 384, 16 windows of 64 characters a step, 450 steps (AdamW, lr 3e-3 with warmup and cosine
// decay, clip at 1.0): about two minutes on a 2-core machine, validation loss from 4.6 to about 2.1.
//   --layout L        ddp | fsdp | tp | cp_ring | cp_ulysses | fsdp_tp | fsdp_tp_cp | pp_fsdp_tp | pp
//                     (default fsdp_tp; names, degrees and trainers: train/data_layout.hpp's table):
//                       ddp         (n, 1, 1)   replicated parameters, DDP's buckets over dp
//                       fsdp        (n, 1, 1)   one FlatParamGroup per block, FsdpSchedule over dp
//                       tp          (1, 1, n)   tensor + sequence parallel, gradients all-reduced
//                       cp_ring     (1, n, 1)   ring attention over cp (the sequence sharded everywhere)
//                       cp_ulysses  (1, n, 1)   Ulysses attention over cp
//                       fsdp_tp     (n/2, 1, 2) FSDP over dp of tensor + sequence parallel blocks
//                       fsdp_tp_cp  (n/4, 2, 2) the same with ring attention over cp (8 processes: 2x2x2)
//                       pp_fsdp_tp  pp 2 x (n/4, 1, 2): the blocks pipelined over 2 stages
//                                   (nn::PipelineTrainer), FSDP x TP inside each (8 processes: 2x2x2)
//                       pp          pp n x (1, 1, 1): one stage per process
//   --schedule S      the pipeline layouts' schedule: 1f1b (default), gpipe, interleaved, zb-h1, zb-v (the
//                     zero-bubble ones: each backward as B and W apart)
//   --chunks V        model stages per pipeline rank (interleaved; zb-v: 2; default 1)
//   --microbatches M  the pipeline layouts split each batch into M micro-batches (default 4; M divides
//                     the batch)
//   --mixed           fsdp, fsdp_tp: parameters kept in float shards, gathered and computed in bfloat16
//                     (the all_gather moves bfloat16), gradients reduced in float
//   --steps N --batch B --seq S --layers K --hidden H --heads N --kv-heads N --ffn F --lr X
//   --eval-every N    validation loss every N steps (on --eval-batches fixed batches)
//   --sample N        characters generated at the end (0: none; not under the pipeline layouts, whose
//                     layers live on different processes)
//   --csv FILE        rank 0 writes step, train loss, validation loss, tokens/s
//   --data PATH       a text file, or a directory whose files are read in name order (default: the fortunes)
//   --save DIR        at the end, save the training state (parameters, AdamW's state, the step) into the
//                     sharded checkpoint DIR (train/train_state.hpp): layout-independent (the pipeline
//                     layouts save one part per stage)
//   --resume DIR      start from the training state in DIR, saved by any layout on any number of ranks, and
//                     train on to --steps (the batches are a function of the step, so the data goes on too)
//   --checkpoint-dir D  a CheckpointFolder (train/checkpoint_folder.hpp): start from its latest complete
//                     state if it has one (saved by any layout, on any number of ranks), and save into it
//   --save-every K    every K steps (in the background; --sync-save: the step waits for the disk). With
//                     dtensor-run --max-restarts a run that loses a rank starts again and goes on from its
//                     last save, bit for bit on the same layout
//   --comm-table P    every rank writes what it communicated in the training (CommDebugMode's table: op,
//                     mesh axes, count, bytes received) to P.<rank>; a dry run (DTENSOR_BACKEND=fake RANK=r
//                     WORLD_SIZE=n, one process alone) writes the same table as rank r of the real run;
//                     its tensors are meta tensors (shapes, no memory, no kernels), its losses NaN
//   --memory-table P  every rank writes the host memory of the training to P.<rank>: the peak of its
//                     tensors (MemoryTracker, core/memory_tracker.hpp), by category (parameters, gradients,
//                     optimizer state, activations, communication buffers), and the peak of the whole heap
//                     as this program measures it (every operator new, on every thread), both from the
//                     start of the training on
//   --check           also train the same model on one rank in this process and compare: the loss at every
//                     step and every final parameter (float: 1e-4 relative; --mixed against the float run:
//                     5e-2, bfloat16 keeps 8 bits of mantissa); exits 1 on a mismatch. Skipped in a dry run
//
// Rank 0 prints tokens/s and the part of a step spent waiting on the data-parallel communication: FSDP's
// all_gathers and reduce_scatters (FsdpSchedule::stats), or DDP's bucket waits and the reductions over the
// other axes that shard the tokens; on a machine with fewer cores than ranks a wait also holds the time the
// peers need to reach the collective. The mesh is (dp, cp, tp) for every layout; nn::Layout says which axis
// does what. The tokens of a step are `batch` windows of `seq + 1` characters at random offsets of the
// training text (the same on every rank, each rank builds its own block: no communication), the targets the
// inputs shifted by one. Every layout starts from the same weights (the sharding-invariant RNG) and computes
// the same step as one rank.

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/core/memory_tracker.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/block.hpp>
#include <dtensor/nn/model.hpp>
#include <dtensor/train/checkpoint_folder.hpp>
#include <dtensor/train/data_layout.hpp>
#include <dtensor/train/fsdp.hpp>
#include <dtensor/train/lr_schedule.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/pipeline_trainer.hpp>
#include <dtensor/train/train_state.hpp>
#include <dtensor/train/trainer.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// The measured heap (--memory-table): every operator new of the process, on every thread (the backend's
// included). Not under a sanitizer, whose allocator is in charge, nor without glibc.
#if defined(__GLIBC__) && !DTENSOR_DETAIL_SANITIZED_ALLOCATOR
#define GPT_HEAP_COUNTED 1
#include <dtensor/testing/heap_counter.hpp>
#else
#define GPT_HEAP_COUNTED 0
#endif

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"dp">, Axis<"cp">, Axis<"tp">>;
using PipelineMesh = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"cp">, Axis<"tp">>; // the pipeline layouts'
using DataParallel = nn::Layout<Mesh>;
using TensorSeq = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using RingCp =
    nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel, nn::ContextParallel<Ring<"cp">>>;
using UlyssesCp = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::ContextParallel<Ulysses<"cp">>>;

struct Options {
  std::string layout = "fsdp_tp", data = "/usr/share/games/fortunes", csv, save, resume, comm_table,
              memory_table, checkpoint_dir;
  bool mixed = false, check = false, sync_save = false;
  int save_every = 0;
  int steps = 450, eval_every = 25, eval_batches = 4, sample = 240;
  Schedule schedule = Schedule::one_f_one_b;
  int chunks = 1, microbatches = 4;
  std::int64_t batch = 16, seq = 64, layers = 4;
  nn::TransformerConfig model{.hidden = 128, .heads = 8, .kv_heads = 4, .ffn = 384};
  double lr = 3e-3, max_norm = 1.0;
  Device device = Device::cpu(); ///< where the tensors live: meta in a dry run (no memory, no compute)
};

// ---- the text ------------------------------------------------------------------------------------------

/// The corpus as token ids: a byte-level vocabulary of the bytes that occur, train and validation split.
struct Text {
  std::vector<unsigned char> bytes_of; ///< token id -> byte
  std::vector<std::int64_t> train, val;

  static Text load(const std::string& path) {
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_directory(path)) {
      for (const auto& e : std::filesystem::directory_iterator(path)) {
        const std::string ext = e.path().extension().string();
        if (e.is_regular_file() && !e.is_symlink() && ext != ".dat" && ext != ".u8") {
          files.push_back(e.path());
        }
      }
      std::sort(files.begin(), files.end());
    } else {
      files.push_back(path);
    }
    std::string all;
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      all.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    DTENSOR_CHECK(all.size() > 10000, "09_gpt: " + path + " holds " + std::to_string(all.size()) +
                                          " bytes of text; install the package `fortunes` (scripts/deps.sh) "
                                          "or pass --data FILE");
    Text t;
    std::vector<std::int64_t> id(256, -1);
    for (unsigned char c : all) {
      id[c] = 0;
    }
    for (int c = 0; c < 256; ++c) {
      if (id[c] == 0) {
        id[c] = static_cast<std::int64_t>(t.bytes_of.size());
        t.bytes_of.push_back(static_cast<unsigned char>(c));
      }
    }
    const std::size_t split = all.size() * 9 / 10; // the last tenth is the validation text
    for (std::size_t i = 0; i < all.size(); ++i) {
      (i < split ? t.train : t.val).push_back(id[static_cast<unsigned char>(all[i])]);
    }
    return t;
  }
};

/// A random 64-bit number from (a, b, c): splitmix64 of a mix.
std::uint64_t mix(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  std::uint64_t z = a * 0x9E3779B97F4A7C15ull + b * 0xBF58476D1CE4E5B9ull + c + 0x94D049BB133111EBull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Step `step`'s ids and targets (batch, seq) from `text`, in layout L's placements: every rank computes
/// its own block of the same windows (no communication). `first`: the rows are windows first, first + 1,
/// ... of the step (a micro-batch of a larger batch).
template <class L>
std::pair<nn::ids_t<L>, nn::ids_t<L>>
batch_of(const DeviceMesh<Mesh>& mesh, const std::vector<std::int64_t>& text, std::uint64_t stream, int step,
         std::int64_t batch, std::int64_t seq, Device device, std::int64_t first = 0) {
  std::vector<std::int64_t> offsets;
  for (std::int64_t b = first; b < first + batch; ++b) {
    offsets.push_back(static_cast<std::int64_t>(mix(stream, std::uint64_t(step), std::uint64_t(b)) %
                                                std::uint64_t(text.size() - std::size_t(seq) - 1)));
  }
  auto make = [&](std::int64_t shift) {
    return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
      return from_global_index<std::int64_t, Q...>(
          mesh, {batch, seq},
          [&](const auto& i) { return text[std::size_t(offsets[std::size_t(i[0])] + i[1] + shift)]; },
          device);
    }(static_cast<nn::ids_t<L>*>(nullptr));
  };
  return {make(0), make(1)};
}

// ---- the model -----------------------------------------------------------------------------------------

/// The GPT in element type T and layout L: embedding, TransformerBlocks, final norm, head (nn layers, each
/// owning its parameters as DTensors).
template <class T, class L>
using Gpt = nn::LanguageModel<T, L, nn::TransformerBlock>;

/// `count` characters continuing `prompt`: each from the last position's logits (temperature 0.8), with a
/// seeded draw that is the same on every rank. Meta logits (a dry run) have no values: id 0 each time.
template <class M>
std::string generate(const M& gpt, const DeviceMesh<Mesh>& mesh, const Text& text, std::string prompt,
                     int count, std::int64_t context, Device device) {
  std::vector<std::int64_t> ids;
  for (char c : prompt) {
    const auto at = std::find(text.bytes_of.begin(), text.bytes_of.end(), static_cast<unsigned char>(c));
    ids.push_back(at == text.bytes_of.end() ? 0 : at - text.bytes_of.begin());
  }
  for (int i = 0; i < count; ++i) {
    const std::int64_t s = std::min<std::int64_t>(context, std::int64_t(ids.size()));
    const std::int64_t first = std::int64_t(ids.size()) - s;
    const auto window = [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
      return from_global_index<std::int64_t, Q...>(
          mesh, {1, s}, [&](const auto& j) { return ids[std::size_t(first + j[1])]; }, device);
    }(static_cast<typename M::ids_type*>(nullptr));
    const auto logits = gpt.logits(window).full_tensor();
    if (logits.device().is_meta()) {
      ids.push_back(0);
      prompt.push_back(static_cast<char>(text.bytes_of[0]));
      continue;
    }
    const std::int64_t v = logits.shape()[2];
    std::vector<double> p(static_cast<std::size_t>(v));
    double m = -1e300, z = 0;
    for (std::int64_t k = 0; k < v; ++k) {
      p[std::size_t(k)] = double(logits.data()[(s - 1) * v + k]) / 0.8;
      m = std::max(m, p[std::size_t(k)]);
    }
    for (double& e : p) {
      e = std::exp(e - m);
      z += e;
    }
    double u = double(mix(7, std::uint64_t(i), ids.size()) >> 11) * 0x1.0p-53 * z;
    std::int64_t next = v - 1;
    for (std::int64_t k = 0; k < v; ++k) {
      if ((u -= p[std::size_t(k)]) < 0) {
        next = k;
        break;
      }
    }
    ids.push_back(next);
    prompt.push_back(static_cast<char>(text.bytes_of[std::size_t(next)]));
  }
  return prompt;
}

// ---- training ------------------------------------------------------------------------------------------

/// What a run reports: the loss per step, the validation losses, the final parameters (full, float).
struct Run {
  int first = 0;       ///< the first step this run took (after a resume: the step it resumed at)
  int timed_steps = 0; ///< the steps in `seconds`
  std::vector<double> losses, val_steps, val_losses;
  std::vector<std::vector<float>> params;
  double seconds = 0; ///< the training steps' time (without evaluation and the first step)
  double blocked = 0; ///< of which waiting on the data-parallel communication (FSDP's or DDP's)
  std::string sample;
};

/// The learning rate of step s: linear warmup over the first tenth (at most 20 steps), then cosine decay
/// to a tenth.
double lr_at(const Options& o, int s) {
  return optim::WarmupCosine{
      .peak = o.lr, .warmup = std::min(20, std::max(1, o.steps / 10)), .steps = o.steps}(s);
}

/// The full tensors of a model's parameters, as floats (a meta model's: gathered, and empty).
template <class M>
std::vector<std::vector<float>> full_values(M& model) {
  std::vector<std::vector<float>> out;
  nn::for_each_tensor(model.parameters(), [&](const auto& w) {
    const auto full = w.full_tensor();
    std::vector<float>& v = out.emplace_back();
    for (std::int64_t e = 0; e < full.numel() && !full.device().is_meta(); ++e) { // meta: gathered, no values
      v.push_back(float(full.data()[e]));
    }
  });
  return out;
}

/// Step s's result into `run` (its time from t0, unless it is the run's first step, which warms up), and
/// every eval_every steps (and at the first and the last) the validation loss on eval_batches fixed batches.
template <class L, class Trainer>
void record_step(Run& run, const nn::StepResult& r, std::chrono::steady_clock::time_point t0, int s,
                 const DeviceMesh<Mesh>& mesh, const Text& text, const Options& o, Trainer& trainer,
                 bool print) {
  if (s > run.first || o.steps - run.first == 1) {
    run.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    run.blocked += r.blocked_seconds;
    ++run.timed_steps;
  }
  run.losses.push_back(r.loss);
  if ((s + 1) % o.eval_every == 0 || s + 1 == o.steps || s == run.first) {
    double v = 0;
    for (int b = 0; b < o.eval_batches; ++b) {
      const auto [vi, vt] = batch_of<L>(mesh, text.val, 99, b, o.batch, o.seq, o.device);
      v += trainer.loss(vi, vt);
    }
    run.val_steps.push_back(s + 1);
    run.val_losses.push_back(v / o.eval_batches);
    if (print) {
      std::printf("step %4d/%d  train loss %.4f  validation loss %.4f\n", s + 1, o.steps, r.loss,
                  run.val_losses.back());
      std::fflush(stdout);
    }
  }
}

/// The checkpoint folder of --checkpoint-dir (none without it).
std::unique_ptr<CheckpointFolder> checkpoint_folder(const Options& o) {
  if (o.checkpoint_dir.empty()) {
    return nullptr;
  }
  return std::make_unique<CheckpointFolder>(
      o.checkpoint_dir, CheckpointFolderOptions{.every = o.save_every, .async = !o.sync_save});
}

/// The first step of the run: --resume's state, else the checkpoint folder's latest complete one, else 0.
template <class Trainer>
int first_step(Trainer& trainer, optim::AdamW& opt, const Options& o, CheckpointFolder* folder, bool print) {
  if (!o.resume.empty()) { // saved by any layout: each rank (a stage: its parameters) reads its part
    return int(load_training_state(trainer, o.resume, opt).step);
  }
  if (folder == nullptr) {
    return 0;
  }
  const int first = int(folder->resume(trainer, opt).step);
  if (print) {
    const char* restart = std::getenv("DTENSOR_RESTART_COUNT");
    std::printf("checkpoint folder %s: %s (start %s)\n", o.checkpoint_dir.c_str(),
                first > 0 ? ("resumed at step " + std::to_string(first)).c_str() : "no state yet, step 0",
                restart != nullptr ? restart : "0");
    std::fflush(stdout);
  }
  return first;
}

/// Trains the GPT in layout L: nn::FsdpTrainer over dp in compute type C (fsdp, fsdp_tp, fsdp_tp_cp: one
/// flat group per block, one for the embedding, one for the final norm and head, each resharded after its
/// forward, the next one's all_gather in flight, at most two reduce_scatters in flight), or nn::DdpTrainer
/// (ddp, tp, cp: DDP's buckets over dp while the backward runs, then the other axes' reductions). Then
/// clip by the global norm and AdamW. The batch of each step, the validation loss every eval_every steps.
template <class L, bool Sharded, class C = float>
Run train_layout(const DeviceMesh<Mesh>& mesh, const Text& text, const Options& o, bool print) {
  init::InitKeys keys(2024);
  Gpt<float, L> gpt(mesh, o.model, o.layers, keys, o.device);
  const nn::TrainerOptions options{
      .max_norm = o.max_norm,
      .ddp = {.bucket_cap_bytes = 1 << 18},
      .schedule = {.prefetch = 1, .reshard_after_forward = true, .max_reductions = 2}};
  using Trainer = std::conditional_t<Sharded, nn::FsdpTrainer<Gpt<float, L>, Fsdp<"dp">, C>,
                                     nn::DdpTrainer<Gpt<float, L>, "dp">>;
  const auto trainer = std::make_unique<Trainer>(mesh, std::move(gpt), options);
  optim::AdamW opt({.lr = o.lr, .weight_decay = 0.01});
  Run run;
  const auto folder = checkpoint_folder(o);
  run.first = first_step(*trainer, opt, o, folder.get(), print);
  for (int s = run.first; s < o.steps; ++s) {
    const auto [ids, targets] = batch_of<L>(mesh, text.train, 1, s, o.batch, o.seq, o.device);
    const auto t0 = std::chrono::steady_clock::now();
    opt.set_lr(lr_at(o, s));
    record_step<L>(run, trainer->step(ids, targets, opt), t0, s, mesh, text, o, *trainer, print);
    if (folder) {
      folder->step_done(*trainer, opt, {.step = s + 1, .data_position = (s + 1) * o.batch});
    }
  }
  if (folder) {
    folder->wait();
  }
  if (!o.save.empty()) {
    save_training_state(*trainer, o.save, opt, {.step = o.steps, .data_position = o.steps * o.batch});
  }
  trainer->with_gathered([&](auto& m) {
    if (o.check) { // the final parameters, for the comparison with one rank
      run.params = full_values(m);
    }
    run.sample = o.sample > 0 ? generate(m, mesh, text, "Q: ", o.sample, o.seq, o.device) : "";
  });
  return run;
}

/// Trains the GPT in layout L pipelined over the pp axis of `world` (nn::PipelineTrainer): each batch split
/// into o.microbatches micro-batches run in o.schedule's order, FSDP over dp and L's tensor parallelism
/// inside each stage. The final parameters: this rank's layers only (the others stay empty).
template <class L>
Run train_pipelined(const DeviceMesh<PipelineMesh>& world, const Text& text, const Options& o, bool print) {
  const auto mesh = world.slice<"dp", "cp", "tp">();
  init::InitKeys keys(2024);
  Gpt<float, L> gpt(mesh, o.model, o.layers, keys, o.device);
  std::size_t count = 0;
  nn::for_each_tensor(gpt.parameters(), [&](const auto&) { ++count; });
  using Trainer = nn::PipelineTrainer<Gpt<float, L>, Fsdp<"dp">>;
  const auto trainer = std::make_unique<Trainer>(
      world.group<"pp">(), mesh, std::move(gpt),
      nn::PipelineTrainerOptions{.schedule = o.schedule, .chunks = o.chunks, .max_norm = o.max_norm});
  if (print) {
    std::printf("pipeline: %s, %d micro-batches of %lld windows, %d model stages of blocks",
                schedule_name(o.schedule), o.microbatches, (long long)(o.batch / o.microbatches),
                world.size<"pp">() * o.chunks);
    for (int g = 0; g < world.size<"pp">() * o.chunks; ++g) {
      const auto [first, last] = pipeline_layers(int(o.layers), world.size<"pp">() * o.chunks, g);
      std::printf(" [%d, %d)", first, last);
    }
    std::printf("\n");
  }
  optim::AdamW opt({.lr = o.lr, .weight_decay = 0.01});
  Run run;
  const auto folder = checkpoint_folder(o);
  run.first = first_step(*trainer, opt, o, folder.get(), print);
  const std::int64_t rows = o.batch / o.microbatches;
  for (int s = run.first; s < o.steps; ++s) {
    std::vector<std::pair<nn::ids_t<L>, nn::ids_t<L>>> micro;
    for (int k = 0; k < o.microbatches; ++k) {
      micro.push_back(batch_of<L>(mesh, text.train, 1, s, rows, o.seq, o.device, k * rows));
    }
    const auto t0 = std::chrono::steady_clock::now();
    opt.set_lr(lr_at(o, s));
    record_step<L>(run, trainer->step(std::span(micro), opt), t0, s, mesh, text, o, *trainer, print);
    if (folder) {
      folder->step_done(*trainer, opt, {.step = s + 1, .data_position = (s + 1) * o.batch});
    }
  }
  if (folder) {
    folder->wait();
  }
  if (!o.save.empty()) { // one part per stage
    save_training_state(*trainer, o.save, opt, {.step = o.steps, .data_position = o.steps * o.batch});
  }
  if (!o.check) {
    return run;
  }
  run.params.resize(count); // the final parameters, for the comparison with one rank
  trainer->for_each_parameter([&](int i, const auto& w) {
    const auto full = w.full_tensor();
    std::vector<float>& v = run.params[std::size_t(i)];
    for (std::int64_t e = 0; e < full.numel() && !full.device().is_meta(); ++e) { // meta: gathered, no values
      v.push_back(float(full.data()[e]));
    }
  });
  return run;
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(
      stderr,
      "09_gpt: %s\nusage: 09_gpt [--layout ddp|fsdp|tp|cp_ring|cp_ulysses|fsdp_tp|fsdp_tp_cp|pp_fsdp_tp|pp] "
      "[--mixed] [--schedule 1f1b|gpipe|interleaved|zb-h1|zb-v] [--chunks V] [--microbatches M] [--steps N] "
      "[--batch B] "
      "[--seq S] [--layers K] [--hidden H] [--heads N] [--kv-heads N] [--ffn F] "
      "[--lr X] [--eval-every N] [--eval-batches N] [--sample N] [--csv FILE] [--data PATH] [--save DIR] "
      "[--resume DIR] [--checkpoint-dir DIR] [--save-every K] [--sync-save] [--comm-table PREFIX] "
      "[--memory-table PREFIX] [--check]\n",
      why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mixed" || a == "--check" || a == "--sync-save") {
      (a == "--mixed" ? o.mixed : a == "--check" ? o.check : o.sync_save) = true;
      continue;
    }
    if (i + 1 >= argc) {
      usage("missing the value of " + a);
    }
    const std::string v = argv[++i];
    auto number = [&] {
      const long long n = std::atoll(v.c_str());
      if (n < 1) {
        usage(a + " takes a positive number, not " + v);
      }
      return static_cast<std::int64_t>(n);
    };
    if (a == "--layout") {
      o.layout = v;
    } else if (a == "--data") {
      o.data = v;
    } else if (a == "--save") {
      o.save = v;
    } else if (a == "--resume") {
      o.resume = v;
    } else if (a == "--checkpoint-dir") {
      o.checkpoint_dir = v;
    } else if (a == "--save-every") {
      o.save_every = int(number());
    } else if (a == "--csv") {
      o.csv = v;
    } else if (a == "--comm-table") {
      o.comm_table = v;
    } else if (a == "--memory-table") {
      o.memory_table = v;
    } else if (a == "--lr") {
      o.lr = std::atof(v.c_str());
    } else if (a == "--sample") {
      o.sample = std::atoi(v.c_str());
    } else if (a == "--schedule") {
      if (v != "1f1b" && v != "gpipe" && v != "interleaved" && v != "zb-h1" && v != "zb-v") {
        usage("--schedule takes 1f1b, gpipe, interleaved, zb-h1 or zb-v, not " + v);
      }
      o.schedule = v == "1f1b"          ? Schedule::one_f_one_b
                   : v == "gpipe"       ? Schedule::gpipe
                   : v == "interleaved" ? Schedule::interleaved_one_f_one_b
                   : v == "zb-h1"       ? Schedule::zero_bubble_h1
                                        : Schedule::zero_bubble_v;
    } else if (a == "--chunks") {
      o.chunks = int(number());
    } else if (a == "--microbatches") {
      o.microbatches = int(number());
    } else if (a == "--steps") {
      o.steps = int(number());
    } else if (a == "--eval-every") {
      o.eval_every = int(number());
    } else if (a == "--eval-batches") {
      o.eval_batches = int(number());
    } else if (a == "--batch") {
      o.batch = number();
    } else if (a == "--seq") {
      o.seq = number();
    } else if (a == "--layers") {
      o.layers = number();
    } else if (a == "--hidden") {
      o.model.hidden = number();
    } else if (a == "--heads") {
      o.model.heads = number();
    } else if (a == "--kv-heads") {
      o.model.kv_heads = number();
    } else if (a == "--ffn") {
      o.model.ffn = number();
    } else {
      usage("unknown argument " + a);
    }
  }
  return o;
}

/// The largest relative difference of two runs' losses and of their final parameters (against max(1, |x|));
/// a's empty parameters are skipped.
std::pair<double, double> difference(const Run& a, const Run& b) {
  double loss = 0, param = 0;
  for (std::size_t s = 0; s < a.losses.size(); ++s) { // a may have resumed: its steps are b's last ones
    const double want = b.losses[s + std::size_t(a.first - b.first)];
    loss = std::max(loss, std::abs(a.losses[s] - want) / std::abs(want));
  }
  for (std::size_t i = 0; i < b.params.size(); ++i) {
    if (a.params[i].empty()) {
      continue; // a pipeline rank holds its stages' parameters only
    }
    for (std::size_t e = 0; e < b.params[i].size(); ++e) {
      param = std::max(param, double(std::abs(a.params[i][e] - b.params[i][e])) /
                                  std::max(1.0, double(std::abs(b.params[i][e]))));
    }
  }
  return {loss, param};
}

int run_main(int argc, char** argv);

} // namespace

int main(int argc, char** argv) {
  try {
    return run_main(argc, argv);
  } catch (const std::exception& e) { // a bad size or layout: the message, not an abort
    std::fprintf(stderr, "09_gpt: %s\n", e.what());
    return 1;
  }
}

namespace {

int run_main(int argc, char** argv) {
  Options o = parse(argc, argv);
  ProcessGroup world = init_process_group();
  const int n = world.size();
  const bool print = world.rank() == 0;
  const Text text = Text::load(o.data);
  o.model.vocab = std::int64_t(text.bytes_of.size());
  o.device = world.dry_run() ? Device::meta() : Device::cpu(); // a dry run holds shapes, not values
  // The layout's degrees over (pp, dp, cp, tp) and its trainer: train/data_layout.hpp's table.
  nn::DataLayout layout{};
  nn::LayoutDegrees d;
  try {
    layout = nn::parse_layout(o.layout);
    d = nn::layout_degrees(layout, n);
  } catch (const Error& e) {
    usage(e.what());
  }
  const nn::LayoutSpec& spec = nn::layout_spec(layout);
  if (d.rep > 1) {
    usage("layout " + o.layout + ": 09_gpt's mesh has no replica axis");
  }
  const bool pipelined = spec.trainer == nn::LayoutTrainer::pipeline;
  if (o.mixed && (spec.trainer != nn::LayoutTrainer::fsdp || d.cp > 1)) {
    usage("--mixed is a policy of the FSDP layouts fsdp and fsdp_tp");
  }
  const int pp = d.pp, dp = d.dp, cp = d.cp, tp = d.tp;
  if (!o.resume.empty() && !o.checkpoint_dir.empty()) {
    usage("--resume and --checkpoint-dir both say where to start: give one");
  }
  if (o.save_every > 0 && o.checkpoint_dir.empty()) {
    usage("--save-every needs --checkpoint-dir (the folder the states go to)");
  }
  if (pipelined) {
    if (o.batch % o.microbatches != 0) {
      usage("--microbatches " + std::to_string(o.microbatches) + " does not divide the batch of " +
            std::to_string(o.batch) + " windows");
    }
    o.sample = 0; // the layers live on different processes
  }
  if (print) {
    std::printf(
        "GPT: %lld layers, hidden %lld, %lld heads (%lld kv), ffn %lld, vocab %lld (bytes of %s: %zu "
        "train, %zu validation), %lld x %lld tokens a step; layout %s%s on (pp=%d, dp=%d, cp=%d, tp=%d) "
        "over %s\n",
        (long long)o.layers, (long long)o.model.hidden, (long long)o.model.heads,
        (long long)o.model.kv_head_count(), (long long)o.model.ffn, (long long)o.model.vocab, o.data.c_str(),
        text.train.size(), text.val.size(), (long long)o.batch, (long long)o.seq, o.layout.c_str(),
        o.mixed ? " (bfloat16 compute)" : "", pp, dp, cp, tp, std::string(world.backend_name()).c_str());
  }
  // The model's layout type from the layout's: tensor + sequence parallel where tp > 1, its context
  // parallelism; sharded by FSDP or replicated (DDP).
  auto train = [&](const DeviceMesh<Mesh>& m, const nn::LayoutSpec& l, bool mixed, bool p) -> Run {
    const bool sharded = l.trainer == nn::LayoutTrainer::fsdp;
    if (l.context == nn::LayoutContext::ring) {
      return sharded ? train_layout<RingCp, true>(m, text, o, p) : train_layout<RingCp, false>(m, text, o, p);
    } else if (l.context == nn::LayoutContext::ulysses) {
      return train_layout<UlyssesCp, false>(m, text, o, p);
    } else if (l.degrees.tp != 1) {
      if (!sharded) {
        return train_layout<TensorSeq, false>(m, text, o, p);
      }
      return mixed ? train_layout<TensorSeq, true, bfloat16>(m, text, o, p)
                   : train_layout<TensorSeq, true>(m, text, o, p);
    } else if (sharded) {
      return mixed ? train_layout<DataParallel, true, bfloat16>(m, text, o, p)
                   : train_layout<DataParallel, true>(m, text, o, p);
    }
    return train_layout<DataParallel, false>(m, text, o, p);
  };
  std::optional<CommDebugMode> comm; // --comm-table: what this rank communicates in the training
  if (!o.comm_table.empty()) {
    comm.emplace();
  }
  std::optional<MemoryTracker> memory; // --memory-table: this rank's tensors, and the heap, from here on
  std::int64_t heap_at_start = 0;
  if (!o.memory_table.empty()) {
#if GPT_HEAP_COUNTED
    heap_at_start = testing::heap::live();
    testing::heap::reset_peak();
#endif
    memory.emplace();
  }
  const Run run = [&] {
    if (!pipelined) {
      return train(init_device_mesh<Mesh>(world, dp, cp, tp), spec, o.mixed, print);
    }
    const auto mesh = init_device_mesh<PipelineMesh>(world, pp, dp, cp, tp);
    return tp == 1 ? train_pipelined<DataParallel>(mesh, text, o, print)
                   : train_pipelined<TensorSeq>(mesh, text, o, print);
  }();
  if (comm) {
    const std::string path = o.comm_table + "." + std::to_string(world.rank());
    std::ofstream out(path);
    out << comm->to_string();
    out.close();
    if (!out) {
      std::fprintf(stderr, "09_gpt: cannot write %s\n", path.c_str());
      return 1;
    }
    comm.reset();
  }
  if (memory) {
    const MemoryStats m = memory->stats();
    const std::string path = o.memory_table + "." + std::to_string(world.rank());
    std::ofstream out(path);
    out << "tensor_peak " << m.peak_total << "\n";
#if GPT_HEAP_COUNTED
    out << "heap_peak " << testing::heap::peak() - heap_at_start << "\n";
#else
    (void)heap_at_start;
#endif
    out << m.to_string();
    out.close();
    if (!out) {
      std::fprintf(stderr, "09_gpt: cannot write %s\n", path.c_str());
      return 1;
    }
    memory.reset();
  }
  const double tokens = double(o.batch * o.seq) * std::max(1, run.timed_steps);
  bool ok = true;
  if (print) {
    const int n_timed = std::max(1, run.timed_steps);
    std::printf("%.0f tokens/s (%.1f ms a step, of which %.1f ms (%.0f%%) waiting on %s)\n",
                tokens / run.seconds, 1e3 * run.seconds / n_timed, 1e3 * run.blocked / n_timed,
                100.0 * run.blocked / run.seconds,
                pipelined ? "the pipeline's neighbours (the bubble and the exchanges)"
                : spec.trainer == nn::LayoutTrainer::fsdp ? "FSDP's all_gathers and reduce_scatters"
                                                          : "DDP's buckets and the other axes' reductions");
    if (!run.sample.empty()) {
      std::printf("sample:\n%s\n", run.sample.c_str());
    }
  }
  if (o.check && world.dry_run()) {
    if (print) {
      std::printf("--check: skipped in a dry run (meta tensors: no values to compare)\n");
    }
  } else if (o.check) {
    // The same training on one rank: a group of this rank alone, a (1, 1, 1) mesh, replicated float
    // parameters, no sample.
    const ProcessGroup one = world.new_group({world.rank()});
    Options ref = o;
    ref.sample = 0;
    ref.save.clear();
    ref.resume.clear(); // the reference trains every step from the start
    ref.checkpoint_dir.clear();
    std::swap(o, ref);
    const Run want =
        train(init_device_mesh<Mesh>(one, 1, 1, 1), nn::layout_spec(nn::DataLayout::ddp), false, false);
    std::swap(o, ref);
    const auto [loss_diff, param_diff] = difference(run, want);
    const double tol = o.mixed ? 5e-2 : 1e-4;
    ok = loss_diff <= tol && param_diff <= tol;
    if (print || !ok) {
      std::printf(
          "rank %d against one rank: max relative difference of the losses %.1e, of the final parameters "
          "%.1e (tolerance %.0e): %s\n",
          world.rank(), loss_diff, param_diff, tol, ok ? "OK" : "MISMATCH");
    }
  }
  if (print && !o.csv.empty()) {
    std::FILE* f = std::fopen(o.csv.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "09_gpt: cannot write %s\n", o.csv.c_str());
      return 1;
    }
    std::fprintf(f, "step,train_loss,validation_loss\n");
    std::size_t v = 0;
    for (std::size_t s = 0; s < run.losses.size(); ++s) {
      const bool has_val = v < run.val_steps.size() && run.val_steps[v] == double(s + 1);
      if (has_val) {
        std::fprintf(f, "%zu,%.6f,%.6f\n", s + 1, run.losses[s], run.val_losses[v++]);
      } else {
        std::fprintf(f, "%zu,%.6f,\n", s + 1, run.losses[s]);
      }
    }
    std::fclose(f);
  }
  return ok ? 0 : 1;
}

} // namespace
