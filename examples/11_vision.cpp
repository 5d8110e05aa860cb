// 11: a vision transformer (nn::VisionEncoder) classifying the 8x8 handwritten digits that scikit-learn ships
// (python3-sklearn installs them: scripts/deps.sh --tests; this program reads the file itself), trained in a
// chosen parallel layout by the library's trainers, its accuracy measured on a held-out split and, with
// --check, its training checked against the same training on one rank.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_11_vision --layout fsdp_tp
//   --layout tp|ddp|fsdp|hsdp|fsdp_tp   how the parameters are held and reduced (default fsdp; see
//                                       train/data_layout.hpp)
//   --steps N                           training steps (default 600), --batch B images a step (default 64)
//   --lr R --clip C                     AdamW's peak learning rate (default 3e-3), the clip (default 1)
//   --check                             also train on one rank and compare the losses and final parameters
//   --min-accuracy A                    exit 1 when the held-out accuracy is below A (default 0)
//   --data FILE                         the digits (default: scikit-learn's digits.csv.gz)
//
// The data: 1797 images of 8x8 pixels (0-16) and their digit; a fixed shuffle, the last 360 held out. Each
// image is 16 patches of 2x2 pixels (a sequence of 16 tokens of 4 values). The model: a linear patch
// embedding to 32 features, 2 encoder blocks (4 heads, non-causal attention with RoPE on the patch index,
// SwiGLU MLP of 64), a final RMSNorm, the mean over the patches and a linear map to the 10 classes;
// cross-entropy, AdamW at 3e-3 with a linear warmup over 20 steps and a cosine decay to a tenth
// (optim::WarmupCosine), the gradient clipped at 1. Measured: 0.92 of the held-out digits right after the 600
// steps (fsdp_tp on 4 processes). On a (rep, dp, tp) mesh: the batch over rep and dp, the patches over tp
// between the tensor-parallel regions (sequence parallelism).
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/vision.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/train/data_layout.hpp>
#include <dtensor/train/lr_schedule.hpp>
#include <dtensor/train/optim.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"tp">>;
using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using Model = nn::VisionEncoder<float, L>;

constexpr std::int64_t kPatches = 16, kPatchValues = 4, kClasses = 10, kHeldOut = 360;

struct Options {
  std::string layout = "fsdp";
  std::string data = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz";
  int steps = 600;
  std::int64_t batch = 64;
  bool check = false;
  double min_accuracy = 0, lr = 3e-3, clip = 1.0;
};

/// The digits: per image its 64 pixels (row-major) and its label.
struct Digits {
  std::vector<std::array<float, 64>> pixels;
  std::vector<std::int64_t> labels;
};

/// Reads the gzipped CSV (64 pixel values and the label per line) through gzip.
Digits read_digits(const std::string& path) {
  Digits d;
  FILE* in = ::popen(("gzip -dc '" + path + "' 2>/dev/null").c_str(), "r");
  DTENSOR_CHECK(in != nullptr, "11_vision: cannot run gzip to read " + path);
  std::array<int, 65> v{};
  while (true) {
    int read = 0;
    for (int k = 0; k < 65 && std::fscanf(in, k == 0 ? "%d" : ",%d", &v[std::size_t(k)]) == 1; ++k) {
      ++read;
    }
    if (read != 65) {
      break;
    }
    std::array<float, 64> p{};
    std::transform(v.begin(), v.begin() + 64, p.begin(), [](int x) { return float(x) / 16.0f - 0.5f; });
    d.pixels.push_back(p);
    d.labels.push_back(v[64]);
  }
  ::pclose(in);
  DTENSOR_CHECK(d.pixels.size() > std::size_t(kHeldOut),
                "11_vision: " + path + " holds " + std::to_string(d.pixels.size()) +
                    " digits; install scikit-learn's (scripts/deps.sh: python3-sklearn) or pass --data");
  // A fixed shuffle (the file is ordered by writer), the same on every rank.
  std::vector<std::size_t> order(d.pixels.size());
  std::iota(order.begin(), order.end(), 0);
  std::uint64_t z = 12345;
  for (std::size_t i = order.size(); i-- > 1;) {
    z = z * 6364136223846793005u + 1442695040888963407u;
    std::swap(order[i], order[std::size_t((z >> 33) % (i + 1))]);
  }
  Digits s;
  for (const std::size_t i : order) {
    s.pixels.push_back(d.pixels[i]);
    s.labels.push_back(d.labels[i]);
  }
  return s;
}

/// Images [first, first + n) of `d` (wrapping) as patches: patch (r, c) of 2x2 pixels is token 4 r + c.
std::pair<nn::images_t<L, float>, nn::labels_t<L>>
batch(const DeviceMesh<Mesh>& mesh, const Digits& d, std::int64_t first, std::int64_t n, std::int64_t count) {
  const auto at = [&](std::int64_t b) { return std::size_t((first + b) % count); };
  auto images = [&]<class... Q>(DTensor<float, 3, Mesh, Q...>*) {
    return from_global_index<float, Q...>(mesh, {n, kPatches, kPatchValues}, [&](const auto& i) {
      const std::int64_t row = (i[1] / 4) * 2 + i[2] / 2, col = (i[1] % 4) * 2 + i[2] % 2;
      return d.pixels[at(i[0])][std::size_t(row * 8 + col)];
    });
  }(static_cast<nn::images_t<L, float>*>(nullptr));
  auto labels = [&]<class... Q>(DTensor<std::int64_t, 1, Mesh, Q...>*) {
    return from_global_index<std::int64_t, Q...>(mesh, {n},
                                                 [&](const auto& i) { return d.labels[at(i[0])]; });
  }(static_cast<nn::labels_t<L>*>(nullptr));
  return {std::move(images), std::move(labels)};
}

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  double accuracy = 0;
};

Run train(const DeviceMesh<Mesh>& mesh, nn::DataLayout layout, const Digits& d, const Options& o,
          bool print) {
  const nn::TransformerConfig config{
      .hidden = 32, .heads = 4, .kv_heads = 4, .ffn = 64, .norm_eps = 1e-6, .init_std = 0.1, .causal = false};
  init::InitKeys keys(2026);
  Model model(mesh, config, {.patch_values = kPatchValues, .classes = kClasses}, /*layers=*/2, keys);
  const std::int64_t train_count = std::int64_t(d.pixels.size()) - kHeldOut;
  return nn::with_trainer(layout, mesh, std::move(model), {.max_norm = o.clip}, [&](auto& trainer) {
    optim::AdamW opt({.lr = 3e-3, .weight_decay = 0.01});
    Run run;
    for (int s = 0; s < o.steps; ++s) {
      opt.set_lr(optim::WarmupCosine{.peak = o.lr, .warmup = 20, .steps = o.steps}(s));
      const auto [images, labels] = batch(mesh, d, s * o.batch, o.batch, train_count);
      const nn::StepResult r = trainer.step(images, labels, opt);
      run.losses.push_back(r.loss);
      if (print && (s % 50 == 0 || s + 1 == o.steps)) {
        std::printf("step %3d/%d  loss %.4f  grad norm %.3f\n", s + 1, o.steps, r.loss, r.grad_norm);
        std::fflush(stdout);
      }
    }
    // The held-out images: the last kHeldOut of the shuffle, all at once.
    Digits held;
    held.pixels.assign(d.pixels.end() - kHeldOut, d.pixels.end());
    held.labels.assign(d.labels.end() - kHeldOut, d.labels.end());
    const auto [images, labels] = batch(mesh, held, 0, kHeldOut, kHeldOut);
    trainer.with_gathered([&](auto& m) {
      const auto logits = nn::model_forward(m, images).full_tensor();
      int right = 0;
      for (std::int64_t i = 0; i < kHeldOut; ++i) {
        const float* row = logits.data() + i * kClasses;
        right += std::max_element(row, row + kClasses) - row == held.labels[std::size_t(i)] ? 1 : 0;
      }
      run.accuracy = double(right) / double(kHeldOut);
      nn::for_each_tensor(nn::model_parameters(m), [&](const auto& w) {
        const auto full = w.full_tensor();
        run.params.emplace_back(full.data(), full.data() + full.numel());
      });
    });
    return run;
  });
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "11_vision: %s\nusage: 11_vision [--layout tp|ddp|fsdp|hsdp|fsdp_tp] [--steps N] [--batch B] "
               "[--check] [--min-accuracy A] [--data FILE]\n",
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--check") {
      o.check = true;
      continue;
    }
    if (i + 1 >= argc) {
      usage(a + " needs a value");
    }
    const std::string v = argv[++i];
    if (a == "--layout") {
      o.layout = v;
    } else if (a == "--data") {
      o.data = v;
    } else if (a == "--steps") {
      o.steps = std::atoi(v.c_str());
    } else if (a == "--batch") {
      o.batch = std::atoll(v.c_str());
    } else if (a == "--clip") {
      o.clip = std::atof(v.c_str());
    } else if (a == "--lr") {
      o.lr = std::atof(v.c_str());
    } else if (a == "--min-accuracy") {
      o.min_accuracy = std::atof(v.c_str());
    } else {
      usage("unknown flag " + a);
    }
  }
  if (o.steps < 1 || o.batch < 1) {
    usage("--steps and --batch must be at least 1");
  }
  return o;
}

} // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  nn::DataLayout layout{};
  try {
    layout = nn::parse_data_layout(o.layout);
  } catch (const Error& e) {
    usage(e.what());
  }
  if (o.data == Options{}.data && !std::filesystem::exists(o.data)) { // ctest's skip: the package is missing
    std::printf("11_vision: %s is missing (scripts/deps.sh --tests installs python3-sklearn): skipped\n",
                o.data.c_str());
    return 77;
  }
  ProcessGroup world = init_process_group();
  const bool print = world.rank() == 0;
  const Digits digits = read_digits(o.data);
  const auto [rep, dp, tp] = nn::data_layout_mesh(layout, world.size());
  if (print) {
    std::printf("a vision transformer on %zu digits (%lld held out), %d steps of %lld images, layout %s on "
                "(rep=%d, dp=%d, tp=%d) over %s\n",
                digits.pixels.size(), (long long)kHeldOut, o.steps, (long long)o.batch, o.layout.c_str(), rep,
                dp, tp, std::string(world.backend_name()).c_str());
  }
  const Run got = train(init_device_mesh<Mesh>(world, rep, dp, tp), layout, digits, o, print);
  bool ok = got.accuracy >= o.min_accuracy;
  if (print) {
    std::printf("held-out accuracy %.3f (%d of %lld)%s\n", got.accuracy,
                int(std::lround(got.accuracy * kHeldOut)), (long long)kHeldOut,
                ok ? "" : ", below --min-accuracy");
  }
  if (o.check) { // the same training on one rank: a group of this rank alone, replicated parameters
    const ProcessGroup one = world.new_group({world.rank()});
    const Run want = train(init_device_mesh<Mesh>(one, 1, 1, 1), nn::DataLayout::ddp, digits, o, false);
    double diff = 0;
    for (std::size_t s = 0; s < want.losses.size(); ++s) {
      diff = std::max(diff, std::abs(got.losses[s] - want.losses[s]) / std::abs(want.losses[s]));
    }
    for (std::size_t i = 0; i < want.params.size() && i < got.params.size(); ++i) {
      for (std::size_t e = 0; e < want.params[i].size(); ++e) {
        const double x = got.params[i][e], y = want.params[i][e];
        diff = std::max(diff, std::abs(x - y) / std::max(1.0, std::abs(y)));
      }
    }
    const bool same = got.params.size() == want.params.size() && diff <= 1e-4;
    ok = ok && same;
    if (print || !same) {
      std::printf("rank %d against one rank: max relative difference of the losses and parameters %.1e "
                  "(tolerance 1e-4): %s\n",
                  world.rank(), diff, same ? "OK" : "MISMATCH");
    }
  }
  return ok ? 0 : 1;
}
