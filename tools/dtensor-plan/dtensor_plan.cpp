// dtensor-plan: which layout of a GPT-style model fits on a cluster, what it moves over each link tier and
// how long its step takes, from dry runs of the library's real training step (plan/dry_run.hpp): rank 0 of
// the whole world runs one step alone on the fake backend with meta tensors, for every layout.
//
//   dtensor-plan --model llama-70b --nodes 128 --gpus-per-node 8 --gpu-memory 80GiB [--json plan.json]
//
// The model: nn::LanguageModel of nn::TransformerBlock (token embedding, RoPE, causal grouped-query
// attention, SwiGLU MLP, RMSNorm, untied head), float parameters in FSDP shards, gathered and computed in
// bfloat16, gradients reduced in float, AdamW (nn::FsdpTrainer, as torchtitan trains by default). The
// layouts: FSDP over dp, tensor + sequence parallel over tp (within a node), ring context parallel over cp,
// and the micro-batch (the local batch split into accumulation steps); dp x cp x tp is every GPU. Each
// layout runs two steps and measures the second (which holds the optimizer's state). Its table row: memory
// of rank 0's tensors at the step's peak by category and whether it fits, bytes this
// rank receives per step over NVLink and over the network, the estimated step (compute at the cluster's
// GEMM rate, plus the communication the schedule does not hide: plan/comm_time.hpp's timeline), MFU, and
// the dry run's own seconds; sorted by the estimated step, those that fit first.
//
// Flags (presets: llama-8b, llama-70b, llama-405b, gpt3-175b, tiny; explicit flags after --model override):
//   --layers --hidden --heads --kv-heads --ffn --vocab --seq N   the model and its sequence length
//   --global-batch N       sequences a step (all dp ranks together)
//   --nodes N --gpus-per-node G --gpu-memory 80GiB               the cluster (GiB or GB; default DGX H100)
//   --cluster FILE         a ClusterModel config file (plan/time_model.hpp's keys), before the flags above
//   --tp a,b,... --cp a,b,... --micro-batch a,b,...              the degrees tried (defaults below)
//   --json FILE            every layout as JSON
//   --top N                rows printed (default 20; the JSON has all)

#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/parallel/fsdp.hpp>
#include <dtensor/parallel/layers/block.hpp>
#include <dtensor/parallel/layers/model.hpp>
#include <dtensor/parallel/layers/trainer.hpp>
#include <dtensor/parallel/optim.hpp>
#include <dtensor/plan/dry_run.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"dp">, Axis<"cp">, Axis<"tp">>;
using Layout =
    nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel, nn::ContextParallel<Ring<"cp">>>;
using Gpt = nn::LanguageModel<float, Layout, nn::TransformerBlock>;
using Trainer = nn::FsdpTrainer<Gpt, Fsdp<"dp">, bfloat16, float>;

struct Model {
  std::string name;
  std::int64_t layers = 0, seq = 0, global_batch = 0;
  nn::TransformerConfig config;
};

/// The presets: each from its paper or model card.
Model preset(const std::string& name) {
  Model m;
  m.name = name;
  auto set = [&](std::int64_t layers, std::int64_t hidden, std::int64_t heads, std::int64_t kv,
                 std::int64_t ffn, std::int64_t vocab, std::int64_t seq, std::int64_t batch) {
    m.layers = layers, m.seq = seq, m.global_batch = batch;
    m.config = {
        .vocab = vocab, .hidden = hidden, .heads = heads, .kv_heads = kv, .ffn = ffn, .rope_base = 500000};
  };
  if (name == "llama-8b") { // Llama 3 paper, table 3; 4M tokens a step at 8K sequences (section 3.4.1)
    set(32, 4096, 32, 8, 14336, 128256, 8192, 512);
  } else if (name == "llama-70b") { // Llama 3 paper, table 3
    set(80, 8192, 64, 8, 28672, 128256, 8192, 512);
  } else if (name == "llama-405b") { // Llama 3 paper, table 3; 16M tokens a step at 8K sequences
    set(126, 16384, 128, 8, 53248, 128256, 8192, 2048);
  } else if (name == "gpt3-175b") { // Megatron-LM (Narayanan et al. 2021), table 1: batch 1536 of 2048
    set(96, 12288, 96, 96, 4 * 12288, 51200, 2048, 1536);
  } else if (name == "tiny") { // for tests: seconds on a laptop
    set(2, 64, 4, 2, 128, 256, 64, 16);
  } else {
    throw std::invalid_argument("unknown --model " + name +
                                " (llama-8b, llama-70b, llama-405b, gpt3-175b, tiny)");
  }
  return m;
}

struct Options {
  Model model = preset("llama-8b");
  int nodes = 1;
  ClusterModel cluster = dgx_h100();
  std::vector<int> tp{1, 2, 4, 8}, cp{1, 2, 4, 8}, micro{1, 2, 4};
  std::string json;
  int top = 20;
};

struct Candidate {
  int dp = 1, cp = 1, tp = 1;
  std::int64_t micro_batch = 1; ///< sequences a micro-batch, per dp rank
  std::int64_t accumulation = 1;
  DryRun run{};
  std::string error{}; ///< the dry run failed (the layout cannot exist): why
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "dtensor-plan: %s\nusage: dtensor-plan [--model llama-8b|llama-70b|llama-405b|gpt3-175b|tiny] "
               "[--layers N] [--hidden N] [--heads N] [--kv-heads N] [--ffn N] [--vocab N] [--seq N] "
               "[--global-batch N] [--nodes N] [--gpus-per-node G] [--gpu-memory 80GiB] [--cluster FILE] "
               "[--tp a,b] [--cp a,b] [--micro-batch a,b] [--json FILE] [--top N]\n",
               why.c_str());
  std::exit(2);
}

std::vector<int> int_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    v.push_back(std::stoi(item));
  }
  return v;
}

/// "80GiB", "141GB", "80" (GiB).
double parse_bytes(const std::string& s) {
  std::size_t used = 0;
  const double v = std::stod(s, &used);
  const std::string unit = s.substr(used);
  if (unit.empty() || unit == "GiB") {
    return v * double(1LL << 30);
  }
  if (unit == "GB") {
    return v * 1e9;
  }
  throw std::invalid_argument("--gpu-memory " + s + ": GiB or GB");
}

Options parse(int argc, char** argv) {
  Options o;
  int gpus = -1;
  double memory = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage(a + " needs a value");
      }
      return argv[++i];
    };
    auto number = [&] { return std::stoll(value()); };
    nn::TransformerConfig& c = o.model.config;
    if (a == "--model") {
      o.model = preset(value());
    } else if (a == "--layers") {
      o.model.layers = number();
    } else if (a == "--hidden") {
      c.hidden = number();
    } else if (a == "--heads") {
      c.heads = number();
    } else if (a == "--kv-heads") {
      c.kv_heads = number();
    } else if (a == "--ffn") {
      c.ffn = number();
    } else if (a == "--vocab") {
      c.vocab = number();
    } else if (a == "--seq") {
      o.model.seq = number();
    } else if (a == "--global-batch") {
      o.model.global_batch = number();
    } else if (a == "--nodes") {
      o.nodes = int(number());
    } else if (a == "--gpus-per-node") {
      gpus = int(number());
    } else if (a == "--gpu-memory") {
      memory = parse_bytes(value());
    } else if (a == "--cluster") {
      std::ifstream in(value());
      if (!in) {
        usage("cannot read " + std::string(argv[i]));
      }
      o.cluster = parse_cluster_model(std::string(std::istreambuf_iterator<char>(in), {}));
    } else if (a == "--tp") {
      o.tp = int_list(value());
    } else if (a == "--cp") {
      o.cp = int_list(value());
    } else if (a == "--micro-batch") {
      o.micro = int_list(value());
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--top") {
      o.top = int(number());
    } else {
      usage("unknown argument " + a);
    }
  }
  if (gpus > 0) {
    o.cluster.gpus_per_node = gpus;
  }
  if (memory > 0) {
    o.cluster.gpu_memory_bytes = memory;
  }
  if (o.nodes < 1 || o.model.layers < 1 || o.model.seq < 1 || o.model.global_batch < 1) {
    usage("--nodes, --layers, --seq and --global-batch must be positive");
  }
  return o;
}

/// The layouts to dry-run: dp x cp x tp = every GPU, tp within a node and dividing the heads, kv heads and
/// ffn, cp dividing the sequence, the global batch over dp, each micro-batch size that divides the local
/// batch.
std::vector<Candidate> enumerate(const Options& o) {
  const nn::TransformerConfig& c = o.model.config;
  const int world = o.nodes * o.cluster.gpus_per_node;
  std::vector<Candidate> out;
  for (int tp : o.tp) {
    if (tp < 1 || tp > o.cluster.gpus_per_node || c.heads % tp || c.kv_head_count() % tp || c.ffn % tp) {
      continue;
    }
    for (int cp : o.cp) {
      if (cp < 1 || o.model.seq % cp || world % (tp * cp)) {
        continue;
      }
      const int dp = world / (tp * cp);
      if (o.model.global_batch % dp) {
        continue;
      }
      const std::int64_t local = o.model.global_batch / dp;
      for (int mb : o.micro) {
        if (mb >= 1 && local % mb == 0) {
          out.push_back({.dp = dp, .cp = cp, .tp = tp, .micro_batch = mb, .accumulation = local / mb});
        }
      }
    }
  }
  return out;
}

/// Two steps of the layout in the dry run `ctx`, the second measured: it holds the optimizer's state the
/// first one made.
void steps(const Options& o, const Candidate& l, DryRunContext& ctx) {
  const Device device = ctx.device();
  const auto mesh = init_device_mesh<Mesh>(ctx.world(), l.dp, l.cp, l.tp);
  init::InitKeys keys(1);
  Trainer trainer(mesh, Gpt(mesh, o.model.config, o.model.layers, keys, device),
                  {.schedule = {.prefetch = 1, .reshard_after_forward = true, .max_reductions = 2}});
  optim::AdamW opt({.lr = 1e-4});
  std::vector<std::pair<nn::ids_t<Layout>, nn::ids_t<Layout>>> micro;
  for (std::int64_t k = 0; k < l.accumulation; ++k) {
    auto ids = [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
      return zeros<std::int64_t, Q...>(mesh, {l.micro_batch * l.dp, o.model.seq}, device);
    }(static_cast<nn::ids_t<Layout>*>(nullptr));
    micro.emplace_back(ids, ids);
  }
  (void)trainer.step(std::span(micro), opt);
  ctx.begin_step();
  (void)trainer.step(std::span(micro), opt);
}

/// The model's flops a step over the whole cluster, as papers count them for MFU: 6 x the GEMMs'
/// parameters x the tokens, and the attention's score and value GEMMs over the pairs the causal mask keeps,
/// forward and backward (3 x the forward). Not the recomputation (the blocks' forward again in the backward,
/// which the dry run counts: HFU).
double model_flops(const Model& m) {
  const nn::TransformerConfig& c = m.config;
  const double h = double(c.hidden), hd = double(c.head_dim()), s = double(m.seq);
  const double per_layer = h * h * 2 + 2 * h * double(c.kv_head_count()) * hd + 3 * h * double(c.ffn);
  const double params = per_layer * double(m.layers) + h * double(c.vocab);
  const double tokens = double(m.global_batch) * s;
  const double attention =
      3 * 2 * double(c.heads) * (s * (s + 1) / 2) * 2 * hd * double(m.layers) * double(m.global_batch);
  return 6 * params * tokens + attention;
}

std::string gib(std::int64_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f", double(bytes) / double(1LL << 30));
  return s;
}

std::string row(const Candidate& l, double mfu) {
  char s[400];
  if (!l.error.empty()) {
    std::snprintf(s, sizeof s, "%4d %3d %3d %3lld %4lld  cannot run: %s", l.dp, l.cp, l.tp,
                  (long long)l.micro_batch, (long long)l.accumulation, l.error.c_str());
    return s;
  }
  const DryRun& r = l.run;
  auto at = [&](MemoryCategory c) { return gib(r.memory.at_peak[std::size_t(c)]); };
  std::snprintf(
      s, sizeof s,
      "%4d %3d %3d %3lld %4lld %7s %4s %6s %6s %6s %6s %6s %9.3f %9.3f %9.3f %9.3f %5.1f %5.1f %6.2f", l.dp,
      l.cp, l.tp, (long long)l.micro_batch, (long long)l.accumulation, gib(r.memory.peak_total).c_str(),
      r.fits ? "yes" : "no", at(MemoryCategory::parameters).c_str(), at(MemoryCategory::gradients).c_str(),
      at(MemoryCategory::optimizer_state).c_str(), at(MemoryCategory::activations).c_str(),
      at(MemoryCategory::communication).c_str(), double(r.bytes_nvlink) * 1e-9,
      double(r.bytes_network) * 1e-9, r.time.seconds, r.time.exposed, 100 * mfu, 100 * r.hfu, r.wall_seconds);
  return s;
}

} // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const nn::TransformerConfig& c = o.model.config;
    const int world = o.nodes * o.cluster.gpus_per_node;
    std::printf(
        "model %s: %lld layers, hidden %lld, %lld heads (%lld kv), ffn %lld, vocab %lld; %lld sequences "
        "of %lld a step\ncluster %s: %d nodes x %d GPUs (%d), %s GiB each, %.0f TFLOPS at %.0f %%\n",
        o.model.name.c_str(), (long long)o.model.layers, (long long)c.hidden, (long long)c.heads,
        (long long)c.kv_head_count(), (long long)c.ffn, (long long)c.vocab, (long long)o.model.global_batch,
        (long long)o.model.seq, o.cluster.name.c_str(), o.nodes, o.cluster.gpus_per_node, world,
        gib(std::int64_t(o.cluster.gpu_memory_bytes)).c_str(), o.cluster.peak_tflops,
        100 * o.cluster.gemm_efficiency);
    std::vector<Candidate> layouts = enumerate(o);
    if (layouts.empty()) {
      std::fprintf(stderr,
                   "dtensor-plan: no layout divides this model and cluster (--tp, --cp, --micro-batch)\n");
      return 1;
    }
    for (Candidate& l : layouts) {
      try {
        l.run = dry_run({.rank = 0, .world_size = world, .cluster = o.cluster},
                        [&](DryRunContext& ctx) { steps(o, l, ctx); });
      } catch (const std::exception& e) {
        l.error = e.what();
        l.error = l.error.substr(0, l.error.find('\n'));
      }
    }
    std::stable_sort(layouts.begin(), layouts.end(), [](const Candidate& a, const Candidate& b) {
      const auto key = [](const Candidate& l) {
        return std::pair{l.error.empty() ? (l.run.fits ? 0 : 1) : 2,
                         l.error.empty() ? l.run.time.seconds : 0.0};
      };
      return key(a) < key(b);
    });
    const double flops_per_gpu = model_flops(o.model) / world;
    const auto mfu = [&](const Candidate& l) {
      return l.run.time.seconds > 0 ? flops_per_gpu / (l.run.time.seconds * o.cluster.peak_tflops * 1e12)
                                    : 0.0;
    };
    std::printf("\n%4s %3s %3s %3s %4s %7s %4s %6s %6s %6s %6s %6s %9s %9s %9s %9s %5s %5s %6s\n", "dp", "cp",
                "tp", "mb", "acc", "peak", "fits", "param", "grad", "optim", "act", "comm", "NVLink",
                "network", "step", "exposed", "MFU", "HFU", "dry");
    std::printf("%4s %3s %3s %3s %4s %7s %4s %6s %6s %6s %6s %6s %9s %9s %9s %9s %5s %5s %6s\n", "", "", "",
                "", "", "GiB", "", "GiB", "GiB", "GiB", "GiB", "GiB", "GB", "GB", "s", "s", "%", "%", "s");
    for (std::size_t i = 0; i < layouts.size() && int(i) < o.top; ++i) {
      std::printf("%s\n", row(layouts[i], mfu(layouts[i])).c_str());
    }
    std::printf(
        "(rank 0's tensors at the step's peak; bytes it receives a step; mb: sequences a micro-batch per dp "
        "rank, acc: micro-batches a step; MFU: the model's flops, HFU: with the blocks' recomputation; "
        "dry: the dry run's own seconds)\n");
    if (!o.json.empty()) {
      std::ofstream out(o.json);
      out << "{\"model\": \"" << o.model.name << "\", \"world_size\": " << world << ", \"cluster\": \""
          << o.cluster.name << "\", \"layouts\": [";
      for (std::size_t i = 0; i < layouts.size(); ++i) {
        const Candidate& l = layouts[i];
        out << (i ? ", " : "") << "{\"dp\": " << l.dp << ", \"cp\": " << l.cp << ", \"tp\": " << l.tp
            << ", \"micro_batch\": " << l.micro_batch << ", \"accumulation\": " << l.accumulation;
        if (l.error.empty()) {
          out << ", \"mfu\": " << mfu(l) << ", \"dry_run\": " << l.run.to_json() << "}";
        } else {
          std::string e;
          for (char ch : l.error) {
            e += ch == '"' || ch == '\\' ? std::string("\\") + ch : std::string(1, ch);
          }
          out << ", \"error\": \"" << e << "\"}";
        }
      }
      out << "]}\n";
      if (!out) {
        std::fprintf(stderr, "dtensor-plan: cannot write %s\n", o.json.c_str());
        return 1;
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtensor-plan: %s\n", e.what());
    return 1;
  }
}
