// The full training state in a sharded checkpoint (parallel/train_state.hpp): a small GPT of nn layers
// (embedding, one block with GQA attention and a SwiGLU MLP, a final norm, the head) trained with AdamW in
// double, saved after 2 steps and resumed for 2 more:
//  - on the same layout (replicated parameters on 2 ranks; FSDP groups on 2 ranks): the losses and the final
//    parameters equal those of the uninterrupted run bit for bit;
//  - onto other layouts and rank counts (saved under FSDP x TP on (dp=2, tp=2), resumed replicated under TP
//    on 2 ranks and on one rank; saved replicated under TP, resumed under FSDP on 3 ranks): equal to the
//    uninterrupted one-rank run within 1e-10;
//  - the progress (step, data position, random stream) comes back as saved; a model of other shapes is an
//    error naming the parameter.
#include <catch2/catch.hpp>

#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/parallel/layers.hpp>
#include <dtensor/parallel/optim.hpp>
#include <dtensor/parallel/schedule.hpp>
#include <dtensor/parallel/train_state.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"dp">, Axis<"cp">, Axis<"tp">>;
using Dp = nn::Layout<Mesh>;
using TpSp = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

const nn::TransformerConfig config{
    .vocab = 13, .hidden = 8, .heads = 4, .kv_heads = 2, .ffn = 10, .rope_base = 100, .init_std = 0.5};

/// The model's layers in layout L (double).
template <class L>
struct Model {
  nn::Embedding<double, L> emb;
  nn::TransformerBlock<double, L> block;
  nn::RmsNorm<double, L> norm;
  nn::LmHead<double, L> head;

  static Model init(const DeviceMesh<Mesh>& mesh) {
    init::InitKeys keys(5);
    auto emb = nn::Embedding<double, L>(mesh, config.vocab, config.hidden, keys.next(), 1.0);
    auto block = nn::TransformerBlock<double, L>(mesh, config, keys);
    return {emb, block, nn::RmsNorm<double, L>(mesh, config.hidden),
            nn::LmHead<double, L>(mesh, config.vocab, config.hidden, keys.next(), 0.5)};
  }
};

/// Step `step`'s ids and targets (batch 3, seq 5): a pattern of the step.
template <class L>
std::pair<nn::ids_t<L>, nn::ids_t<L>> batch(const DeviceMesh<Mesh>& mesh, std::int64_t step) {
  auto make = [&](std::int64_t shift) {
    return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
      return from_global_index<std::int64_t, Q...>(mesh, {3, 5}, [&](const auto& i) {
        return (i[0] * 7 + i[1] * 3 + step * 5 + shift + i[1] * i[1]) % config.vocab;
      });
    }(static_cast<nn::ids_t<L>*>(nullptr));
  };
  return {make(0), make(1)};
}

/// What a run gives: the losses of its steps and the final parameters (full).
struct Run {
  std::vector<double> losses;
  std::vector<std::vector<double>> params;
  TrainingProgress progress;
};

template <class P>
void append_full(const P& w, std::vector<std::vector<double>>& out) {
  const auto full = w.full_tensor();
  out.emplace_back(full.data(), full.data() + full.numel());
}

const optim::AdamWOptions adamw{.lr = 1e-2, .weight_decay = 0.01};

/// Steps [first, last) with replicated parameters in layout L: each gradient reduced to its parameter's
/// placements, AdamW per parameter. Loads `from` first (unless empty), saves into `to` at the end (unless
/// empty).
template <class L>
Run train_replicated(const DeviceMesh<Mesh>& mesh, int first, int last, const std::string& from,
                     const std::string& to) {
  Model<L> m = Model<L>::init(mesh);
  auto params =
      std::tuple_cat(m.emb.parameters(), m.block.parameters(), m.norm.parameters(), m.head.parameters());
  optim::AdamW opt(adamw);
  Run run;
  if (!from.empty()) {
    run.progress = load_training_state(from, opt, params);
    expect(run.progress.step == first, "the resumed step " + std::to_string(run.progress.step));
  }
  for (int s = first; s < last; ++s) {
    const auto [ids, targets] = batch<L>(mesh, s);
    auto [h0, emb_back] = m.emb.forward(ids, with_backward);
    auto [h1, block_back] = m.block.forward(h0, with_backward);
    auto [n, norm_back] = m.norm.forward(h1, with_backward);
    auto [loss, head_back] = m.head.forward(n, targets, with_backward);
    run.losses.push_back(loss.full_tensor().data()[0]);
    auto [dn, head_grads] = head_back(1.0);
    auto [dh1, norm_grads] = norm_back(dn);
    auto [dh0, block_grads] = block_back(dh1);
    const auto grads = std::tuple_cat(emb_back(dh0).params, block_grads, norm_grads, head_grads);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (opt.step(
           int(I), std::get<I>(params),
           nn::detail::gradient_as<std::remove_cvref_t<decltype(std::get<I>(params))>>(std::get<I>(grads))),
       ...);
    }
    (std::make_index_sequence<std::tuple_size_v<decltype(params)>>{});
  }
  if (!to.empty()) {
    save_training_state(to, opt, {.step = last, .data_position = 3 * last, .rng_seed = 17, .rng_offset = 4},
                        params);
  }
  std::apply([&](const auto&... w) { (append_full(w, run.params), ...); }, params);
  return run;
}

/// The same with FSDP over dp: one group for the embedding, one for the block, one for the norm and head.
template <class L>
Run train_sharded(const DeviceMesh<Mesh>& mesh, int first, int last, const std::string& from,
                  const std::string& to) {
  Model<L> m = Model<L>::init(mesh);
  using EmbGroup = FlatParamGroup<double, Mesh, Fsdp<"dp">, nn::params_of<nn::Embedding<double, L>>>;
  using BlockGroup = FlatParamGroup<double, Mesh, Fsdp<"dp">, nn::params_of<nn::TransformerBlock<double, L>>>;
  using HeadGroup = FlatParamGroup<double, Mesh, Fsdp<"dp">,
                                   nn::params_of_layers<nn::RmsNorm<double, L>, nn::LmHead<double, L>>>;
  auto make = [](auto tag, const auto& p) {
    return std::apply([](const auto&... w) { return typename decltype(tag)::type(w...); }, p);
  };
  EmbGroup ge = make(std::type_identity<EmbGroup>{}, m.emb.parameters());
  BlockGroup gb = make(std::type_identity<BlockGroup>{}, m.block.parameters());
  HeadGroup gh =
      make(std::type_identity<HeadGroup>{}, std::tuple_cat(m.norm.parameters(), m.head.parameters()));
  optim::AdamW opt(adamw);
  Run run;
  if (!from.empty()) {
    run.progress = load_training_state(from, opt, ge, gb, gh);
    expect(run.progress.step == first, "the resumed step " + std::to_string(run.progress.step));
  }
  for (int s = first; s < last; ++s) {
    const auto [ids, targets] = batch<L>(mesh, s);
    FsdpSchedule sched;
    sched.add(ge);
    sched.add(gb);
    sched.add(gh);
    const auto h0 = sched.forward(ge, [&](const auto& w) { return m.emb.with_parameters(w).forward(ids); });
    const auto h1 =
        sched.forward(gb, [&](const auto&... p) { return m.block.with_parameters(p...).forward(h0); });
    std::optional<nn::act_t<L, double>> dh;
    sched.backward(gh, [&](const auto& g, const auto& w) {
      auto [n, norm_back] = m.norm.with_parameters(g).forward(h1, with_backward);
      auto [loss, head_back] = m.head.with_parameters(w).forward(n, targets, with_backward);
      run.losses.push_back(loss.full_tensor().data()[0]);
      auto [dn, head_grads] = head_back(1.0);
      auto [d, norm_grads] = norm_back(dn);
      dh.emplace(d);
      return std::tuple_cat(norm_grads, head_grads);
    });
    sched.backward(gb, [&](const auto&... p) {
      auto [dx, grads] = m.block.with_parameters(p...).forward(h0, with_backward).backward(*dh);
      dh.emplace(dx);
      return grads;
    });
    sched.backward(ge, [&](const auto& w) {
      return m.emb.with_parameters(w).forward(ids, with_backward).backward(*dh).params;
    });
    sched.finish();
    opt.step(0, ge);
    opt.step(1, gb);
    opt.step(2, gh);
    ge.zero_grad();
    gb.zero_grad();
    gh.zero_grad();
  }
  if (!to.empty()) {
    save_training_state(to, opt, {.step = last, .data_position = 3 * last, .rng_seed = 17, .rng_offset = 4},
                        ge, gb, gh);
  }
  std::apply([&](const auto&... w) { (append_full(w, run.params), ...); },
             ge.unflatten_shard(ge.local_param()));
  std::apply([&](const auto&... w) { (append_full(w, run.params), ...); },
             gb.unflatten_shard(gb.local_param()));
  std::apply([&](const auto&... w) { (append_full(w, run.params), ...); },
             gh.unflatten_shard(gh.local_param()));
  return run;
}

/// `tail` equals the last steps of `whole`, within `tol` (0: bit for bit).
void compare(const Run& tail, const Run& whole, double tol, const std::string& name) {
  const std::size_t skip = whole.losses.size() - tail.losses.size();
  for (std::size_t s = 0; s < tail.losses.size(); ++s) {
    const double d = std::abs(tail.losses[s] - whole.losses[skip + s]);
    expect(d <= tol * std::abs(whole.losses[skip + s]),
           name + ": step " + std::to_string(skip + s + 1) + "'s loss " + std::to_string(tail.losses[s]) +
               ", uninterrupted " + std::to_string(whole.losses[skip + s]));
  }
  expect(tail.params.size() == whole.params.size(), name + ": the number of parameters");
  for (std::size_t i = 0; i < whole.params.size(); ++i) {
    for (std::size_t e = 0; e < whole.params[i].size(); ++e) {
      const double d = std::abs(tail.params[i][e] - whole.params[i][e]);
      expect(d <= tol * std::max(1.0, std::abs(whole.params[i][e])),
             name + ": parameter " + std::to_string(i) + " element " + std::to_string(e) + " differs by " +
                 std::to_string(d));
    }
  }
}

std::string scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("dtensor_train_state_" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

} // namespace

TEST_CASE("training state: resumed on the same layout, the run goes on bit for bit",
          "[parallel][checkpoint]") {
  SECTION("replicated parameters, tensor + sequence parallel on 2 ranks") {
    const std::string dir = scratch("tp");
    testing::run_ranks(2, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, 1, 1, 2);
      const Run whole = train_replicated<TpSp>(mesh, 0, 4, "", "");
      train_replicated<TpSp>(mesh, 0, 2, "", dir);
      const Run tail = train_replicated<TpSp>(mesh, 2, 4, dir, "");
      compare(tail, whole, 0, "tp resumed on tp");
      expect(tail.progress.data_position == 6 && tail.progress.rng_seed == 17 &&
                 tail.progress.rng_offset == 4,
             "the progress comes back as saved");
    });
  }
  SECTION("FSDP groups on 2 ranks") {
    const std::string dir = scratch("fsdp");
    testing::run_ranks(2, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, 2, 1, 1);
      const Run whole = train_sharded<Dp>(mesh, 0, 4, "", "");
      train_sharded<Dp>(mesh, 0, 2, "", dir);
      const Run tail = train_sharded<Dp>(mesh, 2, 4, dir, "");
      compare(tail, whole, 0, "fsdp resumed on fsdp");
    });
  }
}

TEST_CASE("training state: saved on one layout, resumed on another and on other rank counts, as one rank",
          "[parallel][checkpoint]") {
  Run whole;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    whole = train_replicated<Dp>(init_device_mesh<Mesh>(one, 1, 1, 1), 0, 4, "", "");
  });
  const std::string from_fsdp_tp = scratch("fsdp_tp");
  testing::run_ranks(4, [&](ProcessGroup& world) {
    train_sharded<TpSp>(init_device_mesh<Mesh>(world, 2, 1, 2), 0, 2, "", from_fsdp_tp);
  });
  testing::run_ranks(2, [&](ProcessGroup& world) {
    const Run tail = train_replicated<TpSp>(init_device_mesh<Mesh>(world, 1, 1, 2), 2, 4, from_fsdp_tp, "");
    compare(tail, whole, 1e-10, "saved under fsdp x tp on 4, resumed under tp on 2");
  });
  testing::run_ranks(1, [&](ProcessGroup& one) {
    const Run tail = train_replicated<Dp>(init_device_mesh<Mesh>(one, 1, 1, 1), 2, 4, from_fsdp_tp, "");
    compare(tail, whole, 1e-10, "saved under fsdp x tp on 4, resumed on one rank");
  });
  const std::string from_tp = scratch("tp_to_fsdp");
  testing::run_ranks(2, [&](ProcessGroup& world) {
    train_replicated<TpSp>(init_device_mesh<Mesh>(world, 1, 1, 2), 0, 2, "", from_tp);
  });
  testing::run_ranks(3, [&](ProcessGroup& world) {
    const Run tail = train_sharded<Dp>(init_device_mesh<Mesh>(world, 3, 1, 1), 2, 4, from_tp, "");
    compare(tail, whole, 1e-10, "saved under tp on 2, resumed under fsdp on 3");
  });
  SECTION("a model of other shapes: an error naming the parameter") {
    testing::run_ranks(1, [&](ProcessGroup& one) {
      const auto mesh = init_device_mesh<Mesh>(one, 1, 1, 1);
      init::InitKeys keys(1);
      nn::Embedding<double, Dp> emb(mesh, config.vocab + 1, config.hidden, keys.next());
      optim::AdamW opt(adamw);
      try {
        load_training_state(from_tp, opt, emb.parameters());
        expect(false, "no error for a vocabulary of another size");
      } catch (const Error& e) {
        expect(std::string(e.what()).find("parameter 0 has global shape (14, 8), the checkpoint's (13, 8)") !=
                   std::string::npos,
               std::string("the message: ") + e.what());
      }
    });
  }
}
