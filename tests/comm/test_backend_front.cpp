// The Backend front (backends/backend.hpp) and the registry (backends/registry.hpp), seen through a test
// backend, "loopback", that implements only all_reduce, broadcast, barrier and split: the front's checks
// fire before any hook runs, an op the backend leaves out says it is not supported, abort() stops every
// later op, and init_process_group finds the backend by name (InitOptions::backend or DTENSOR_BACKEND).

#include "common.hpp"
#include "dtensor/backends/backend.hpp"
#include "dtensor/backends/registry.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/rendezvous/in_process_store.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace comm_test;
using Catch::Matchers::Contains;

namespace {

/// A completed op.
struct DoneWork final : WorkImpl {
  bool is_completed() override { return true; }
  void wait() override {}
};

/// Counts what reached the hooks. Ops move no data (one member has nothing to exchange; with more members
/// the tests only call ops whose arguments the front rejects, or look at the hook count).
class LoopbackBackend final : public Backend {
public:
  LoopbackBackend(int rank, int size, std::chrono::milliseconds timeout,
                  std::shared_ptr<Store> store = nullptr)
      : Backend(timeout), rank_(rank), store_(std::move(store)) {
    for (int r = 0; r < size; ++r) {
      ranks_.push_back(r);
    }
  }

  std::string_view name() const noexcept override { return "loopback"; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return static_cast<int>(ranks_.size()); }
  std::span<const int> global_ranks() const noexcept override { return ranks_; }
  std::string describe() const override {
    return "rank " + std::to_string(rank_) + " of loopback group " + detail::format_list(ranks_);
  }

  std::atomic<int> hooks{0};
  std::atomic<int> aborts{0};
  SplitGroup last_split;

protected:
  WorkPtr do_all_reduce(BufferRef, ReduceOp, const CommOptions&) override { return done(); }
  WorkPtr do_broadcast(BufferRef, int, const CommOptions&) override { return done(); }
  WorkPtr do_barrier(const CommOptions&) override { return done(); }
  std::shared_ptr<Backend> do_split(const SplitGroup& g) override {
    ++hooks;
    last_split = g;
    return g.rank < 0 ? nullptr
                      : std::make_shared<LoopbackBackend>(g.rank, static_cast<int>(g.global_ranks.size()),
                                                          timeout());
  }
  Store* split_store() override { return store_.get(); }
  void do_abort(std::string_view) override { ++aborts; }
  void check_memory(const char* op, const BufferRef& b, const char* what) const override {
    DTENSOR_CHECK(b.device.is_cpu(), where(op) + ": the " + what + " is on " + b.device.to_string() +
                                         "; loopback only handles host memory");
  }

private:
  WorkPtr done() {
    ++hooks;
    return std::make_shared<DoneWork>();
  }

  int rank_;
  std::vector<int> ranks_;
  std::shared_ptr<Store> store_;
};

/// What the registry's factory was last given.
BackendOptions last_options;
int made = 0;

/// The test backend's registration: one statement, like a backend folder's header has.
const bool loopback_registered = [] {
  register_backend("loopback", [](std::shared_ptr<Store> store, int rank, int size, const BackendOptions& o) {
    DTENSOR_CHECK(size == 1, "loopback: one rank only, got " + std::to_string(size));
    last_options = o;
    ++made;
    return std::make_shared<LoopbackBackend>(rank, size, o.timeout, std::move(store));
  });
  return true;
}();

/// The message of the Error fn() throws ("" when it throws none).
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

template <class T>
BufferRef host(std::vector<T>& v) {
  return BufferRef{v.data(), static_cast<std::int64_t>(v.size()), dtype_v<T>, Device::cpu()};
}

} // namespace

TEST_CASE("the Backend front checks every argument before a hook runs", "[comm][backend]") {
  LoopbackBackend b(1, 3, std::chrono::seconds(5));
  const std::string me = "rank 1 of loopback group [0,1,2]";
  std::vector<float> f(6, 1.0f), g(6, 0.0f), one(1, 0.0f), two(2, 0.0f);
  std::vector<std::int32_t> ints(6, 0);
  const std::vector<std::int64_t> c3{1, 1, 1}, d3{0, 1, 2}, c2{1, 1}, d2{0, 1};
  const CommOptions o;
  struct Case {
    const char* what;
    std::function<void()> call;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases{
      {"negative count",
       [&] {
         b.all_reduce({f.data(), -1, DType::float32, Device::cpu()}, ReduceOp::sum, o);
       },
       {"all_reduce", "negative element count -1"}},
      {"no data",
       [&] {
         b.all_reduce({nullptr, 3, DType::float32, Device::cpu()}, ReduceOp::sum, o);
       },
       {"all_reduce", "has no data (3 elements at nullptr)"}},
      {"the backend's memory rule",
       [&] {
         b.broadcast({f.data(), 6, DType::float32, Device::cuda(0)}, 0, o);
       },
       {"broadcast", "cuda:0", "loopback only handles host memory"}},
      {"dst out of range",
       [&] { b.reduce(host(f), 3, ReduceOp::sum, o); },
       {"reduce", "dst 3 is out of range for a group of 3"}},
      {"src out of range", [&] { b.broadcast(host(f), -1, o); }, {"broadcast", "src -1 is out of range"}},
      {"dtypes differ",
       [&] { b.all_gather(host(one), host(ints), c3, d3, o); },
       {"all_gather", "input is float32 but output is int32"}},
      {"counts per member",
       [&] { b.all_gather(host(one), host(g), c2, d2, o); },
       {"all_gather", "counts has 2 entries (displacements 2) for a group of 3"}},
      {"blocks outside the buffer",
       [&] { b.all_gather(host(one), host(two), c3, d3, o); },
       {"all_gather", "counts [1,1,1] at displacements [0,1,2] do not fit a buffer of 2 elements"}},
      {"own block size",
       [&] { b.all_gather(host(two), host(g), c3, d3, o); },
       {"all_gather", "the input has 2 elements but counts[1] is 1"}},
      {"negative counts",
       [&] {
         const std::vector<std::int64_t> neg{1, -1, 1};
         b.reduce_scatter(host(g), host(one), neg, d3, ReduceOp::sum, o);
       },
       {"reduce_scatter", "negative size in counts [1,-1,1]"}},
      {"all_to_all to itself",
       [&] {
         const std::vector<std::int64_t> sc{1, 2, 1}, sd{0, 1, 3};
         b.all_to_all(host(f), sc, sd, host(g), c3, d3, o);
       },
       {"all_to_all", "sends itself 2 elements but expects 1"}},
      {"all_to_all in place",
       [&] { b.all_to_all(host(f), c3, d3, host(f), c3, d3, o); },
       {"all_to_all", "overlap", "separate buffers"}},
      {"gather blocks per member",
       [&] {
         std::vector<BufferRef> blocks{host(one), host(one)};
         b.gather(host(one), blocks, 1, o);
       },
       {"gather", "one block per member (3), got 2"}},
      {"scatter's own block",
       [&] {
         std::vector<BufferRef> blocks{host(one), host(two), host(one)};
         b.scatter(blocks, host(one), 1, o);
       },
       {"scatter", "own block has 2 elements but its output has 1"}},
      {"send to itself",
       [&] {
         std::vector<P2PRequest> r{{P2PRequest::Kind::send, host(one), 1, 0}};
         b.p2p(r, o);
       },
       {"send", "peer 1 is this rank itself"}},
      {"peer out of range",
       [&] {
         std::vector<P2PRequest> r{{P2PRequest::Kind::recv, host(one), 3, 0}};
         b.p2p(r, o);
       },
       {"recv", "peer 3 is out of range for a group of 3"}},
      {"tag out of range",
       [&] {
         std::vector<P2PRequest> r{{P2PRequest::Kind::send, host(one), 0, kMaxP2PTag}};
         b.p2p(r, o);
       },
       {"send", "tag 8388608 is outside [0, 8388608)"}},
      {"new_group ranks",
       [&] {
         b.new_group(std::vector<int>{0, 0});
       },
       {"new_group", "ranks [0,0] must be distinct group ranks in [0, 3)"}},
      {"timeout", [&] { b.set_timeout(std::chrono::milliseconds(0)); }, {"set_timeout", "must be positive"}},
  };
  for (const Case& c : cases) {
    const std::string msg = error_of(c.call);
    INFO(c.what << ": " << msg);
    CHECK_THAT(msg, Contains(me));
    for (const auto& p : c.parts) {
      CHECK_THAT(msg, Contains(p));
    }
  }
  CHECK(b.hooks == 0);
  CHECK(b.timeout() == std::chrono::seconds(5));
  // Valid arguments reach the hooks.
  b.all_reduce(host(f), ReduceOp::sum, o)->wait();
  b.broadcast(host(f), 2, o)->wait();
  b.barrier(o)->wait();
  CHECK(b.hooks == 3);
}

TEST_CASE("an op a backend leaves out says it is not supported", "[comm][backend]") {
  LoopbackBackend b(1, 3, std::chrono::seconds(5));
  std::vector<float> f(3, 1.0f), g(3, 0.0f), one(1, 0.0f);
  const std::vector<std::int64_t> c3{1, 1, 1}, d3{0, 1, 2};
  std::vector<BufferRef> blocks{host(one), host(one), host(one)};
  std::vector<P2PRequest> reqs{{P2PRequest::Kind::send, host(one), 0, 0}};
  const CommOptions o;
  const std::vector<std::pair<std::string, std::function<void()>>> ops{
      {"reduce", [&] { b.reduce(host(f), 0, ReduceOp::max, o); }},
      {"all_gather", [&] { b.all_gather(host(one), host(g), c3, d3, o); }},
      {"reduce_scatter", [&] { b.reduce_scatter(host(f), host(one), c3, d3, ReduceOp::sum, o); }},
      {"all_to_all", [&] { b.all_to_all(host(f), c3, d3, host(g), c3, d3, o); }},
      {"gather", [&] { b.gather(host(one), blocks, 1, o); }},
      {"scatter", [&] { b.scatter(blocks, host(one), 1, o); }},
      {"p2p", [&] { b.p2p(reqs, o); }},
      {"new_group",
       [&] {
         b.new_group(std::vector<int>{1, 2});
       }},
  };
  for (const auto& [op, call] : ops) {
    const std::string msg = error_of(call);
    INFO(op << ": " << msg);
    CHECK_THAT(msg,
               Contains("rank 1 of loopback group [0,1,2]: " + op + ": loopback does not support " + op));
  }
  // A rank outside a new group is answered by the front (nullptr), without the hook.
  CHECK(b.new_group(std::vector<int>{0, 2}) == nullptr);
}

TEST_CASE("abort() stops every later op before its hook", "[comm][backend]") {
  LoopbackBackend b(0, 2, std::chrono::seconds(5));
  std::vector<float> f(2, 1.0f);
  CHECK_FALSE(b.aborted().has_value());
  b.abort("operator said stop");
  b.abort("again"); // only the first counts
  CHECK(b.aborts == 1);
  CHECK(b.aborted() == std::optional<std::string>("operator said stop"));
  CHECK_THAT(
      error_of([&] { b.all_reduce(host(f), ReduceOp::sum, {}); }),
      Contains("rank 0 of loopback group [0,1]: all_reduce: the group was aborted: operator said stop"));
  CHECK_THAT(error_of([&] { b.split(0, 0); }), Contains("split: the group was aborted"));
  CHECK_THAT(error_of([&] { b.barrier({}); }), Contains("barrier: the group was aborted"));
  CHECK(b.hooks == 0);
}

TEST_CASE("split: the front computes the members through the store, the hook makes the group",
          "[comm][backend]") {
  auto store = std::make_shared<InProcessStore>(std::chrono::seconds(5));
  std::vector<std::shared_ptr<LoopbackBackend>> members;
  for (int r = 0; r < 3; ++r) {
    members.push_back(std::make_shared<LoopbackBackend>(r, 3, std::chrono::seconds(5), store));
  }
  // Colours 0, 1, 0 with keys that reverse the order of the two members of colour 0.
  const int colors[] = {0, 1, 0};
  const int keys[] = {5, 0, 1};
  std::vector<std::shared_ptr<Backend>> out(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] { out[r] = members[r]->split(colors[r], keys[r]); });
  }
  for (auto& t : threads) {
    t.join();
  }
  CHECK(members[0]->last_split.global_ranks == std::vector<int>{2, 0});
  CHECK(members[0]->last_split.rank == 1);
  CHECK(members[2]->last_split.rank == 0);
  CHECK(members[1]->last_split.global_ranks == std::vector<int>{1});
  CHECK(members[1]->last_split.index == 0);
  CHECK(out[0]->size() == 2);
  // Without a store, a group of several members cannot split; one member can.
  LoopbackBackend lone(0, 2, std::chrono::seconds(5));
  CHECK_THAT(error_of([&] { lone.split(0, 0); }),
             Contains("no store to exchange the colours and keys through"));
  LoopbackBackend single(0, 1, std::chrono::seconds(5));
  CHECK(single.split(-1, 0) == nullptr);
  CHECK(single.split(3, 0)->size() == 1);
  CHECK(single.last_split.index == 1); // every split() call is counted
}

TEST_CASE("the registry makes backends by name, init_process_group selects through it", "[comm][backend]") {
  REQUIRE(loopback_registered);
  const auto names = registered_backends();
  CHECK(std::find(names.begin(), names.end(), "gloo") != names.end()); // this test links dtensor::gloo
  CHECK(std::find(names.begin(), names.end(), "loopback") != names.end());
  CHECK(resolve_backend_name("LOOPBACK") == "loopback");
  // "auto" never picks a backend registered without a usable() test.
  CHECK(resolve_backend_name("auto") != "loopback");
  CHECK_THAT(error_of([] { resolve_backend_name("ucc"); }), Contains("unknown backend 'ucc' (registered: "));
  CHECK_THAT(error_of([] { resolve_backend_name("ucc"); }), Contains("loopback"));
  // A backend dtensor ships with, left out of this build (this test does not link dtensor::mpi).
  CHECK_THAT(error_of([] { resolve_backend_name("mpi"); }), Contains("link the CMake target dtensor::mpi"));

  InitOptions options;
  options.backend = "Loopback";
  options.env = DistEnv{};
  options.timeout = std::chrono::seconds(7);
  const int before = made;
  auto world = init_process_group(options);
  CHECK(made == before + 1);
  CHECK(world.backend_name() == "loopback");
  CHECK(world.backend().name() == "loopback");
  CHECK(last_options.timeout == std::chrono::seconds(7));
  CHECK_THAT(last_options.prefix, Contains("/loopback"));
  CHECK(last_options.device == 0);
  auto t = Tensor<float, 1>::full({4}, 2.0f);
  all_reduce(t, ReduceOp::sum, world); // typed front -> ProcessGroup -> Backend front -> hook
  barrier(world);
  CHECK(dynamic_cast<LoopbackBackend&>(world.backend()).hooks == 2);
  CHECK_THAT(error_of([&] { all_gather_into_tensor(Tensor<float, 1>({4}), t, world); }),
             Contains("loopback does not support all_gather"));
  auto sub = world.split(0, 0);
  CHECK(sub.is_member());
  CHECK(sub.backend_name() == "loopback");

  ::setenv("DTENSOR_BACKEND", "loopback", 1);
  InitOptions from_env;
  from_env.env = DistEnv{};
  auto again = init_process_group(from_env);
  ::unsetenv("DTENSOR_BACKEND");
  CHECK(again.backend_name() == "loopback");
  CHECK(made == before + 2);
}

namespace {

/// Records the stream each op was submitted on; accepts device buffers it never touches (the tests pass
/// made-up device pointers and streams: no GPU is needed to see which stream the front end chose).
class StreamRecorder final : public Backend {
public:
  StreamRecorder() : Backend(std::chrono::seconds(5)) {}
  std::string_view name() const noexcept override { return "stream-recorder"; }
  int rank() const noexcept override { return 0; }
  int size() const noexcept override { return 1; }
  std::span<const int> global_ranks() const noexcept override { return ranks_; }
  std::string describe() const override { return "stream recorder"; }

  std::vector<void*> streams;

protected:
  WorkPtr do_all_reduce(BufferRef, ReduceOp, const CommOptions& o) override { return seen(o); }
  WorkPtr do_all_gather(BufferRef, BufferRef, std::span<const std::int64_t>, std::span<const std::int64_t>,
                        const CommOptions& o) override {
    return seen(o);
  }
  void check_memory(const char*, const BufferRef&, const char*) const override {}

private:
  WorkPtr seen(const CommOptions& o) {
    streams.push_back(o.stream);
    return std::make_shared<DoneWork>();
  }
  std::vector<int> ranks_{0};
};

} // namespace

TEST_CASE("an op runs on its tensor's stream, a StreamGuard's, or the one given", "[comm][stream]") {
  auto recorder = std::make_shared<StreamRecorder>();
  ProcessGroup g(recorder);
  auto* s1 = reinterpret_cast<CUstream_st*>(0x1000);
  auto* s2 = reinterpret_cast<CUstream_st*>(0x2000);
  auto* s3 = reinterpret_cast<CUstream_st*>(0x3000);
  auto* fake = reinterpret_cast<float*>(0x10000); // device memory nobody dereferences
  auto t = Tensor<float, 1>::from_blob(fake, {4}, {1}, Device::cuda(0), s1);
  auto u = Tensor<float, 1>::from_blob(fake + 64, {4}, {1}, Device::cuda(0), s2);
  CHECK(t.stream_handle() == s1);

  all_reduce(t, ReduceOp::sum, g); // the tensor's own stream
  {
    StreamGuard on(s2); // like torch.cuda.stream(s2)
    all_reduce(t, ReduceOp::sum, g);
    {
      StreamGuard inner(s3);
      all_reduce(t, ReduceOp::sum, g);
    }
    all_reduce(t, ReduceOp::sum, g);
  }
  CommOptions given;
  given.stream = s3;
  g.all_reduce(BufferRef{t.data(), 4, DType::float32, Device::cuda(0), s1}, ReduceOp::sum, given)->wait();
  REQUIRE(recorder->streams.size() == 5);
  CHECK(recorder->streams[0] == s1);
  CHECK(recorder->streams[1] == s2);
  CHECK(recorder->streams[2] == s3);
  CHECK(recorder->streams[3] == s2);
  CHECK(recorder->streams[4] == s3);

  // Input and output on different streams: the op takes the first one's, and its completion also
  // synchronises that stream (so the output's stream may release or reuse its buffer after wait()).
  const std::int64_t counts[] = {4};
  const std::int64_t displs[] = {0};
  auto w = g.all_gather(BufferRef{t.data(), 4, DType::float32, Device::cuda(0), s1},
                        BufferRef{u.data(), 4, DType::float32, Device::cuda(0), s2}, counts, displs,
                        CommOptions{});
  CHECK(recorder->streams.back() == s1);
  CHECK(dynamic_cast<detail::StreamSyncedWork*>(w.get()) != nullptr);
  auto same = g.all_gather(BufferRef{t.data(), 4, DType::float32, Device::cuda(0), s1},
                           BufferRef{u.data(), 4, DType::float32, Device::cuda(0), s1}, counts, displs,
                           CommOptions{});
  CHECK(dynamic_cast<detail::StreamSyncedWork*>(same.get()) == nullptr);
}
