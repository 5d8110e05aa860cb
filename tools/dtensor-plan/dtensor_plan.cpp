// dtensor-plan: which layout of a GPT-style model fits on a cluster, what it moves over each link tier and
// how long its step takes, from dry runs of the library's real training step (plan/dry_run.hpp): a rank of
// the whole world runs the step alone on the fake backend with meta tensors, for every layout.
//
//   dtensor-plan --model llama-70b --nodes 128 --gpus-per-node 8 --gpu-memory 80GiB [--json plan.json]
//
// The model: nn::LanguageModel of nn::TransformerBlock (token embedding, RoPE, causal grouped-query
// attention, SwiGLU MLP or a mixture of SwiGLU experts, RMSNorm, untied head), float parameters in FSDP
// shards, gathered and computed in bfloat16 (--dtype fp32: float), gradients reduced in float, AdamW. The
// layouts: FSDP over dp (or HSDP: replicas of FSDP; DDP where the replicas are all of dp), experts sharded
// over ep of the dp ranks (MoE), pipeline stages over pp (nn::PipelineTrainer: 1F1B, or interleaved 1F1B with
// v model stages per pp rank), ring context parallel over cp (dense models), tensor + sequence parallel over
// tp (within a node), and the micro-batch (the local batch split into accumulation steps, the pipeline's
// micro-batches). The mesh is (rep, dp, ep, pp, cp, tp), outermost to innermost (Llama 3's order), and the
// batch is sharded over rep x dp x ep. Without a pipeline nn::FsdpTrainer runs the step (prefetching the next
// block's gather, resharding after the forward and recomputing it in the backward: torchtitan's default).
//
// The representative ranks: ranks of the same pipeline stage do the same work and move the same bytes (each
// degree divides what it splits, so the shards are even; on meta tensors nn::Moe routes every expert its even
// share), except along cp: ring attention's causal mask gives the rank with the sequence's last block the
// most work, and the others wait for it at the ring's exchanges. So the first stage's rank at the last cp
// coordinate stands for the first stage and, with a pipeline, the last stage's for the last (the head, the
// loss); the middle stages hold blocks only. Each runs two steps and measures the second (which holds the
// optimizer's state). The step of a representative is its timeline (compute at the cluster's GEMM rate plus
// the communication its schedule does not hide: plan/comm_time.hpp) plus the time its stage idles in the
// pipeline (simulate_pipeline over every model stage with the blocks' and the head's measured flops); the
// layout's is the slower one's. A pipeline recomputes its blocks only where it does not fit without. Its
// table row: memory at the step's peak by category (the representative with the higher peak) and whether it
// fits, bytes received per step over NVLink and over the network, the step, its pipeline idle and exposed
// communication, MFU (the model's flops), HFU (the flops run: a stage's mean, of the busiest cp rank) and the
// dry runs' own seconds; sorted by the step, those that fit first.
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
#include <dtensor/train/fsdp.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/pipeline_schedule.hpp>
#include <dtensor/train/pipeline_trainer.hpp>
#include <dtensor/train/trainer.hpp>

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

// Llama 3's order, tp innermost; rep: HSDP's replicas, dp: the FSDP shards within one, ep: the experts'
// shards (the batch over all three)
using Mesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"ep">, Axis<"pp">, Axis<"cp">, Axis<"tp">>;
using StageMesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"ep">, Axis<"cp">, Axis<"tp">>; // one stage's
using Layout = nn::Layout<StageMesh, nn::TensorParallel<"tp">, nn::SequenceParallel,
                          nn::ContextParallel<Ring<"cp">>, nn::ExpertParallel<"ep">>;
using Gpt = nn::LanguageModel<float, Layout, nn::TransformerBlock>;
// nn::Moe does not take context parallelism yet: MoE layouts keep cp at 1
using MoeLayout =
    nn::Layout<StageMesh, nn::TensorParallel<"tp">, nn::SequenceParallel, nn::ExpertParallel<"ep">>;
using MoeGpt = nn::LanguageModel<float, MoeLayout, nn::MoeBlock>;

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
  int nodes = 1;
  ClusterModel cluster = dgx_h100();
  std::vector<int> tp{1, 2, 4, 8}, cp{1, 2, 4, 8}, pp{1, 2, 4, 8}, chunks{1, 2}, micro{1, 2, 4}, replicas{1},
      ep{1, 2, 4, 8};
  std::string json;
  int top = 20;
  bool recompute = false; ///< pipelines recompute the blocks even where they fit without
  bool fp32 = false;      ///< --dtype fp32: compute in float (TF32 GEMMs) instead of bfloat16
};

struct Candidate {
  int dp = 1, pp = 1, chunks = 1, cp = 1, tp = 1;
  int replicas = 1; ///< HSDP: dp is this many replicas of FSDP over dp / (replicas ep) (1: no replicas)
  int ep = 1;       ///< expert parallel: the experts sharded over this many of the dp ranks (MoE only)
  std::int64_t micro_batch = 1;  ///< sequences a micro-batch, per dp rank
  std::int64_t accumulation = 1; ///< micro-batches a step (the pipeline's m when pp > 1)
  /// The blocks' forward again in their backward: always under nn::FsdpTrainer (it reshards each block after
  /// its forward); in a pipeline only where the layout does not fit without.
  bool recompute = true;
  /// The representative ranks' dry runs: the first pipeline stage's rank at the last cp coordinate, and
  /// with pp > 1 the last stage's (the embedding and the most micro-batches in flight; the head and the
  /// loss). The last cp coordinate holds the sequence's last block: the most causal attention.
  std::vector<DryRun> runs{};
  double step = 0;   ///< the estimated step: the slowest representative's timeline plus its pipeline idle
  double bubble = 0; ///< of which the pipeline's idle time (simulate_pipeline)
  double hfu = 0;
  std::size_t worst = 0;   ///< the representative with the highest memory peak
  std::size_t slowest = 0; ///< the representative whose step is the layout's
  std::string error{};     ///< the dry run failed (the layout cannot exist): why

  bool fits() const {
    return std::all_of(runs.begin(), runs.end(), [](const DryRun& r) { return r.fits; });
  }
  std::int64_t bytes(bool network) const {
    std::int64_t b = 0;
    for (const DryRun& r : runs) {
      b = std::max(b, network ? r.bytes_network : r.bytes_nvlink);
    }
    return b;
  }
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(
      stderr,
      "dtensor-plan: %s\nusage: dtensor-plan [--model "
      "llama-8b|llama-70b|llama-405b|gpt3-175b|mixtral-8x7b|tiny|tiny-moe] "
      "[--layers N] [--hidden N] [--heads N] [--kv-heads N] [--ffn N] [--vocab N] [--seq N] "
      "[--global-batch N] [--nodes N] [--gpus-per-node G] [--gpu-memory 80GiB] [--cluster FILE|dgx_a100] "
      "[--experts N] [--top-k K] [--expert-ffn N] [--tp a,b] [--cp a,b] [--pp a,b] [--chunks a,b] "
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
      o.nodes = int(number());
    } else if (a == "--gpus-per-node") {
      gpus = int(number());
    } else if (a == "--gpu-memory") {
      memory = parse_bytes(value());
    } else if (a == "--cluster") {
      const std::string v = value();
      if (v == "dgx_h100" || v == "dgx_h200" || v == "dgx_a100") {
        o.cluster = parse_cluster_model("preset = " + v);
        continue;
      }
      std::ifstream in(v);
      if (!in) {
        usage("cannot read " + v + " (a config file, or a preset: dgx_h100, dgx_h200, dgx_a100)");
      }
      o.cluster = parse_cluster_model(std::string(std::istreambuf_iterator<char>(in), {}));
    } else if (a == "--tp") {
      o.tp = int_list(value());
    } else if (a == "--cp") {
      o.cp = int_list(value());
    } else if (a == "--experts") {
      c.moe.experts = number();
    } else if (a == "--top-k") {
      c.moe.top_k = int(number());
    } else if (a == "--expert-ffn") {
      c.moe.ffn = number();
    } else if (a == "--ep") {
      o.ep = int_list(value());
    } else if (a == "--replicas") {
      o.replicas = int_list(value());
    } else if (a == "--pp") {
      o.pp = int_list(value());
    } else if (a == "--chunks") {
      o.chunks = int_list(value());
    } else if (a == "--micro-batch") {
      o.micro = int_list(value());
    } else if (a == "--dtype") {
      const std::string v = value();
      if (v != "bf16" && v != "fp32") {
        usage("--dtype " + v + ": bf16 or fp32");
      }
      o.fp32 = v == "fp32";
    } else if (a == "--recompute") {
      o.recompute = true;
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
  if (o.fp32) { // the step's GEMMs in float: the cluster's TF32 rate
    if (!(o.cluster.peak_tflops_tf32 > 0)) {
      usage("--dtype fp32 needs the cluster's peak_tflops_tf32");
    }
    o.cluster.peak_tflops = o.cluster.peak_tflops_tf32;
  }
  if (o.nodes < 1 || o.model.layers < 1 || o.model.seq < 1 || o.model.global_batch < 1) {
    usage("--nodes, --layers, --seq and --global-batch must be positive");
  }
  return o;
}

/// The layouts to dry-run: dp x pp x cp x tp = every GPU, tp within a node and dividing the heads, kv heads
/// and ffn, cp dividing the sequence, the global batch over dp, each micro-batch size that divides the local
/// batch; with pp > 1 each chunk count v (1F1B with one, interleaved 1F1B with more) that leaves every model
/// stage a layer and whose schedule can run the micro-batches (interleaved: a multiple of pp).
std::vector<Candidate> enumerate(const Options& o) {
  const nn::TransformerConfig& c = o.model.config;
  const int world = o.nodes * o.cluster.gpus_per_node;
  std::vector<Candidate> out;
  for (int tp : o.tp) {
    if (tp < 1 || tp > o.cluster.gpus_per_node || c.heads % tp || c.kv_head_count() % tp || c.ffn % tp ||
        (c.moe.experts > 0 && c.moe.ffn % tp)) {
      continue;
    }
    for (int pp : o.pp) {
      for (int cp : o.cp) {
        if (pp < 1 || cp < 1 || o.model.seq % cp || world % (tp * cp * pp) || (c.moe.experts > 0 && cp > 1)) {
          continue;
        }
        const int dp = world / (tp * cp * pp);
        if (o.model.global_batch % dp) {
          continue;
        }
        const std::int64_t local = o.model.global_batch / dp;
        for (int mb : o.micro) {
          if (mb < 1 || local % mb) {
            continue;
          }
          const std::int64_t m = local / mb;
          for (int v : pp == 1 ? std::vector<int>{1} : o.chunks) {
            if (v < 1 || o.model.layers < std::int64_t(pp) * v || (v > 1 && m % pp)) {
              continue;
            }
            for (int r : o.replicas) {
              for (int e : c.moe.experts > 0 ? o.ep : std::vector<int>{1}) {
                if (r < 1 || e < 1 || dp % (r * e) || (e > 1 && c.moe.experts % e)) {
                  continue;
                }
                out.push_back({.dp = dp,
                               .pp = pp,
                               .chunks = v,
                               .cp = cp,
                               .tp = tp,
                               .replicas = r,
                               .ep = e,
                               .micro_batch = mb,
                               .accumulation = m});
              }
            }
          }
        }
      }
    }
  }
  return out;
}

/// The micro-batches of a step of layout `l`: ids (and targets) of layout L on the stage mesh.
template <class L>
std::vector<std::pair<nn::ids_t<L>, nn::ids_t<L>>>
micro_batches(const Options& o, const Candidate& l, const DeviceMesh<StageMesh>& stage, Device device) {
  std::vector<std::pair<nn::ids_t<L>, nn::ids_t<L>>> micro;
  for (std::int64_t k = 0; k < l.accumulation; ++k) {
    auto ids = [&]<class... Q>(DTensor<std::int64_t, 2, StageMesh, Q...>*) {
      return zeros<std::int64_t, Q...>(stage, {l.micro_batch * l.dp, o.model.seq}, device);
    }(static_cast<nn::ids_t<L>*>(nullptr));
    micro.emplace_back(ids, ids);
  }
  return micro;
}

/// Two steps of the layout in the dry run `ctx` under FSDP or HSDP `Policy`, the second measured: it holds
/// the optimizer's state the first one made. With pp > 1, the second step's pipeline run (its chunks' flops).
template <class Gpt, class Policy, class C>
PipelineRunStats steps(const Options& o, const Candidate& l, DryRunContext& ctx) {
  const Device device = ctx.device();
  const auto mesh =
      init_device_mesh<Mesh>(ctx.world(), l.replicas, l.dp / (l.replicas * l.ep), l.ep, l.pp, l.cp, l.tp);
  const auto stage = mesh.slice<"rep", "dp", "ep", "cp", "tp">();
  init::InitKeys keys(1);
  optim::AdamW opt({.lr = 1e-4});
  const auto micro = micro_batches<typename Gpt::layout_type>(o, l, stage, device);
  if (l.pp == 1) {
    nn::FsdpTrainer<Gpt, Policy, C, float> trainer(
        stage, Gpt(stage, o.model.config, o.model.layers, keys, device),
        {.schedule = {.prefetch = 1, .reshard_after_forward = true, .max_reductions = 2}});
    (void)trainer.step(std::span(micro), opt);
    ctx.begin_step();
    (void)trainer.step(std::span(micro), opt);
    return {};
  }
  nn::PipelineTrainer<Gpt, Policy, C, float> trainer(
      mesh.group<"pp">(), stage, Gpt(stage, o.model.config, o.model.layers, keys, device),
      {.schedule = l.chunks > 1 ? Schedule::interleaved_one_f_one_b : Schedule::one_f_one_b,
       .chunks = l.chunks,
       .recompute = l.recompute});
  (void)trainer.step(std::span(micro), opt);
  ctx.begin_step();
  (void)trainer.step(std::span(micro), opt);
  return trainer.last_run();
}

/// steps() of the model (dense or MoE) and the policy (FSDP or HSDP) of layout `l`, in compute type C.
template <class C>
PipelineRunStats steps_of(const Options& o, const Candidate& l, DryRunContext& ctx) {
  const bool hsdp = l.replicas > 1;
  if (o.model.config.moe.experts > 0) {
    return hsdp ? steps<MoeGpt, Hsdp<"rep", "dp">, C>(o, l, ctx) : steps<MoeGpt, Fsdp<"dp">, C>(o, l, ctx);
  }
  return hsdp ? steps<Gpt, Hsdp<"rep", "dp">, C>(o, l, ctx) : steps<Gpt, Fsdp<"dp">, C>(o, l, ctx);
}

/// Dry-runs layout `l` as its representative ranks and estimates its step. With pp > 1 the pipeline's idle
/// time comes from simulate_pipeline over every model stage: a block's forward and backward flops from the
/// first stage's first chunk (the embedding counts no flops), the head's from the last stage's last chunk
/// less its blocks; a representative's step is its own timeline (compute and exposed communication) plus
/// the time its stage idles in the simulated schedule, and the layout's step is the slower one's.
void plan_once(const Options& o, Candidate& l) {
  const int world = o.nodes * o.cluster.gpus_per_node;
  const double rate = o.cluster.peak_tflops * 1e12 * o.cluster.gemm_efficiency;
  std::vector<PipelineRunStats> stats;
  for (int s : l.pp == 1 ? std::vector<int>{0} : std::vector<int>{0, l.pp - 1}) {
    const int rank = (s * l.cp + l.cp - 1) * l.tp; // (rep 0, dp 0, ep 0, pp s, cp cp - 1, tp 0)
    l.runs.push_back(
        dry_run({.rank = rank, .world_size = world, .cluster = o.cluster}, [&](DryRunContext& ctx) {
          stats.push_back(o.fp32 ? steps_of<float>(o, l, ctx) : steps_of<bfloat16>(o, l, ctx));
        }));
  }
  std::vector<double> idle(l.runs.size(), 0.0);
  double flops_per_rank = l.runs.front().flops; // the HFU's: the mean over the pipeline's stages
  if (l.pp > 1) {
    const int p = l.pp, v = l.chunks, stages = p * v, layers = int(o.model.layers);
    const double m = double(l.accumulation);
    const auto blocks = [&](int g) {
      const auto [first, last] = pipeline_layers(layers, stages, g);
      return double(last - first);
    };
    const double block_f = stats[0].forward_flops[0] / m / blocks(0);
    const double block_b = stats[0].backward_flops[0] / m / blocks(0);
    const double head_f = stats[1].forward_flops[std::size_t(v - 1)] / m - blocks(stages - 1) * block_f;
    const double head_b = stats[1].backward_flops[std::size_t(v - 1)] / m - blocks(stages - 1) * block_b;
    std::vector<double> forward(static_cast<std::size_t>(stages)), backward(forward.size());
    for (int g = 0; g < stages; ++g) {
      forward[std::size_t(g)] = (blocks(g) * block_f + (g == stages - 1 ? head_f : 0)) / rate;
      backward[std::size_t(g)] = (blocks(g) * block_b + (g == stages - 1 ? head_b : 0)) / rate;
    }
    const Schedule schedule = v > 1 ? Schedule::interleaved_one_f_one_b : Schedule::one_f_one_b;
    const PipelineTimeline t = simulate_pipeline(
        schedule, {.stages = p, .microbatches = int(l.accumulation), .chunks = v}, forward, backward);
    idle = {t.makespan - t.busy.front(), t.makespan - t.busy.back()};
    double busy = 0; // every stage's compute, in flops
    for (double b : t.busy) {
      busy += b * rate;
    }
    flops_per_rank = busy / p;
  }
  for (std::size_t i = 0; i < l.runs.size(); ++i) {
    const DryRun& r = l.runs[i];
    if (r.time.seconds + idle[i] > l.step) {
      l.step = r.time.seconds + idle[i];
      l.bubble = idle[i];
      l.slowest = i;
    }
    if (r.memory.peak_total > l.runs[l.worst].memory.peak_total) {
      l.worst = i;
    }
  }
  l.hfu = flops_per_rank / (l.step * o.cluster.peak_tflops * 1e12);
}

/// The model's flops a step over the whole cluster, as papers count them for MFU: 6 x the GEMMs'
/// parameters x the tokens, and the attention's score and value GEMMs over the pairs the causal mask keeps,
/// forward and backward (3 x the forward). Not the recomputation (the blocks' forward again in the backward,
/// which the dry run counts: HFU).
double model_flops(const Model& m) {
  const nn::TransformerConfig& c = m.config;
  const double h = double(c.hidden), hd = double(c.head_dim()), s = double(m.seq);
  const double mlp = c.moe.experts > 0 ? c.moe.top_k * 3 * h * double(c.moe.ffn) + h * double(c.moe.experts)
                                       : 3 * h * double(c.ffn); // the active experts' and the router's
  const double per_layer = h * h * 2 + 2 * h * double(c.kv_head_count()) * hd + mlp;
  const double params = per_layer * double(m.layers) + h * double(c.vocab);
  const double tokens = double(m.global_batch) * s;
  const double attention =
      3 * 2 * double(c.heads) * (s * (s + 1) / 2) * 2 * hd * double(m.layers) * double(m.global_batch);
  return 6 * params * tokens + attention;
}

/// Layout `l` planned: a pipeline without recomputation, and with it where that does not fit.
void plan(const Options& o, Candidate& l) {
  l.recompute = l.pp == 1 || o.recompute;
  plan_once(o, l);
  if (l.pp > 1 && !l.fits() && !l.recompute) {
    Candidate again = l;
    again.runs.clear();
    again.step = again.bubble = again.hfu = 0;
    again.worst = again.slowest = 0;
    again.recompute = true;
    plan_once(o, again);
    l = std::move(again);
  }
}

std::string gib(std::int64_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f", double(bytes) / double(1LL << 30));
  return s;
}

std::string row(const Candidate& l, double mfu) {
  char s[400];
  if (!l.error.empty()) {
    std::snprintf(s, sizeof s, "%4d %3d %2d %3d %2d %3d %3d %3lld %4lld %3s  cannot run: %s", l.dp,
                  l.replicas, l.ep, l.pp, l.chunks, l.cp, l.tp, (long long)l.micro_batch,
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
      "%4d %3d %2d %3d %2d %3d %3d %3lld %4lld %3s %7s %4s %6s %6s %6s %6s %6s %8.2f %8.2f %8.3f %8.3f "
      "%8.3f %5.1f "
      "%5.1f %6.2f",
      l.dp, l.replicas, l.ep, l.pp, l.chunks, l.cp, l.tp, (long long)l.micro_batch, (long long)l.accumulation,
      l.recompute ? "yes" : "no", gib(r.memory.peak_total).c_str(), l.fits() ? "yes" : "no",
      at(MemoryCategory::parameters).c_str(), at(MemoryCategory::gradients).c_str(),
      at(MemoryCategory::optimizer_state).c_str(), at(MemoryCategory::activations).c_str(),
      at(MemoryCategory::communication).c_str(), double(l.bytes(false)) * 1e-9, double(l.bytes(true)) * 1e-9,
      l.step, l.bubble, l.runs[l.slowest].time.exposed, 100 * mfu, 100 * l.hfu, wall);
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
        "of %lld a step, %s compute\ncluster %s: %d nodes x %d GPUs (%d), %s GiB each, %.0f TFLOPS at %.0f "
        "%%\n",
        o.model.name.c_str(), (long long)o.model.layers, (long long)c.hidden, (long long)c.heads,
        (long long)c.kv_head_count(), (long long)c.ffn, (long long)c.vocab, (long long)o.model.global_batch,
        (long long)o.model.seq, o.fp32 ? "float" : "bfloat16", o.cluster.name.c_str(), o.nodes,
        o.cluster.gpus_per_node, world, gib(std::int64_t(o.cluster.gpu_memory_bytes)).c_str(),
        o.cluster.peak_tflops, 100 * o.cluster.gemm_efficiency);
    std::vector<Candidate> layouts = enumerate(o);
    if (layouts.empty()) {
      std::fprintf(stderr, "dtensor-plan: no layout divides this model and cluster (--tp, --cp, --pp, "
                           "--chunks, --micro-batch)\n");
      return 1;
    }
    for (Candidate& l : layouts) {
      try {
        plan(o, l);
      } catch (const std::exception& e) {
        l.error = e.what();
        l.error = l.error.substr(0, l.error.find('\n'));
      }
    }
    std::stable_sort(layouts.begin(), layouts.end(), [](const Candidate& a, const Candidate& b) {
      const auto key = [](const Candidate& l) {
        return std::pair{l.error.empty() ? (l.fits() ? 0 : 1) : 2, l.error.empty() ? l.step : 0.0};
      };
      return key(a) < key(b);
    });
    const double flops_per_gpu = model_flops(o.model) / world;
    const auto mfu = [&](const Candidate& l) {
      return l.step > 0 ? flops_per_gpu / (l.step * o.cluster.peak_tflops * 1e12) : 0.0;
    };
    const char* head = "%4s %3s %2s %3s %2s %3s %3s %3s %4s %3s %7s %4s %6s %6s %6s %6s %6s %8s %8s %8s %8s "
                       "%8s %5s %5s %6s\n";
    std::printf(head, "dp", "rep", "ep", "pp", "v", "cp", "tp", "mb", "acc", "rc", "peak", "fits", "param",
                "grad", "optim", "act", "comm", "NVLink", "network", "step", "bubble", "exposed", "MFU",
                "HFU", "dry");
    std::printf(head, "", "", "", "", "", "", "", "", "", "", "GiB", "", "GiB", "GiB", "GiB", "GiB", "GiB",
                "GB", "GB", "s", "s", "s", "%", "%", "s");
    for (std::size_t i = 0; i < layouts.size() && int(i) < o.top; ++i) {
      std::printf("%s\n", row(layouts[i], mfu(layouts[i])).c_str());
    }
    std::printf(
        "(memory: the tensors at the step's peak of the representative rank with the highest (the first "
        "pipeline stage's or the last's); bytes: the most a representative receives a step; v: model stages "
        "per pp rank "
        "(1F1B with one, interleaved 1F1B with more); rep: HSDP's replicas (FSDP over dp / (rep ep)); ep: "
        "the experts' shards; mb: "
        "sequences a micro-batch per dp rank, acc: "
        "micro-batches a step; rc: the blocks' forward recomputed in the backward; bubble: pipeline idle; "
        "MFU: the model's flops, HFU: the flops run, "
        "recomputation included, a rank's mean; dry: the dry runs' own seconds)\n");
    if (!o.json.empty()) {
      std::ofstream out(o.json);
      out << "{\"model\": \"" << o.model.name << "\", \"world_size\": " << world << ", \"cluster\": \""
          << o.cluster.name << "\", \"layouts\": [";
      for (std::size_t i = 0; i < layouts.size(); ++i) {
        const Candidate& l = layouts[i];
        out << (i ? ", " : "") << "{\"dp\": " << l.dp << ", \"replicas\": " << l.replicas
            << ", \"ep\": " << l.ep << ", \"pp\": " << l.pp << ", \"chunks\": " << l.chunks
            << ", \"cp\": " << l.cp << ", \"tp\": " << l.tp << ", \"micro_batch\": " << l.micro_batch
            << ", \"accumulation\": " << l.accumulation
            << ", \"recompute\": " << (l.recompute ? "true" : "false");
        if (l.error.empty()) {
          out << ", \"fits\": " << (l.fits() ? "true" : "false") << ", \"step_seconds\": " << l.step
              << ", \"bubble_seconds\": " << l.bubble << ", \"mfu\": " << mfu(l) << ", \"hfu\": " << l.hfu
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
