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
//   --layout L        ddp | fsdp | tp | cp_ring | cp_ulysses | fsdp_tp | fsdp_tp_cp (default fsdp_tp):
//                       ddp         (n, 1, 1)   replicated parameters, DDP's buckets over dp
//                       fsdp        (n, 1, 1)   one FlatParamGroup per block, FsdpSchedule over dp
//                       tp          (1, 1, n)   tensor + sequence parallel, gradients all-reduced
//                       cp_ring     (1, n, 1)   ring attention over cp (the sequence sharded everywhere)
//                       cp_ulysses  (1, n, 1)   Ulysses attention over cp
//                       fsdp_tp     (n/2, 1, 2) FSDP over dp of tensor + sequence parallel blocks
//                       fsdp_tp_cp  (n/4, 2, 2) the same with ring attention over cp (8 processes: 2x2x2)
//   --mixed           FSDP layouts: parameters kept in float shards, gathered and computed in bfloat16
//                     (the all_gather moves bfloat16), gradients reduced in float
//   --steps N --batch B --seq S --layers K --hidden H --heads N --kv-heads N --ffn F --lr X
//   --eval-every N    validation loss every N steps (on --eval-batches fixed batches)
//   --sample N        characters generated at the end (0: none)
//   --csv FILE        rank 0 writes step, train loss, validation loss, tokens/s
//   --data PATH       a text file, or a directory whose files are read in name order (default: the fortunes)
//   --save DIR        at the end, save the training state (parameters, AdamW's state, the step) into the
//                     sharded checkpoint DIR (parallel/train_state.hpp): layout-independent
//   --resume DIR      start from the training state in DIR, saved by any layout on any number of ranks, and
//                     train on to --steps (the batches are a function of the step, so the data goes on too)
//   --check           also train the same model on one rank in this process and compare: the loss at every
//                     step and every final parameter (float: 1e-4 relative; --mixed against the float run:
//                     5e-2, bfloat16 keeps 8 bits of mantissa); exits 1 on a mismatch
//
// Rank 0 prints tokens/s and the part of a step spent waiting on the data-parallel communication: FSDP's
// all_gathers and reduce_scatters (FsdpSchedule::stats), or DDP's bucket waits and the reductions over the
// other axes that shard the tokens; on a machine with fewer cores than ranks a wait also holds the time the
// peers need to reach the collective. The mesh is (dp, cp, tp) for every layout; nn::Layout says which axis
// does what. The tokens of a step are `batch` windows of `seq + 1` characters at random offsets of the
// training text (the same on every rank, each rank builds its own block: no communication), the targets the
// inputs shifted by one. Every layout starts from the same weights (the sharding-invariant RNG) and computes
// the same step as one rank.

#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/parallel/clip.hpp>
#include <dtensor/parallel/ddp.hpp>
#include <dtensor/parallel/fsdp.hpp>
#include <dtensor/parallel/layers.hpp>
#include <dtensor/parallel/optim.hpp>
#include <dtensor/parallel/schedule.hpp>
#include <dtensor/parallel/train_state.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"dp">, Axis<"cp">, Axis<"tp">>;
using DataParallel = nn::Layout<Mesh>;
using TensorSeq = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using RingCp =
    nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel, nn::ContextParallel<Ring<"cp">>>;
using UlyssesCp = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::ContextParallel<Ulysses<"cp">>>;

struct Options {
  std::string layout = "fsdp_tp", data = "/usr/share/games/fortunes", csv, save, resume;
  bool mixed = false, check = false;
  int steps = 450, eval_every = 25, eval_batches = 4, sample = 240;
  std::int64_t batch = 16, seq = 64, layers = 4;
  nn::TransformerConfig model{.hidden = 128, .heads = 8, .kv_heads = 4, .ffn = 384};
  double lr = 3e-3, max_norm = 1.0;
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
/// its own block of the same windows (no communication).
template <class L>
std::pair<nn::ids_t<L>, nn::ids_t<L>> batch_of(const DeviceMesh<Mesh>& mesh,
                                               const std::vector<std::int64_t>& text, std::uint64_t stream,
                                               int step, std::int64_t batch, std::int64_t seq) {
  std::vector<std::int64_t> offsets;
  for (std::int64_t b = 0; b < batch; ++b) {
    offsets.push_back(static_cast<std::int64_t>(mix(stream, std::uint64_t(step), std::uint64_t(b)) %
                                                std::uint64_t(text.size() - std::size_t(seq) - 1)));
  }
  auto make = [&](std::int64_t shift) {
    return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
      return from_global_index<std::int64_t, Q...>(mesh, {batch, seq}, [&](const auto& i) {
        return text[std::size_t(offsets[std::size_t(i[0])] + i[1] + shift)];
      });
    }(static_cast<nn::ids_t<L>*>(nullptr));
  };
  return {make(0), make(1)};
}

// ---- the model -----------------------------------------------------------------------------------------

/// The GPT in element type T and layout L: its layers, each owning its parameters as DTensors.
template <class T, class L>
struct Gpt {
  nn::Embedding<T, L> emb;
  std::vector<nn::TransformerBlock<T, L>> blocks;
  nn::RmsNorm<T, L> norm;
  nn::LmHead<T, L> head;

  /// Fresh weights from the sharding-invariant RNG (the same numbers on every mesh).
  static Gpt init(const DeviceMesh<Mesh>& mesh, const nn::TransformerConfig& c, std::int64_t layers) {
    init::InitKeys keys(2024);
    nn::Embedding<T, L> emb(mesh, c.vocab, c.hidden, keys.next(), c.init_std);
    std::vector<nn::TransformerBlock<T, L>> blocks;
    for (std::int64_t b = 0; b < layers; ++b) {
      blocks.emplace_back(mesh, c, keys);
    }
    return {emb, blocks, nn::RmsNorm<T, L>(mesh, c.hidden, c.norm_eps),
            nn::LmHead<T, L>(mesh, c.vocab, c.hidden, keys.next(), c.init_std)};
  }

  /// Every parameter in order (embedding, blocks, norm, head): what the optimizer steps and the check reads.
  auto parameters() {
    std::vector<decltype(blocks[0].parameters())> b;
    for (auto& blk : blocks) {
      b.push_back(blk.parameters());
    }
    return std::tuple{emb.parameters(), b, std::tuple_cat(norm.parameters(), head.parameters())};
  }

  /// The mean loss of one batch, no backward.
  double loss(const nn::ids_t<L>& ids, const nn::ids_t<L>& targets) const {
    auto h = emb.forward(ids);
    for (const auto& blk : blocks) {
      h = blk.forward(h);
    }
    return double(head.forward(norm.forward(h), targets).full_tensor().data()[0]);
  }

  /// Forward and backward of one batch: the loss, and each layer's gradients handed to `grads(layer, tuple)`
  /// as soon as the backward has them (head and norm as layer blocks + 1, blocks in reverse, embedding -1).
  template <class F>
  double step(const nn::ids_t<L>& ids, const nn::ids_t<L>& targets, F&& grads) const {
    auto [h0, emb_back] = emb.forward(ids, with_backward);
    using Back = decltype(blocks[0].forward(h0, with_backward).backward);
    std::vector<Back> backs;
    auto h = h0;
    for (const auto& blk : blocks) {
      auto [y, back] = blk.forward(h, with_backward);
      backs.push_back(std::move(back));
      h = y;
    }
    auto [n, norm_back] = norm.forward(h, with_backward);
    auto [loss, head_back] = head.forward(n, targets, with_backward);
    auto [dn, head_grads] = head_back(1.0);
    auto [dh, norm_grads] = norm_back(dn);
    grads(int(blocks.size()), std::tuple_cat(norm_grads, head_grads));
    for (int b = int(blocks.size()) - 1; b >= 0; --b) {
      auto [dx, g] = backs[std::size_t(b)](dh);
      grads(b, g);
      dh = dx;
    }
    grads(-1, emb_back(dh).params);
    return double(loss.full_tensor().data()[0]);
  }

  /// `count` characters continuing `prompt`: each from the last position's logits (temperature 0.8), with a
  /// seeded draw that is the same on every rank.
  std::string generate(const DeviceMesh<Mesh>& mesh, const Text& text, std::string prompt, int count,
                       std::int64_t context) const {
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
            mesh, {1, s}, [&](const auto& j) { return ids[std::size_t(first + j[1])]; });
      }(static_cast<nn::ids_t<L>*>(nullptr));
      auto h = emb.forward(window);
      for (const auto& blk : blocks) {
        h = blk.forward(h);
      }
      const auto logits = head.logits(norm.forward(h)).full_tensor();
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
};

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
  const int warm = std::min(20, std::max(1, o.steps / 10));
  if (s < warm) {
    return o.lr * (s + 1) / warm;
  }
  const double t = double(s - warm) / std::max(1, o.steps - warm);
  return o.lr * (0.1 + 0.9 * 0.5 * (1 + std::cos(3.141592653589793 * t)));
}

/// f(x) for every DTensor of a nest of tuples and vectors, in order.
template <class P, class F>
void for_each_tensor(P&& p, F&& f) {
  using V = std::remove_cvref_t<P>;
  if constexpr (AnyDTensor<V>) {
    f(p);
  } else if constexpr (requires { std::tuple_size<V>::value; }) {
    std::apply([&](auto&&... e) { (for_each_tensor(e, f), ...); }, p);
  } else {
    for (auto&& e : p) {
      for_each_tensor(e, f);
    }
  }
}

/// The full tensors of a nest of parameters, as floats.
template <class P>
std::vector<std::vector<float>> full_values(const P& params) {
  std::vector<std::vector<float>> out;
  for_each_tensor(params, [&](const auto& w) {
    const auto full = w.full_tensor();
    std::vector<float>& v = out.emplace_back();
    for (std::int64_t e = 0; e < full.numel(); ++e) {
      v.push_back(float(full.data()[e]));
    }
  });
  return out;
}

/// The training loop both trainers share: per step the batch, `step(ids, targets)` (its loss), the
/// validation loss every eval_every steps by `eval(ids, targets)`, the time.
template <class L, class Step, class Eval>
Run train_loop(const DeviceMesh<Mesh>& mesh, const Text& text, const Options& o, bool print, int first,
               Step&& step, Eval&& eval) {
  Run run;
  run.first = first;
  for (int s = first; s < o.steps; ++s) {
    const auto [ids, targets] = batch_of<L>(mesh, text.train, 1, s, o.batch, o.seq);
    const auto t0 = std::chrono::steady_clock::now();
    const auto [loss, blocked] = step(s, ids, targets);
    if (s > first || o.steps - first == 1) { // the first step warms up
      run.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      run.blocked += blocked;
      ++run.timed_steps;
    }
    run.losses.push_back(loss);
    if ((s + 1) % o.eval_every == 0 || s + 1 == o.steps || s == first) {
      double v = 0;
      for (int b = 0; b < o.eval_batches; ++b) {
        const auto [vi, vt] = batch_of<L>(mesh, text.val, 99, b, o.batch, o.seq);
        v += eval(vi, vt);
      }
      run.val_steps.push_back(s + 1);
      run.val_losses.push_back(v / o.eval_batches);
      if (print) {
        std::printf("step %4d/%d  train loss %.4f  validation loss %.4f\n", s + 1, o.steps, loss,
                    run.val_losses.back());
        std::fflush(stdout);
      }
    }
  }
  return run;
}

/// f(x, y) for the DTensors of two nests of the same shape, in order.
template <class A, class B, class F>
void for_each_pair(A&& a, B&& b, F&& f) {
  using V = std::remove_cvref_t<A>;
  if constexpr (AnyDTensor<V>) {
    f(a, b);
  } else if constexpr (requires { std::tuple_size<V>::value; }) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (for_each_pair(std::get<I>(a), std::get<I>(b), f), ...);
    }
    (std::make_index_sequence<std::tuple_size_v<V>>{});
  } else {
    for (std::size_t i = 0; i < a.size(); ++i) {
      for_each_pair(a[i], b[i], f);
    }
  }
}

/// A tuple of references made a tuple of values (handles).
template <class... W>
std::tuple<std::remove_cvref_t<W>...> values(const std::tuple<W...>& t) {
  return std::apply([](const auto&... w) { return std::tuple<std::remove_cvref_t<W>...>{w...}; }, t);
}

/// f(group) for the embedding's group, each block's, the head's: the forward order.
template <class E, class B, class H, class F>
void for_each_group(E& e, std::vector<B>& blocks, H& h, F&& f) {
  f(e);
  for (auto& b : blocks) {
    f(b);
  }
  f(h);
}

/// ddp, tp, cp: replicated parameters. DDP's buckets all-reduce the gradients over dp while the backward
/// runs; the reductions over the other axes that shard the tokens (cp; tp for the norms' weights under
/// sequence parallelism) follow; then clip by the global norm and AdamW.
template <class L>
Run train_replicated(const DeviceMesh<Mesh>& mesh, const Text& text, const Options& o, bool print) {
  Gpt<float, L> gpt = Gpt<float, L>::init(mesh, o.model, o.layers);
  auto params = gpt.parameters();
  std::vector<std::int64_t> numels;
  for_each_tensor(params, [&](const auto& w) { numels.push_back(w.local().numel()); });
  // The reduced gradients, placed like the parameters: a nest of handles like `params`, each replaced.
  auto grads =
      std::tuple{values(std::get<0>(params)), std::vector<decltype(values(std::get<1>(params)[0]))>(),
                 values(std::get<2>(params))};
  for (const auto& b : std::get<1>(params)) {
    std::get<1>(grads).push_back(values(b));
  }
  const int per_block = int(std::tuple_size_v<typename nn::TransformerBlock<float, L>::parameter_types>);
  optim::AdamW opt({.lr = o.lr, .weight_decay = 0.01});
  const int first = o.resume.empty() ? 0 : int(load_training_state(o.resume, opt, params).step);
  auto step = [&](int s, const auto& ids, const auto& targets) {
    DDPReducer<"dp", float, Mesh> reducer(mesh, numels, {.bucket_cap_bytes = 1 << 18});
    std::vector<std::function<void()>> complete; // after finish(): the other axes' reductions
    // Gradient I of a layer whose first parameter is `first`: to DDP now, to its slot after finish().
    auto hand = [&](int first, const auto& g, auto& slots) {
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        (complete.push_back([r = reducer.ready(first + int(I), std::get<I>(g)), &slot = std::get<I>(slots)] {
          slot = nn::detail::gradient_as<std::remove_cvref_t<decltype(slot)>>(r);
        }),
         ...);
      }
      (std::make_index_sequence<std::tuple_size_v<std::remove_cvref_t<decltype(g)>>>{});
    };
    const double loss = gpt.step(ids, targets, [&](int layer, const auto& g) {
      constexpr std::size_t n = std::tuple_size_v<std::remove_cvref_t<decltype(g)>>;
      if constexpr (n == 1) { // the embedding
        hand(0, g, std::get<0>(grads));
      } else if constexpr (n == 2) { // the final norm and the head
        hand(1 + int(gpt.blocks.size()) * per_block, g, std::get<2>(grads));
      } else {
        hand(1 + layer * per_block, g, std::get<1>(grads)[std::size_t(layer)]);
      }
    });
    const auto w0 =
        std::chrono::steady_clock::now(); // the buckets still in flight, the other axes' reductions
    reducer.finish();
    for (auto& f : complete) {
      f();
    }
    const double blocked = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    const double norm = clip_grad_norm(o.max_norm, grads);
    opt.set_lr(lr_at(o, s));
    int index = 0;
    for_each_pair(params, grads, [&](auto& w, const auto& g) { opt.step(index++, w, g); });
    (void)norm;
    return std::pair{loss, blocked};
  };
  Run run = train_loop<L>(mesh, text, o, print, first, step,
                          [&](const auto& ids, const auto& targets) { return gpt.loss(ids, targets); });
  if (!o.save.empty()) {
    save_training_state(o.save, opt, {.step = o.steps, .data_position = o.steps * o.batch}, params);
  }
  run.params = full_values(params);
  run.sample = o.sample > 0 ? gpt.generate(mesh, text, "Q: ", o.sample, o.seq) : "";
  return run;
}

/// fsdp, fsdp_tp, fsdp_tp_cp: one FlatParamGroup per block, one for the embedding, one for the final norm
/// and the head (Fsdp<"dp">: sharded over dp; the parameters' tp placements kept), run by FsdpSchedule:
/// the next group's all_gather in flight while one computes, each group resharded after its forward and
/// gathered again for its backward (which recomputes the block's forward from its saved input), at most two
/// reduce_scatters in flight. C is the compute type: float, or bfloat16 with --mixed (float shards, the
/// all_gather and the compute in bfloat16, gradients reduced in float).
template <class L, class C>
Run train_sharded(const DeviceMesh<Mesh>& mesh, const Text& text, const Options& o, bool print) {
  using Emb = nn::Embedding<float, L>;
  using Block = nn::TransformerBlock<float, L>;
  using EmbGroup = FlatParamGroup<float, Mesh, Fsdp<"dp">, nn::params_of<Emb>, float, C>;
  using BlockGroup = FlatParamGroup<float, Mesh, Fsdp<"dp">, nn::params_of<Block>, float, C>;
  using HeadGroup =
      FlatParamGroup<float, Mesh, Fsdp<"dp">,
                     nn::params_of_layers<nn::RmsNorm<float, L>, nn::LmHead<float, L>>, float, C>;
  auto group = [](auto type, const auto& params) {
    using G = typename decltype(type)::type;
    return std::apply([](const auto&... p) { return G(p...); }, params);
  };
  // The groups copy the parameters into their shards; the model keeps its layers as configuration only.
  Gpt<float, L> gpt = Gpt<float, L>::init(mesh, o.model, o.layers);
  EmbGroup ge = group(std::type_identity<EmbGroup>{}, gpt.emb.parameters());
  std::vector<BlockGroup> gb;
  for (auto& b : gpt.blocks) {
    gb.push_back(group(std::type_identity<BlockGroup>{}, b.parameters()));
  }
  HeadGroup gh =
      group(std::type_identity<HeadGroup>{}, std::tuple_cat(gpt.norm.parameters(), gpt.head.parameters()));
  nn::release_parameters(gpt.emb);
  for (auto& b : gpt.blocks) {
    nn::release_parameters(b);
  }
  nn::release_parameters(gpt.norm);
  nn::release_parameters(gpt.head);

  // The model on the groups' gathered parameters, in the compute type (evaluation and sampling).
  auto gathered = [&] {
    auto [w_emb] = ge.params();
    Gpt<C, L> view{gpt.emb.with_parameters(w_emb),
                   {},
                   gpt.norm.with_parameters(gh.template param<0>()),
                   gpt.head.with_parameters(gh.template param<1>())};
    for (std::size_t b = 0; b < gb.size(); ++b) {
      view.blocks.push_back(
          std::apply([&](const auto&... p) { return gpt.blocks[b].with_parameters(p...); }, gb[b].params()));
    }
    return view;
  };
  auto unshard_all = [&](bool on) {
    for_each_group(ge, gb, gh, [&](auto& g) { on ? g.unshard() : g.reshard(); });
  };
  optim::AdamW opt({.lr = o.lr, .weight_decay = 0.01});
  const int first = o.resume.empty() ? 0 : int(load_training_state(o.resume, opt, ge, gb, gh).step);
  auto step = [&](int s, const auto& ids, const auto& targets) {
    FsdpSchedule sched({.prefetch = 1, .reshard_after_forward = true, .max_reductions = 2});
    for_each_group(ge, gb, gh, [&](auto& g) { sched.add(g); });
    // Forward: only each block's input is kept.
    using Act = nn::act_t<L, C>;
    std::vector<Act> inputs;
    Act h = sched.forward(ge, [&](const auto& w) { return gpt.emb.with_parameters(w).forward(ids); });
    for (std::size_t b = 0; b < gb.size(); ++b) {
      inputs.push_back(h);
      h = sched.forward(gb[b],
                        [&](const auto&... p) { return gpt.blocks[b].with_parameters(p...).forward(h); });
    }
    // The final norm and the head: forward and backward in one call.
    double loss = 0;
    std::optional<Act> dh;
    sched.backward(gh, [&](const auto& g, const auto& w) {
      auto [n, norm_back] = gpt.norm.with_parameters(g).forward(h, with_backward);
      auto [l, head_back] = gpt.head.with_parameters(w).forward(n, targets, with_backward);
      loss = double(l.full_tensor().data()[0]);
      auto [dn, head_grads] = head_back(1.0);
      auto [d, norm_grads] = norm_back(dn);
      dh.emplace(d);
      return std::tuple_cat(norm_grads, head_grads);
    });
    // Backward: each block recomputes its forward from its saved input.
    for (std::size_t b = gb.size(); b-- > 0;) {
      sched.backward(gb[b], [&](const auto&... p) {
        auto [dx, grads] =
            gpt.blocks[b].with_parameters(p...).forward(inputs[b], with_backward).backward(*dh);
        dh.emplace(dx);
        return grads;
      });
    }
    sched.backward(ge, [&](const auto& w) {
      return gpt.emb.with_parameters(w).forward(ids, with_backward).backward(*dh).params;
    });
    sched.finish();
    clip_grad_norm(o.max_norm, ge, gb, gh);
    opt.set_lr(lr_at(o, s));
    int index = 0;
    for_each_group(ge, gb, gh, [&](auto& g) {
      opt.step(index++, g);
      g.zero_grad();
    });
    return std::pair{loss, sched.stats().blocked_seconds};
  };
  auto eval = [&](const auto& ids, const auto& targets) {
    unshard_all(true);
    const double l = gathered().loss(ids, targets);
    unshard_all(false);
    return l;
  };
  Run run = train_loop<L>(mesh, text, o, print, first, step, eval);
  if (!o.save.empty()) {
    save_training_state(o.save, opt, {.step = o.steps, .data_position = o.steps * o.batch}, ge, gb, gh);
  }
  unshard_all(true);
  {
    auto view = gathered();
    run.params = full_values(view.parameters());
    run.sample = o.sample > 0 ? view.generate(mesh, text, "Q: ", o.sample, o.seq) : "";
  }
  unshard_all(false);
  return run;
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(
      stderr,
      "09_gpt: %s\nusage: 09_gpt [--layout ddp|fsdp|tp|cp_ring|cp_ulysses|fsdp_tp|fsdp_tp_cp] [--mixed] "
      "[--steps N] [--batch B] [--seq S] [--layers K] [--hidden H] [--heads N] [--kv-heads N] [--ffn F] "
      "[--lr X] [--eval-every N] [--eval-batches N] [--sample N] [--csv FILE] [--data PATH] [--save DIR] "
      "[--resume DIR] [--check]\n",
      why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mixed" || a == "--check") {
      (a == "--mixed" ? o.mixed : o.check) = true;
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
    } else if (a == "--csv") {
      o.csv = v;
    } else if (a == "--lr") {
      o.lr = std::atof(v.c_str());
    } else if (a == "--sample") {
      o.sample = std::atoi(v.c_str());
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

/// The largest relative difference of two runs' losses and of their final parameters (against max(1, |x|)).
std::pair<double, double> difference(const Run& a, const Run& b) {
  double loss = 0, param = 0;
  for (std::size_t s = 0; s < a.losses.size(); ++s) { // a may have resumed: its steps are b's last ones
    const double want = b.losses[s + std::size_t(a.first - b.first)];
    loss = std::max(loss, std::abs(a.losses[s] - want) / std::abs(want));
  }
  for (std::size_t i = 0; i < b.params.size(); ++i) {
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
  const bool sharded = o.layout.rfind("fsdp", 0) == 0;
  if (o.mixed && !sharded) {
    usage("--mixed is a policy of the FSDP layouts (fsdp, fsdp_tp, fsdp_tp_cp)");
  }
  // The mesh (dp, cp, tp) of each layout.
  int dp = n, cp = 1, tp = 1;
  if (o.layout == "tp") {
    dp = 1, tp = n;
  } else if (o.layout == "cp_ring" || o.layout == "cp_ulysses") {
    dp = 1, cp = n;
  } else if (o.layout == "fsdp_tp") {
    dp = n / 2, tp = 2;
  } else if (o.layout == "fsdp_tp_cp") {
    dp = n / 4, cp = 2, tp = 2;
  } else if (o.layout != "ddp" && o.layout != "fsdp") {
    usage("unknown layout " + o.layout);
  }
  if (dp * cp * tp != n || dp < 1) {
    usage("layout " + o.layout + " does not fit " + std::to_string(n) + " processes");
  }
  const auto mesh = init_device_mesh<Mesh>(world, dp, cp, tp);
  if (print) {
    std::printf(
        "GPT: %lld layers, hidden %lld, %lld heads (%lld kv), ffn %lld, vocab %lld (bytes of %s: %zu "
        "train, %zu validation), %lld x %lld tokens a step; layout %s%s on (dp=%d, cp=%d, tp=%d) over "
        "%s\n",
        (long long)o.layers, (long long)o.model.hidden, (long long)o.model.heads,
        (long long)o.model.kv_head_count(), (long long)o.model.ffn, (long long)o.model.vocab, o.data.c_str(),
        text.train.size(), text.val.size(), (long long)o.batch, (long long)o.seq, o.layout.c_str(),
        o.mixed ? " (bfloat16 compute)" : "", dp, cp, tp, std::string(world.backend_name()).c_str());
  }
  auto train = [&](const DeviceMesh<Mesh>& m, const std::string& layout, bool mixed, bool p) -> Run {
    if (layout == "ddp") {
      return train_replicated<DataParallel>(m, text, o, p);
    } else if (layout == "tp") {
      return train_replicated<TensorSeq>(m, text, o, p);
    } else if (layout == "cp_ring") {
      return train_replicated<RingCp>(m, text, o, p);
    } else if (layout == "cp_ulysses") {
      return train_replicated<UlyssesCp>(m, text, o, p);
    } else if (layout == "fsdp") {
      return mixed ? train_sharded<DataParallel, bfloat16>(m, text, o, p)
                   : train_sharded<DataParallel, float>(m, text, o, p);
    } else if (layout == "fsdp_tp") {
      return mixed ? train_sharded<TensorSeq, bfloat16>(m, text, o, p)
                   : train_sharded<TensorSeq, float>(m, text, o, p);
    }
    return mixed ? train_sharded<RingCp, bfloat16>(m, text, o, p)
                 : train_sharded<RingCp, float>(m, text, o, p);
  };
  const Run run = train(mesh, o.layout, o.mixed, print);
  const double tokens = double(o.batch * o.seq) * std::max(1, run.timed_steps);
  bool ok = true;
  if (print) {
    const int n_timed = std::max(1, run.timed_steps);
    std::printf(
        "%.0f tokens/s (%.1f ms a step, of which %.1f ms (%.0f%%) waiting on %s)\n", tokens / run.seconds,
        1e3 * run.seconds / n_timed, 1e3 * run.blocked / n_timed, 100.0 * run.blocked / run.seconds,
        sharded ? "FSDP's all_gathers and reduce_scatters" : "DDP's buckets and the other axes' reductions");
    if (!run.sample.empty()) {
      std::printf("sample:\n%s\n", run.sample.c_str());
    }
  }
  if (o.check) {
    // The same training on one rank: a group of this rank alone, a (1, 1, 1) mesh, replicated float
    // parameters, no sample.
    const ProcessGroup one = world.new_group({world.rank()});
    Options ref = o;
    ref.sample = 0;
    ref.save.clear();
    ref.resume.clear(); // the reference trains every step from the start
    std::swap(o, ref);
    const Run want = train(init_device_mesh<Mesh>(one, 1, 1, 1), "ddp", false, false);
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
