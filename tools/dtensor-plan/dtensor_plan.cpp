// dtensor-plan: which layout of a GPT-style model fits on a cluster, what it moves over each link tier and
// how long its step takes, from dry runs of the library's real training step (plan/dry_run.hpp): a rank of
// the whole world runs the step alone on the fake backend with meta tensors, for every layout.
//
//   dtensor-plan --model llama-70b --nodes 128 --gpus-per-node 8 --gpu-memory 80GiB [--json plan.json]
//
// The model: nn::LanguageModel of nn::TransformerBlock (token embedding, RoPE, causal grouped-query
// attention, SwiGLU MLP or a mixture of SwiGLU experts, RMSNorm, untied head), float parameters in FSDP
// shards, gathered and computed in bfloat16 (--dtype fp32: float), gradients reduced in float, AdamW: one
// model family (GptFamily) of nn::plan_layouts (train/plan_layouts.hpp), which plans any model of the
// contract and says how: the layouts (FSDP or HSDP over dp, experts over ep, pipelines over pp, ring context
// parallel over cp for dense models, tensor + sequence parallel over tp within a node, the micro-batch), the
// representative ranks, the step and its pipeline idle. Each layout's table row: memory at the step's peak by
// category (the representative with the higher peak) and whether it fits, bytes received per step over
// NVLink and over the network, the step, its pipeline idle and exposed communication, MFU (the model's
// flops: model_flops), HFU (the flops run: a stage's mean, of the busiest cp rank) and the dry runs' own
// seconds; sorted by the step, those that fit first.
//
// Flags (presets: llama-8b, llama-70b, llama-405b, gpt3-175b, mixtral-8x7b, tiny, tiny-moe; explicit flags
// after --model override them):
//   --layers --hidden --heads --kv-heads --ffn --vocab --seq N   the model and its sequence length
//   --global-batch N       sequences a step (all dp ranks together)
//   --nodes N --gpus-per-node G --gpu-memory 80GiB               the cluster (GiB or GB; default DGX H100)
//   --cluster FILE|NAME    a ClusterModel config file (plan/time_model.hpp's keys) or a preset (dgx_h100,
//                          dgx_h200, dgx_a100), before the flags above
//   --tp a,b,... --cp a,b,... --pp a,b,...                      the degrees tried (default 1,2,4,8 each)
//   --chunks a,b,...       model stages per pp rank (default 1,2)
//   --zero-bubble          pipelines also under ZB-H1 and ZB-V (B and W apart: train/pipeline_schedule.hpp)
//   --micro-batch a,b,...  sequences a micro-batch per dp rank (default 1,2,4)
//   --replicas a,b,...     HSDP: dp as replicas x FSDP over dp / (replicas ep) (default 1: FSDP over all of
//                          dp; replicas = dp: DDP)
//   --experts N --top-k K --expert-ffn N                         a mixture of experts in every block
//   --ep a,b,...           MoE: the experts sharded over this many of the dp ranks (default 1,2,4,8)
//   --dtype bf16|fp32      the compute type (default bf16: float shards gathered and computed in bfloat16);
//                          fp32 computes in float, at the cluster's TF32 rate
//   --recompute            pipelines recompute the blocks' forward in the backward even where they fit
//                          without (Megatron-LM's runs do)
//   --json FILE            every layout as JSON
//   --top N                rows printed (default 20; the JSON has all)

#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/block.hpp>
#include <dtensor/nn/model.hpp>
#include <dtensor/plan/dry_run.hpp>
#include <dtensor/plan/time_model.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/train/plan_layouts.hpp>

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

using StageMesh = nn::PlanStageMesh; // (rep, dp, ep, cp, tp): one pipeline stage's
using Layout = nn::Layout<StageMesh, nn::TensorParallel<"tp">, nn::SequenceParallel,
                          nn::ContextParallel<Ring<"cp">>, nn::ExpertParallel<"ep">>;
// nn::Moe does not take context parallelism yet: MoE layouts keep cp at 1
using MoeLayout =
    nn::Layout<StageMesh, nn::TensorParallel<"tp">, nn::SequenceParallel, nn::ExpertParallel<"ep">>;

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
  } else if (name == "gpt3-175b") {
    // GPT-3 175B as Megatron-LM trains it (Narayanan et al. 2021, table 2 and section 5.1: 96 layers, hidden
    // 12288, 96 heads, vocabulary 51200, sequences of 2048, batch 1536). Its MLP is 4h wide with GELU (two
    // h x 4h matrices); this SwiGLU MLP of 8h / 3 (three matrices) has the same parameters and flops.
    set(96, 12288, 96, 96, 8 * 12288 / 3, 51200, 2048, 1536);
  } else if (name == "mixtral-8x7b") {
    // Mixtral of Experts (Jiang et al. 2024), table 1: 32 layers, hidden 4096, 32 heads (8 kv), 8 experts of
    // 14336, top 2, vocabulary 32000, RoPE base 1e6, dropless. The sequence (4096) and the batch (1024, 4M
    // tokens) are this preset's: the paper does not give its training's.
    set(32, 4096, 32, 8, 14336, 32000, 4096, 1024);
    m.config.rope_base = 1e6;
    m.config.moe = {.experts = 8, .top_k = 2, .ffn = 14336};
  } else if (name == "tiny") { // for tests: seconds on a laptop
    set(4, 64, 4, 2, 128, 256, 64, 16);
  } else if (name == "tiny-moe") { // the same with 4 experts of 64, top 2
    set(4, 64, 4, 2, 128, 256, 64, 16);
    m.config.moe = {.experts = 4, .top_k = 2, .ffn = 64};
  } else {
    throw std::invalid_argument(
        "unknown --model " + name +
        " (llama-8b, llama-70b, llama-405b, gpt3-175b, mixtral-8x7b, tiny, tiny-moe)");
  }
  return m;
}

struct Options {
  Model model = preset("llama-8b");
  nn::PlanOptions plan{.tp = {1, 2, 4, 8},
                       .cp = {1, 2, 4, 8},
                       .pp = {1, 2, 4, 8},
                       .chunks = {1, 2},
                       .micro_batch = {1, 2, 4},
                       .replicas = {1},
                       .ep = {1, 2, 4, 8}};
  std::string json;
  int top = 20;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(
      stderr,
      "dtensor-plan: %s\nusage: dtensor-plan [--model "
      "llama-8b|llama-70b|llama-405b|gpt3-175b|mixtral-8x7b|tiny|tiny-moe] "
      "[--layers N] [--hidden N] [--heads N] [--kv-heads N] [--ffn N] [--vocab N] [--seq N] "
      "[--global-batch N] [--nodes N] [--gpus-per-node G] [--gpu-memory 80GiB] [--cluster FILE|dgx_a100] "
      "[--experts N] [--top-k K] [--expert-ffn N] [--tp a,b] [--cp a,b] [--pp a,b] [--chunks a,b] "
      "[--zero-bubble] "
      "[--replicas a,b] [--ep a,b] [--micro-batch a,b] [--dtype bf16|fp32] [--recompute] [--json FILE] "
      "[--top N]\n",
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
      o.plan.nodes = int(number());
    } else if (a == "--gpus-per-node") {
      gpus = int(number());
    } else if (a == "--gpu-memory") {
      memory = parse_bytes(value());
    } else if (a == "--cluster") {
      const std::string v = value();
      if (v == "dgx_h100" || v == "dgx_h200" || v == "dgx_a100") {
        o.plan.cluster = parse_cluster_model("preset = " + v);
        continue;
      }
      std::ifstream in(v);
      if (!in) {
        usage("cannot read " + v + " (a config file, or a preset: dgx_h100, dgx_h200, dgx_a100)");
      }
      o.plan.cluster = parse_cluster_model(std::string(std::istreambuf_iterator<char>(in), {}));
    } else if (a == "--tp") {
      o.plan.tp = int_list(value());
    } else if (a == "--cp") {
      o.plan.cp = int_list(value());
    } else if (a == "--experts") {
      c.moe.experts = number();
    } else if (a == "--top-k") {
      c.moe.top_k = int(number());
    } else if (a == "--expert-ffn") {
      c.moe.ffn = number();
    } else if (a == "--ep") {
      o.plan.ep = int_list(value());
    } else if (a == "--replicas") {
      o.plan.replicas = int_list(value());
    } else if (a == "--pp") {
      o.plan.pp = int_list(value());
    } else if (a == "--chunks") {
      o.plan.chunks = int_list(value());
    } else if (a == "--zero-bubble") {
      o.plan.zero_bubble = true;
    } else if (a == "--micro-batch") {
      o.plan.micro_batch = int_list(value());
    } else if (a == "--dtype") {
      const std::string v = value();
      if (v != "bf16" && v != "fp32") {
        usage("--dtype " + v + ": bf16 or fp32");
      }
      o.plan.compute = v == "fp32" ? DType::float32 : DType::bfloat16;
    } else if (a == "--recompute") {
      o.plan.recompute = true;
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--top") {
      o.top = int(number());
    } else {
      usage("unknown argument " + a);
    }
  }
  if (gpus > 0) {
    o.plan.cluster.gpus_per_node = gpus;
  }
  if (memory > 0) {
    o.plan.cluster.gpu_memory_bytes = memory;
  }
  if (o.plan.compute == DType::float32) { // the step's GEMMs in float: the cluster's TF32 rate
    if (!(o.plan.cluster.peak_tflops_tf32 > 0)) {
      usage("--dtype fp32 needs the cluster's peak_tflops_tf32");
    }
    o.plan.cluster.peak_tflops = o.plan.cluster.peak_tflops_tf32;
  }
  if (o.plan.nodes < 1 || o.model.layers < 1 || o.model.seq < 1 || o.model.global_batch < 1) {
    usage("--nodes, --layers, --seq and --global-batch must be positive");
  }
  return o;
}

/// The model's flops a step of `samples` sequences, as papers count them for MFU: 6 x the GEMMs'
/// parameters x the tokens, and the attention's score and value GEMMs over the pairs the causal mask keeps,
/// forward and backward (3 x the forward). Not the recomputation (the blocks' forward again in the backward,
/// which the dry run counts: HFU).
double model_flops(const Model& m, std::int64_t samples) {
  const nn::TransformerConfig& c = m.config;
  const double h = double(c.hidden), hd = double(c.head_dim()), s = double(m.seq);
  const double mlp = c.moe.experts > 0 ? c.moe.top_k * 3 * h * double(c.moe.ffn) + h * double(c.moe.experts)
                                       : 3 * h * double(c.ffn); // the active experts' and the router's
  const double per_layer = h * h * 2 + 2 * h * double(c.kv_head_count()) * hd + mlp;
  const double params = per_layer * double(m.layers) + h * double(c.vocab);
  const double tokens = double(samples) * s;
  const double attention =
      3 * 2 * double(c.heads) * (s * (s + 1) / 2) * 2 * hd * double(m.layers) * double(samples);
  return 6 * params * tokens + attention;
}

/// A preset's GPT as a model family of nn::plan_layouts: nn::LanguageModel of Block in layout L, token ids
/// of the model's sequence as input and target.
template <class L, template <class, class> class Block>
struct GptFamily {
  using model_type = nn::LanguageModel<float, L, Block>;
  const Model& model;

  model_type make(const DeviceMesh<StageMesh>& stage, Device device) const {
    init::InitKeys keys(1);
    return model_type(stage, model.config, model.layers, keys, device);
  }
  auto micro_batch(const DeviceMesh<StageMesh>& stage, std::int64_t samples, Device device) const {
    auto ids = [&]<class... Q>(DTensor<std::int64_t, 2, StageMesh, Q...>*) {
      return zeros<std::int64_t, Q...>(stage, {samples, model.seq}, device);
    }(static_cast<nn::ids_t<L>*>(nullptr));
    return std::pair{ids, ids};
  }
  std::int64_t blocks() const { return model.layers; }
  /// tp divides the heads, kv heads and ffn (and the experts' ffn), cp the sequence (dense models only), ep
  /// the experts (MoE models only).
  bool admits(int tp, int cp, int ep) const {
    const nn::TransformerConfig& c = model.config;
    if (c.heads % tp || c.kv_head_count() % tp || c.ffn % tp || model.seq % cp) {
      return false;
    }
    return c.moe.experts > 0 ? c.moe.ffn % tp == 0 && cp == 1 && c.moe.experts % ep == 0 : ep == 1;
  }
  double model_flops(std::int64_t samples) const { return ::model_flops(model, samples); }
};

std::string gib(std::int64_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f", double(bytes) / double(1LL << 30));
  return s;
}

/// The pipeline's schedule, short: "-" without one.
const char* schedule_of(const nn::PlannedLayout& l) {
  if (l.pp == 1) {
    return "-";
  }
  switch (l.schedule) {
  case Schedule::zero_bubble_h1:
    return "ZB-H1";
  case Schedule::zero_bubble_v:
    return "ZB-V";
  case Schedule::interleaved_one_f_one_b:
    return "i1F1B";
  default:
    return "1F1B";
  }
}

std::string row(const nn::PlannedLayout& l) {
  char s[400];
  if (!l.error.empty()) {
    std::snprintf(s, sizeof s, "%4d %3d %2d %3d %2d %5s %3d %3d %3lld %4lld %3s  cannot run: %s", l.dp,
                  l.replicas, l.ep, l.pp, l.chunks, schedule_of(l), l.cp, l.tp, (long long)l.micro_batch,
                  (long long)l.accumulation, l.recompute ? "yes" : "no", l.error.c_str());
    return s;
  }
  const DryRun& r = l.runs[l.worst];
  double wall = 0;
  for (const DryRun& d : l.runs) {
    wall += d.wall_seconds;
  }
  auto at = [&](MemoryCategory c) { return gib(r.memory.at_peak[std::size_t(c)]); };
  std::snprintf(
      s, sizeof s,
      "%4d %3d %2d %3d %2d %5s %3d %3d %3lld %4lld %3s %7s %4s %6s %6s %6s %6s %6s %8.2f %8.2f %8.3f %8.3f "
      "%8.3f %5.1f "
      "%5.1f %6.2f",
      l.dp, l.replicas, l.ep, l.pp, l.chunks, schedule_of(l), l.cp, l.tp, (long long)l.micro_batch,
      (long long)l.accumulation, l.recompute ? "yes" : "no", gib(r.memory.peak_total).c_str(),
      l.fits() ? "yes" : "no", at(MemoryCategory::parameters).c_str(), at(MemoryCategory::gradients).c_str(),
      at(MemoryCategory::optimizer_state).c_str(), at(MemoryCategory::activations).c_str(),
      at(MemoryCategory::communication).c_str(), double(l.bytes(false)) * 1e-9, double(l.bytes(true)) * 1e-9,
      l.step, l.bubble, l.runs[l.slowest].time.exposed, 100 * l.mfu, 100 * l.hfu, wall);
  return s;
}

} // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const nn::TransformerConfig& c = o.model.config;
    const int world = o.plan.nodes * o.plan.cluster.gpus_per_node;
    std::printf(
        "model %s: %lld layers, hidden %lld, %lld heads (%lld kv), ffn %lld, vocab %lld; %lld sequences "
        "of %lld a step, %s compute\ncluster %s: %d nodes x %d GPUs (%d), %s GiB each, %.0f TFLOPS at %.0f "
        "%%\n",
        o.model.name.c_str(), (long long)o.model.layers, (long long)c.hidden, (long long)c.heads,
        (long long)c.kv_head_count(), (long long)c.ffn, (long long)c.vocab, (long long)o.model.global_batch,
        (long long)o.model.seq, o.plan.compute == DType::float32 ? "float" : "bfloat16",
        o.plan.cluster.name.c_str(), o.plan.nodes, o.plan.cluster.gpus_per_node, world,
        gib(std::int64_t(o.plan.cluster.gpu_memory_bytes)).c_str(), o.plan.cluster.peak_tflops,
        100 * o.plan.cluster.gemm_efficiency);
    nn::PlanOptions plan = o.plan;
    plan.global_batch = o.model.global_batch;
    const bool moe = c.moe.experts > 0;
    if (!moe) {
      plan.ep = {1};
    }
    const std::vector<nn::PlannedLayout> layouts =
        moe ? nn::plan_layouts(GptFamily<MoeLayout, nn::MoeBlock>{o.model}, plan)
            : nn::plan_layouts(GptFamily<Layout, nn::TransformerBlock>{o.model}, plan);
    if (layouts.empty()) {
      std::fprintf(stderr, "dtensor-plan: no layout divides this model and cluster (--tp, --cp, --pp, "
                           "--chunks, --micro-batch)\n");
      return 1;
    }
    const char* head = "%4s %3s %2s %3s %2s %5s %3s %3s %3s %4s %3s %7s %4s %6s %6s %6s %6s %6s %8s %8s %8s "
                       "%8s %8s %5s %5s %6s\n";
    std::printf(head, "dp", "rep", "ep", "pp", "v", "sched", "cp", "tp", "mb", "acc", "rc", "peak", "fits",
                "param", "grad", "optim", "act", "comm", "NVLink", "network", "step", "bubble", "exposed",
                "MFU", "HFU", "dry");
    std::printf(head, "", "", "", "", "", "", "", "", "", "", "", "GiB", "", "GiB", "GiB", "GiB", "GiB",
                "GiB", "GB", "GB", "s", "s", "s", "%", "%", "s");
    for (std::size_t i = 0; i < layouts.size() && int(i) < o.top; ++i) {
      std::printf("%s\n", row(layouts[i]).c_str());
    }
    std::printf(
        "(memory: the tensors at the step's peak of the representative rank with the highest (the first "
        "pipeline stage's or the last's); bytes: the most a representative receives a step; v: model stages "
        "per pp rank "
        "(1F1B with one, interleaved 1F1B with more; ZB-H1 one, ZB-V two); sched: the pipeline's schedule; "
        "rep: HSDP's replicas (FSDP over dp / (rep ep)); ep: "
        "the experts' shards; mb: "
        "sequences a micro-batch per dp rank, acc: "
        "micro-batches a step; rc: the blocks' forward recomputed in the backward; bubble: pipeline idle; "
        "MFU: the model's flops, HFU: the flops run, "
        "recomputation included, a rank's mean; dry: the dry runs' own seconds)\n");
    if (!o.json.empty()) {
      std::ofstream out(o.json);
      out << "{\"model\": \"" << o.model.name << "\", \"world_size\": " << world << ", \"cluster\": \""
          << o.plan.cluster.name << "\", \"layouts\": [";
      for (std::size_t i = 0; i < layouts.size(); ++i) {
        const nn::PlannedLayout& l = layouts[i];
        out << (i ? ", " : "") << "{\"dp\": " << l.dp << ", \"replicas\": " << l.replicas
            << ", \"ep\": " << l.ep << ", \"pp\": " << l.pp << ", \"chunks\": " << l.chunks
            << ", \"schedule\": \"" << schedule_of(l) << "\""
            << ", \"cp\": " << l.cp << ", \"tp\": " << l.tp << ", \"micro_batch\": " << l.micro_batch
            << ", \"accumulation\": " << l.accumulation
            << ", \"recompute\": " << (l.recompute ? "true" : "false");
        if (l.error.empty()) {
          out << ", \"fits\": " << (l.fits() ? "true" : "false") << ", \"step_seconds\": " << l.step
              << ", \"bubble_seconds\": " << l.bubble << ", \"mfu\": " << l.mfu << ", \"hfu\": " << l.hfu
              << ", \"dry_runs\": [";
          for (std::size_t k = 0; k < l.runs.size(); ++k) {
            out << (k ? ", " : "") << l.runs[k].to_json();
          }
          out << "]}";
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
