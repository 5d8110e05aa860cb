// Launcher scenarios, one per ctest: launcher_test <dtensor-run> <rank_program> <scenario>
//   prefix        per-rank output prefixes, torchrun variables, --local-ranks-filter, --log-dir
//   early_exit    one rank exits non-zero: the others are stopped, the exit code and message name it
//   signals       SIGTERM and SIGINT reach every rank; the launcher exits 128+signal, no rank survives
//   unreachable   a master port nobody serves, and one that accepts but never answers: clear timeout errors
//   multinode     two launchers on one machine acting as two nodes; then a failure on node 1 stops node 0
//   rank0_store   --rank0-store: rank 0 hosts the store, ranks started in any order still meet
//   launcherless  ranks started as mpirun / srun start them (OpenMPI, Slurm variables), in reverse order
//   orphans       the launcher killed by SIGKILL: the ranks' own children die too
//   flags         malformed flags are refused with a clear message (--stop-timeout and --rdzv-last-call -1,
//                 nan, 1x, " 5", 0x10; counts not written in decimal)
//   store_security  --standalone: the store listens on loopback only and refuses clients without the
//                 job's token, which the ranks get
//   restarts      --max-restarts: a rank SIGKILLed in the first starts, every rank started again with
//                 DTENSOR_RESTART_COUNT and a fresh part of the store, until it succeeds or no restart is
//                 left; --nproc-per-node MIN:MAX leaves the failed rank out of the restart; bad flags
//   restarts_mpi  the same through mpirun (--backend mpi)
//   multinode_restarts  two launchers as two nodes with --max-restarts: a rank of node 1 killed, both nodes
//                 start again; elastic --nnodes 1:2: node 1's launcher killed, node 0 goes on alone
// Dead and missing peers, with fault_program as the program (DTENSOR_TIMEOUT=2, three ranks): every
// survivor gets an Error naming the cause within 2 timeouts, never an abort.
//   kill_store_host  rank 0 hosts the store (--rank0-store) and is SIGKILLed mid-collective
//   kill_rank        rank 2 is SIGKILLed mid-collective (the launcher hosts the store); here
//                    DTENSOR_TIMEOUT=10 and the survivors' errors must come within 1.5 s (docs/failures.md
//                    promises about 1 s: detection does not wait for the timeout)
//   kill_rank_4      four ranks, rank 1 (not the last) SIGKILLed: ranks 0, 2 and 3 name rank 1 alone, how
//                    it ended, and none of the live ranks blocked beside them
//   stop_rank        rank 2 gets SIGTERM mid-collective
//   never_joins      rank 2 never calls init_process_group
//   port_in_use      --master-port held by another program: a clear error at once, no hang
// Plain C++ (no Catch2): prints what it checks, exits 0 on success, 1 on the first failed check.
#include "dtensor/rendezvous/tcp_store.hpp"
#include "dtensor/rendezvous/tcp_store_server.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

std::string g_launcher;
std::string g_program;
int g_failures = 0;

#define EXPECT(cond, what)                                                                                   \
  do {                                                                                                       \
    if (!(cond)) {                                                                                           \
      std::printf("FAILED: %s  [%s]  (line %d)\n", std::string(what).c_str(), #cond, __LINE__);              \
      ++g_failures;                                                                                          \
    } else {                                                                                                 \
      std::printf("ok: %s\n", std::string(what).c_str());                                                    \
    }                                                                                                        \
  } while (false)

/// A child process with its stdout+stderr captured.
struct Proc {
  pid_t pid = -1;
  int out = -1;
  std::string output;
  int status = 0;
  bool done = false;
  Clock::time_point start = Clock::now();

  Proc(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
    int p[2];
    if (::pipe(p) != 0) {
      std::perror("pipe");
      std::exit(1);
    }
    pid = ::fork();
    if (pid == 0) {
      ::dup2(p[1], 1);
      ::dup2(p[1], 2);
      ::close(p[0]);
      ::close(p[1]);
      for (const auto& [k, v] : env) {
        ::setenv(k.c_str(), v.c_str(), 1);
      }
      std::vector<char*> args;
      for (const auto& a : argv) {
        args.push_back(const_cast<char*>(a.c_str()));
      }
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::perror("execv");
      ::_exit(127);
    }
    ::close(p[1]);
    out = p[0];
    ::fcntl(out, F_SETFL, O_NONBLOCK);
  }

  /// Reads output until `pred(output)` or `limit`; true when pred became true.
  template <class Pred>
  bool read_until(Pred pred, std::chrono::milliseconds limit) {
    const auto until = Clock::now() + limit;
    while (!pred(output)) {
      if (Clock::now() >= until || out < 0) {
        return pred(output);
      }
      pollfd pfd{out, POLLIN, 0};
      ::poll(&pfd, 1, 50);
      char buf[4096];
      for (;;) {
        const ssize_t k = ::read(out, buf, sizeof(buf));
        if (k > 0) {
          output.append(buf, static_cast<std::size_t>(k));
          continue;
        }
        if (k == 0) {
          ::close(out);
          out = -1;
        }
        break;
      }
    }
    return true;
  }

  /// Waits for exit (killing it after `limit`); returns the elapsed time since start.
  std::chrono::milliseconds wait(std::chrono::milliseconds limit) {
    read_until([](const std::string&) { return false; }, limit); // to EOF or the limit
    const auto until = Clock::now() + 2s;
    while (!done) {
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        done = true;
        break;
      }
      if (Clock::now() > until) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        done = true;
        output += "\n[launcher_test: killed the launcher, it did not exit]\n";
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  }

  int code() const { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }
};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

int count_of(const std::string& s, const std::string& part) {
  int n = 0;
  for (std::size_t at = s.find(part); at != std::string::npos; at = s.find(part, at + 1)) {
    ++n;
  }
  return n;
}

/// The pids the ranks printed as "[rankN]: <word> <pid>".
std::vector<pid_t> pids_after(const std::string& output, const std::string& word) {
  std::vector<pid_t> pids;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    const auto at = line.find("]: " + word + " ");
    if (at != std::string::npos) {
      pids.push_back(static_cast<pid_t>(std::atoi(line.c_str() + at + word.size() + 4)));
    }
  }
  return pids;
}

bool all_dead(const std::vector<pid_t>& pids) {
  for (int tries = 0; tries < 50; ++tries) {
    bool dead = true;
    for (pid_t p : pids) {
      ::waitpid(p, nullptr, WNOHANG); // an orphan this test adopted (main: a subreaper) is reaped here
      dead = dead && ::kill(p, 0) != 0;
    }
    if (dead) {
      return true;
    }
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

int free_port() {
  dtensor::TcpStoreServer s(0);
  return s.port();
}

void show(const Proc& p) {
  std::printf("---- output ----\n%s----------------\n", p.output.c_str());
}

// ---- scenarios ------------------------------------------------------------------------------------------

/// dtensor-run with each case's flags exits 2 at once, saying its text.
void expect_refused(const std::vector<std::pair<std::vector<std::string>, std::string>>& cases) {
  for (const auto& [flags, why] : cases) {
    std::vector<std::string> argv = {g_launcher};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back(g_program);
    Proc p(argv, {});
    p.wait(10s);
    EXPECT(p.code() == 2 && contains(p.output, why), "refused with '" + why + "': " + p.output);
  }
}

/// The "start <k> rank <r> of <n>" lines of a run of rank_program restart.
int starts_seen(const std::string& out, int k, int n) {
  int seen = 0;
  for (int r = 0; r < n; ++r) {
    seen += count_of(out, "start " + std::to_string(k) + " rank " + std::to_string(r) + " of " +
                              std::to_string(n) + "\n");
  }
  return seen;
}

/// `killed`: the exit code a run ending with a SIGKILLed rank gives (dtensor-run: 137; mpirun: its own).
void restarts_with(const std::vector<std::string>& launch, bool mpi) {
  auto killed = [&](int code) { return mpi ? code != 0 : code == 128 + SIGKILL; };
  auto run = [&](std::vector<std::string> flags, std::vector<std::string> program) {
    std::vector<std::string> argv = launch;
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back(g_program);
    argv.insert(argv.end(), program.begin(), program.end());
    auto p = std::make_unique<Proc>(argv, std::map<std::string, std::string>{});
    p->wait(60s);
    show(*p);
    return p;
  };
  const auto ok = run({"--nproc-per-node", "3", "--max-restarts", "2"}, {"restart", "1", "2"});
  EXPECT(ok->code() == 0, "rank 1 killed in starts 0 and 1: the third start succeeds, exit 0 (got " +
                              std::to_string(ok->code()) + ")");
  EXPECT(contains(ok->output, "restart 1 of 2") && contains(ok->output, "restart 2 of 2"),
         "the launcher reports each restart");
  for (int k = 0; k < 3; ++k) {
    EXPECT(starts_seen(ok->output, k, 3) == 3,
           "start " + std::to_string(k) + ": every rank with DTENSOR_RESTART_COUNT=" + std::to_string(k));
  }
  EXPECT(!contains(ok->output, "visible"), "no start sees an earlier start's keys");

  const auto out = run({"--nproc-per-node", "3", "--max-restarts", "1"}, {"restart", "1", "2"});
  EXPECT(killed(out->code()), "one restart is not enough: the launcher exits as the killed rank (got " +
                                  std::to_string(out->code()) + ")");
  EXPECT(contains(out->output, "no restart left (1 of 1 used)") && starts_seen(out->output, 2, 3) == 0,
         "it says no restart is left and starts no third time");

  const auto elastic = run({"--nproc-per-node", "2:4", "--max-restarts", "3"}, {"restart", "3", "5"});
  EXPECT(elastic->code() == 0, "elastic 2:4, rank 3 killed: the restart on 3 ranks succeeds (got " +
                                   std::to_string(elastic->code()) + ")");
  EXPECT(starts_seen(elastic->output, 0, 4) == 4 && starts_seen(elastic->output, 1, 3) == 3 &&
             starts_seen(elastic->output, 2, 3) == 0,
         "4 ranks in start 0, then 3 (WORLD_SIZE 3) in start 1, and no other start");
  const auto floor = run({"--nproc-per-node", "2:3", "--max-restarts", "2"}, {"restart", "1", "5"});
  EXPECT(
      killed(floor->code()) && starts_seen(floor->output, 1, 2) == 2 && starts_seen(floor->output, 2, 2) == 2,
      "elastic 2:3 with rank 1 always failing: 3 ranks, then 2, then 2 (never below MIN), then it gives up");
}

void restarts() {
  restarts_with({g_launcher, "--standalone", "--stop-timeout", "5"}, false);
  expect_refused(
      {{{"--nproc-per-node", "2:4"}, "give --max-restarts N too"},
       {{"--nproc-per-node", "4:2", "--max-restarts", "1"}, "is not an integer in [4, 4096]"},
       {{"--max-restarts", "-1"}, "is not an integer in [0,"},
       {{"--nproc-per-node", "4", "--replica-size", "3"}, "does not divide --nproc-per-node 4"},
       {{"--nproc-per-node", "4", "--replica-size", "0"}, "is not an integer in [1, 4096]"},
       {{"--nproc-per-node", "2:4", "--max-restarts", "1", "--replica-size", "1"},
        "per-replica restarts work on one machine"},
       {{"--rank0-store", "--replica-size", "1"}, "the launcher's store (leave out --rank0-store)"},
       {{"--backend", "mpi", "--replica-size", "1"}, "--replica-size needs --backend gloo"}});
}

void restarts_mpi() {
  restarts_with({g_launcher, "--backend", "mpi"}, true);
}

void prefix() {
  const std::string dir = "launcher_test_logs_" + std::to_string(::getpid());
  Proc p({g_launcher, "--standalone", "--nproc-per-node", "3", "--log-dir", dir, g_program, "env"}, {});
  p.wait(20s);
  show(p);
  EXPECT(p.code() == 0, "three ranks exit 0");
  for (int r = 0; r < 3; ++r) {
    EXPECT(contains(p.output, "[rank" + std::to_string(r) + "]: rank " + std::to_string(r) + " of 3 local " +
                                  std::to_string(r) + "/3 master 127.0.0.1:"),
           "rank " + std::to_string(r) + "'s stdout line is prefixed and its variables are right");
    EXPECT(contains(p.output, "[rank" + std::to_string(r) + "]: stderr of rank " + std::to_string(r)),
           "rank " + std::to_string(r) + "'s stderr line is prefixed");
  }
  EXPECT(!contains(p.output, ":29500"), "--standalone picks a free port, not 29500");
  std::ifstream log(dir + "/rank_1.stdout");
  std::string line;
  std::getline(log, line);
  EXPECT(contains(line, "rank 1 of 3"), "--log-dir keeps rank 1's stdout (without prefix)");
  std::system(("rm -rf " + dir).c_str());

  Proc f({g_launcher, "--standalone", "--nproc-per-node", "3", "--local-ranks-filter", "1", g_program, "env"},
         {});
  f.wait(20s);
  EXPECT(f.code() == 0 && contains(f.output, "[rank1]:") && !contains(f.output, "[rank0]:") &&
             !contains(f.output, "[rank2]:"),
         "--local-ranks-filter 1 shows only rank 1");

  Proc t({g_launcher, "--standalone", "--nproc-per-node", "2", "--tee", "0", g_program, "env"}, {});
  t.wait(20s);
  EXPECT(t.code() == 0 && !contains(t.output, "[rank") && count_of(t.output, " of 2 local ") == 2,
         "--tee 0 passes output through unprefixed");
}

void early_exit() {
  Proc p({g_launcher, "--standalone", "--nproc-per-node", "4", "--stop-timeout", "5", g_program, "fail", "2",
          "7"},
         {});
  const auto took = p.wait(30s);
  show(p);
  EXPECT(p.code() == 7,
         "the launcher exits with the failed rank's code (7), got " + std::to_string(p.code()));
  EXPECT(count_of(p.output, "rank 2 (local rank 2 on node 0") == 1, "one message names rank 2");
  EXPECT(contains(p.output, "failed: exit code 7"), "the message gives its exit code");
  EXPECT(took < 10s, "the others are stopped at once (" + std::to_string(took.count()) + " ms)");
  const auto pids = pids_after(p.output, "pid");
  EXPECT(pids.size() == 4, "four ranks reported their pid");
  EXPECT(all_dead(pids), "no rank survives the launcher");

  // A rank killed by a signal is reported with the signal's name.
  Proc k({g_launcher, "--standalone", "--nproc-per-node", "2", "/bin/sh", "-c",
          "if [ \"$RANK\" = 1 ]; then kill -SEGV $$; fi; sleep 30"},
         {});
  k.wait(30s);
  show(k);
  EXPECT(k.code() == 128 + SIGSEGV && contains(k.output, "rank 1 ") &&
             contains(k.output, "killed by SIGSEGV"),
         "a rank killed by SIGSEGV: exit 139 naming rank 1 and the signal");
}

void signals() {
  for (int sig : {SIGTERM, SIGINT}) {
    Proc p({g_launcher, "--standalone", "--nproc-per-node", "3", g_program, "sleep"}, {});
    const bool ready = p.read_until([](const std::string& s) { return count_of(s, "ready ") == 3; }, 20s);
    EXPECT(ready, "three ranks started");
    const auto t0 = Clock::now();
    ::kill(p.pid, sig);
    p.wait(30s);
    show(p);
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
    const std::string name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
    EXPECT(p.code() == 128 + sig,
           name + ": the launcher exits " + std::to_string(128 + sig) + ", got " + std::to_string(p.code()));
    EXPECT(contains(p.output, "forwarding it to 3 rank(s)"), name + " is forwarded to the ranks");
    EXPECT(took < 5s, name + ": the ranks stop at once (" + std::to_string(took.count()) + " ms)");
    EXPECT(all_dead(pids_after(p.output, "ready")), name + ": no rank survives");
  }
}

void unreachable() {
  const int port = free_port(); // nobody listens here
  const std::map<std::string, std::string> env = {{"DTENSOR_TIMEOUT", "2"}};
  // A rank started by hand (as mpirun/srun would) for a master that is not there.
  Proc r({g_program, "store"}, {{"RANK", "1"},
                                {"WORLD_SIZE", "2"},
                                {"MASTER_ADDR", "127.0.0.1"},
                                {"MASTER_PORT", std::to_string(port)},
                                {"DTENSOR_TIMEOUT", "2"}});
  auto took = r.wait(30s);
  show(r);
  EXPECT(r.code() == 1, "the rank fails");
  EXPECT(contains(r.output, "could not reach the store") &&
             contains(r.output, "127.0.0.1:" + std::to_string(port)) &&
             contains(r.output, "within 2000 ms") && contains(r.output, "MASTER_ADDR"),
         "its error names the address, the timeout and what to check");
  EXPECT(took >= 1900ms && took < 10s,
         "it gives up after the timeout (" + std::to_string(took.count()) + " ms)");

  // The launcher of node 1 cannot reach node 0.
  Proc l({g_launcher, "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
          std::to_string(port), "--nproc-per-node", "2", g_program, "store"},
         env);
  took = l.wait(30s);
  show(l);
  EXPECT(l.code() != 0, "the launcher fails");
  EXPECT(contains(l.output, "could not reach the store at") ||
             contains(l.output, "could not reach the store"),
         "the launcher says it could not reach the store");
  EXPECT(took < 10s, "the launcher gives up after the timeout (" + std::to_string(took.count()) + " ms)");

  // A master that accepts connections but never answers (wrong service, hung process).
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::listen(fd, 16);
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  Proc s({g_program, "store"}, {{"RANK", "1"},
                                {"WORLD_SIZE", "2"},
                                {"MASTER_ADDR", "127.0.0.1"},
                                {"MASTER_PORT", std::to_string(ntohs(a.sin_port))},
                                {"DTENSOR_TIMEOUT", "2"}});
  took = s.wait(30s);
  show(s);
  EXPECT(s.code() == 1 && contains(s.output, "did not answer the store handshake"),
         "a silent master is reported as such");
  EXPECT(took < 10s, "within the timeout (" + std::to_string(took.count()) + " ms)");
  ::close(fd);
}

void multinode() {
  const int port = free_port();
  auto node = [&](int node_rank, const std::vector<std::string>& prog) {
    std::vector<std::string> argv = {g_launcher,
                                     "--nnodes",
                                     "2",
                                     "--node-rank",
                                     std::to_string(node_rank),
                                     "--master-addr",
                                     "127.0.0.1",
                                     "--master-port",
                                     std::to_string(port),
                                     "--nproc-per-node",
                                     "2"};
    argv.insert(argv.end(), prog.begin(), prog.end());
    return argv;
  };
  {
    // Node 1 starts first: its launcher and ranks wait for node 0's store.
    Proc n1(node(1, {g_program, "store"}), {{"DTENSOR_TIMEOUT", "20"}});
    std::this_thread::sleep_for(300ms);
    Proc n0(node(0, {g_program, "store"}), {{"DTENSOR_TIMEOUT", "20"}});
    n1.wait(40s);
    n0.wait(40s);
    show(n0);
    show(n1);
    EXPECT(n0.code() == 0 && n1.code() == 0, "two nodes of two ranks meet through node 0's store");
    EXPECT(count_of(n0.output, "store ok") == 2 && count_of(n1.output, "store ok") == 2,
           "all four ranks say ok");
    EXPECT(contains(n1.output, "[rank3]:"), "node 1 runs ranks 2 and 3");
  }
  {
    // Rank 3 (node 1) fails: node 0's ranks are stopped too and its launcher names rank 3.
    Proc n0(node(0, {g_program, "fail", "3", "5"}), {{"DTENSOR_TIMEOUT", "20"}});
    Proc n1(node(1, {g_program, "fail", "3", "5"}), {{"DTENSOR_TIMEOUT", "20"}});
    auto took1 = n1.wait(40s);
    auto took0 = n0.wait(40s);
    show(n0);
    show(n1);
    EXPECT(n1.code() == 5, "node 1 exits with rank 3's code");
    EXPECT(n0.code() != 0 && contains(n0.output, "rank 3 (local rank 1 on node 1"),
           "node 0 fails too, naming rank 3 on node 1");
    EXPECT(took0 < 15s && took1 < 15s, "both stop quickly");
    EXPECT(all_dead(pids_after(n0.output + n1.output, "pid")), "no rank survives on either node");
  }
}

void multinode_restarts() {
  const int port = free_port();
  auto node = [&](int node_rank, const std::string& nnodes, const std::vector<std::string>& prog) {
    std::vector<std::string> argv = {g_launcher,
                                     "--nnodes",
                                     nnodes,
                                     "--node-rank",
                                     std::to_string(node_rank),
                                     "--master-addr",
                                     "127.0.0.1",
                                     "--master-port",
                                     std::to_string(port),
                                     "--nproc-per-node",
                                     "2",
                                     "--max-restarts",
                                     "1",
                                     "--rdzv-last-call",
                                     "1",
                                     "--stop-timeout",
                                     "5"};
    argv.insert(argv.end(), prog.begin(), prog.end());
    return argv;
  };
  {
    // Rank 3 (node 1) killed in the first start: both launchers stop their ranks and start them again.
    Proc n1(node(1, "2", {g_program, "restart", "3", "1"}), {{"DTENSOR_TIMEOUT", "20"}});
    Proc n0(node(0, "2", {g_program, "restart", "3", "1"}), {{"DTENSOR_TIMEOUT", "20"}});
    n1.wait(60s);
    n0.wait(60s);
    show(n0);
    show(n1);
    EXPECT(n0.code() == 0 && n1.code() == 0, "both nodes finish after one restart");
    EXPECT(starts_seen(n0.output + n1.output, 0, 4) >= 3 && starts_seen(n0.output + n1.output, 1, 4) == 4,
           "the first start on 4 ranks, then all 4 again with DTENSOR_RESTART_COUNT=1");
    EXPECT(contains(n0.output, "start 1: node 0 of 2") && contains(n1.output, "start 1: node 1 of 2"),
           "each start's nodes meet at its rendezvous");
    EXPECT(!contains(n0.output + n1.output, "visible"), "no start sees an earlier start's keys");
  }
  {
    // Elastic 1:2: node 1's launcher killed mid-start (its ranks die with it); node 0's ranks fail at
    // their last barrier, and node 0 starts again alone.
    Proc n0(node(0, "1:2", {g_program, "restart", "-1", "0", "4000"}), {{"DTENSOR_TIMEOUT", "3"}});
    Proc n1(node(1, "1:2", {g_program, "restart", "-1", "0", "4000"}), {{"DTENSOR_TIMEOUT", "3"}});
    const bool up =
        n1.read_until([](const std::string& o) { return contains(o, "start 0 rank 3 of 4"); }, 30s);
    EXPECT(up, "node 1's ranks started");
    ::kill(n1.pid, SIGKILL);
    n1.wait(10s);
    n0.wait(60s);
    show(n0);
    EXPECT(n0.code() == 0, "node 0 finishes alone (got " + std::to_string(n0.code()) + ")");
    EXPECT(contains(n0.output, "start 1: node 0 of 1") && starts_seen(n0.output, 1, 2) == 2,
           "the restart runs on node 0 only: 2 ranks, WORLD_SIZE 2");
  }
  expect_refused(
      {{{"--nnodes", "1:2"}, "give --max-restarts N too"},
       {{"--nnodes", "2", "--nproc-per-node", "1:2", "--max-restarts", "1"}, "the elastic unit is the node"},
       {{"--nnodes", "2", "--max-restarts", "1", "--rank0-store"}, "needs the launchers' store"}});
}

void rank0_store() {
  Proc p({g_launcher, "--standalone", "--nproc-per-node", "3", "--rank0-store", "--master-port",
          std::to_string(free_port()), g_program, "store"},
         {{"DTENSOR_TIMEOUT", "20"}});
  p.wait(40s);
  show(p);
  EXPECT(p.code() == 0 && count_of(p.output, "store ok") == 3, "three ranks meet at rank 0's store");
  EXPECT(contains(p.output, "store ok on rank 0 (hosting)"), "rank 0 hosts it");
}

/// Ranks started without dtensor-run, as mpirun and srun start them: the OpenMPI and Slurm variables,
/// rank 0 hosting the store, ranks arriving in reverse order.
void launcherless() {
  for (const std::string kind : {"openmpi", "slurm"}) {
    const int port = free_port();
    std::vector<std::unique_ptr<Proc>> procs;
    for (int r = 2; r >= 0; --r) {
      std::map<std::string, std::string> env = {{"MASTER_PORT", std::to_string(port)},
                                                {"DTENSOR_TIMEOUT", "20"}};
      if (kind == "openmpi") {
        env.insert({{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
                    {"OMPI_COMM_WORLD_SIZE", "3"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}});
      } else {
        env.insert({{"SLURM_PROCID", std::to_string(r)},
                    {"SLURM_NTASKS", "3"},
                    {"SLURM_LOCALID", std::to_string(r)},
                    {"SLURM_STEP_NODELIST", "localhost"}});
      }
      procs.push_back(std::make_unique<Proc>(std::vector<std::string>{g_program, "store"}, env));
      std::this_thread::sleep_for(100ms);
    }
    int ok = 0;
    std::string all;
    for (auto& p : procs) {
      p->wait(40s);
      ok += p->code() == 0 ? 1 : 0;
      all += p->output;
    }
    std::printf("---- output ----\n%s----------------\n", all.c_str());
    EXPECT(ok == 3 && count_of(all, "store ok") == 3, kind + ": three ranks meet without a launcher");
    EXPECT(contains(all, "store ok on rank 0 (hosting)"), kind + ": rank 0 hosts the store");
  }
}

/// Checks that rank `r` printed fault_program's Error line within `max_ms` of the op's start, containing
/// each of `causes`.
void expect_error(const std::string& output, const std::string& what, int r,
                  const std::vector<std::string>& causes, long max_ms,
                  const std::vector<std::string>& absent = {}) {
  const std::string rank = std::to_string(r);
  const std::string head = "[rank" + rank + "]: fault error on rank " + rank + " after ";
  const auto at = output.find(head);
  EXPECT(at != std::string::npos, what + ": rank " + rank + " got an Error");
  if (at == std::string::npos) {
    return;
  }
  const std::string line = output.substr(at, output.find('\n', at) - at);
  const long ms = std::atol(line.c_str() + head.size());
  EXPECT(ms <= max_ms, what + ": rank " + rank + "'s error came within " + std::to_string(max_ms) + " ms (" +
                           std::to_string(ms) + " ms)");
  for (const auto& cause : causes) {
    EXPECT(contains(line, cause), what + ": rank " + rank + "'s error says '" + cause + "'");
  }
  for (const auto& wrong : absent) {
    EXPECT(!contains(line, wrong), what + ": rank " + rank + "'s error does not say '" + wrong + "'");
  }
}

/// What dead_peer runs beyond its defaults: the number of ranks, the rank that fails (-1: fault_program's
/// choice), what no survivor's error may say.
struct DeadPeer {
  int nproc = 3;
  int victim = -1;
  std::vector<std::string> absent;
};

/// Runs fault_program `what` with DTENSOR_TIMEOUT=`timeout_s`; every rank in `survivors` must print an
/// Error that contains each of `causes` within `max_ms` of the op (or init) it was in (by default two
/// timeouts).
void dead_peer(const std::string& what, const std::vector<int>& survivors,
               const std::vector<std::string>& causes, int timeout_s = 2, long max_ms = 0,
               const DeadPeer& how = {}) {
  std::vector<std::string> argv = {
      g_launcher, "--standalone", "--nproc-per-node", std::to_string(how.nproc), "--stop-timeout", "20"};
  if (what == "kill_store_host") {
    argv.insert(argv.end(), {"--rank0-store", "--master-port", std::to_string(free_port())});
  }
  argv.insert(argv.end(), {g_program, what});
  std::map<std::string, std::string> env = {{"DTENSOR_TIMEOUT", std::to_string(timeout_s)}};
  if (how.victim >= 0) {
    env["FAULT_VICTIM"] = std::to_string(how.victim);
  }
  Proc p(argv, env);
  if (what == "stop_rank") {
    const bool stopped = p.read_until([](const std::string& s) { return contains(s, "]: stopped "); }, 30s);
    EXPECT(stopped, "rank 2 reached the loop");
    const auto pids = pids_after(p.output, "stopped");
    if (pids.size() == 1) {
      ::kill(pids[0], SIGTERM);
    }
  }
  const auto took = p.wait(60s);
  show(p);
  for (int r : survivors) {
    expect_error(p.output, what, r, causes, max_ms > 0 ? max_ms : 2 * 1000L * timeout_s, how.absent);
  }
  EXPECT(!contains(p.output, "terminate called") && !contains(p.output, "SIGABRT"),
         what + ": nothing aborts");
  EXPECT(took < 30s, what + ": the job ends (" + std::to_string(took.count()) + " ms)");
}

void kill_store_host() {
  dead_peer("kill_store_host", {1, 2}, {"the store is gone", "its host, rank 0"});
}
void kill_rank() {
  // Detected from the closed connection, not by the timeout: within 1.5 s of a 10 s timeout.
  // The launcher saw rank 2 end; rank 0, blocked in the same op, is not named (it was, before the launcher
  // recorded exits: "no report from ranks 0, 2").
  dead_peer("kill_rank", {0, 1}, {"rank 2 (global 2) ended: killed by SIGKILL, seen by dtensor-run"}, 10,
            1500,
            {.absent = {"no report from", "rank 0 (global 0) ended", "rank 1 (global 1) ended",
                        "because a peer failed"}});
}
void kill_rank_4() {
  dead_peer("kill_rank", {0, 2, 3}, {"rank 1 (global 1) ended: killed by SIGKILL, seen by dtensor-run"}, 10,
            1500,
            {.nproc = 4,
             .victim = 1,
             .absent = {"no report from", "rank 0 (global 0) ended", "rank 2 (global 2) ended",
                        "rank 3 (global 3) ended", "because a peer failed"}});
}
void stop_rank() {
  dead_peer("stop_rank", {0, 1}, {"rank 2 (global 2) ended: killed by SIGTERM, seen by dtensor-run"}, 2, 0,
            {.absent = {"no report from", "because a peer failed"}});
}
void never_joins() {
  dead_peer("never_joins", {0, 1}, {"rank 2 of the group did not arrive within 2000 ms"});
}

/// The store's port is held by a program that accepts connections but never answers.
void port_in_use() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::listen(fd, 16);
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string port = std::to_string(ntohs(a.sin_port));
  const std::map<std::string, std::string> env = {{"DTENSOR_TIMEOUT", "2"}};

  Proc l({g_launcher, "--master-port", port, "--nproc-per-node", "2", g_program, "kill_rank"}, env);
  auto took = l.wait(30s);
  show(l);
  EXPECT(l.code() == 2 && contains(l.output, "cannot listen on 127.0.0.1:" + port) &&
             contains(l.output, "another program holds this port"),
         "the launcher cannot host the store: exit 2 naming the port and the cause");
  EXPECT(took < 5s, "at once (" + std::to_string(took.count()) + " ms)");

  Proc r({g_launcher, "--nproc-per-node", "3", "--rank0-store", "--master-port", port, "--stop-timeout", "20",
          g_program, "kill_rank"},
         env);
  took = r.wait(60s);
  show(r);
  // Within two timeouts (DTENSOR_TIMEOUT=2).
  expect_error(r.output, "port_in_use", 0,
               {"cannot listen on 127.0.0.1:" + port, "another program holds this port"}, 4000);
  for (int rank : {1, 2}) {
    expect_error(r.output, "port_in_use", rank, {"did not answer the store handshake"}, 4000);
  }
  EXPECT(took < 30s, "the job ends (" + std::to_string(took.count()) + " ms)");
  ::close(fd);
}

void orphans() {
  Proc p({g_launcher, "--standalone", "--nproc-per-node", "2", "/bin/sh", "-c",
          "sleep 60 & echo child $!; wait"},
         {});
  const bool ready = p.read_until([](const std::string& s) { return count_of(s, "]: child ") == 2; }, 20s);
  EXPECT(ready, "both ranks started a child");
  ::kill(p.pid, SIGKILL);
  p.wait(10s);
  show(p);
  const auto children = pids_after(p.output, "child");
  EXPECT(children.size() == 2 && all_dead(children),
         "the ranks' children die with a launcher killed by SIGKILL");
}

/// The local addresses (hex, as /proc/net/tcp{,6} print them) of the sockets listening on `port`.
std::vector<std::string> listening_addresses(int port) {
  char port_hex[8];
  std::snprintf(port_hex, sizeof(port_hex), "%04X", port);
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line); // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const auto colon = local.find(':');
      if (state == "0A" && colon != std::string::npos && local.substr(colon + 1) == port_hex) {
        out.push_back(local.substr(0, colon));
      }
    }
  }
  return out;
}

void store_security() {
  Proc p({g_launcher, "--standalone", "/bin/sh", "-c",
          "echo port $MASTER_PORT token ${#DTENSOR_STORE_TOKEN}; sleep 3"},
         {});
  const bool ready = p.read_until([](const std::string& s) { return contains(s, "token "); }, 20s);
  EXPECT(ready, "the rank started");
  const int port = std::atoi(p.output.c_str() + p.output.find("port ") + 5);
  const auto addresses = listening_addresses(port);
  EXPECT(addresses.size() == 1 && addresses[0] == "0100007F",
         "the store listens on 127.0.0.1 only (" + std::to_string(addresses.size()) + " listener(s)" +
             (addresses.empty() ? std::string(")") : ", first " + addresses[0] + ")"));
  EXPECT(contains(p.output, "token 32"), "the rank got a 128-bit token");
  try {
    dtensor::TcpStoreOptions o;
    o.timeout = 2s;
    dtensor::TcpStore stranger("127.0.0.1", port, o);
    EXPECT(false, "a client without the token is refused");
  } catch (const std::exception& e) {
    EXPECT(contains(e.what(), "wrong or missing job token"),
           std::string("a client without the token is refused: ") + e.what());
  }
  p.wait(20s);
  EXPECT(p.code() == 0, "the job still succeeds");
}

void flags() {
  for (const std::string v : {"-1", "nan", "1x", "", " 5", "0x10", "86401"}) {
    expect_refused(
        {{{"--stop-timeout", v}, "--stop-timeout: '" + v + "' is not a number of seconds from 0 to"},
         {{"--rdzv-last-call", v}, "--rdzv-last-call: '" + v + "' is not a number of seconds"}});
  }
  expect_refused({{{"--nproc-per-node", " 4"}, "is not an integer in [1, 4096]"},
                  {{"--nnodes", "0x2"}, "is not an integer in [1, 65536]"}});
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: launcher_test <dtensor-run> <rank_program> <scenario>\n");
    return 2;
  }
  g_launcher = argv[1];
  g_program = argv[2];
  const std::string scenario = argv[3];
  ::signal(SIGPIPE, SIG_IGN);
  ::prctl(PR_SET_CHILD_SUBREAPER, 1); // to see the launcher's orphans die (all_dead)
  const std::map<std::string, void (*)()> scenarios = {{"prefix", prefix},
                                                       {"restarts", restarts},
                                                       {"restarts_mpi", restarts_mpi},
                                                       {"multinode_restarts", multinode_restarts},
                                                       {"early_exit", early_exit},
                                                       {"signals", signals},
                                                       {"unreachable", unreachable},
                                                       {"multinode", multinode},
                                                       {"rank0_store", rank0_store},
                                                       {"launcherless", launcherless},
                                                       {"orphans", orphans},
                                                       {"flags", flags},
                                                       {"store_security", store_security},
                                                       {"kill_store_host", kill_store_host},
                                                       {"kill_rank", kill_rank},
                                                       {"kill_rank_4", kill_rank_4},
                                                       {"stop_rank", stop_rank},
                                                       {"never_joins", never_joins},
                                                       {"port_in_use", port_in_use}};
  auto it = scenarios.find(scenario);
  if (it == scenarios.end()) {
    std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    return 2;
  }
  it->second();
  std::printf("%s: %s\n", scenario.c_str(), g_failures == 0 ? "all checks passed" : "FAILED");
  return g_failures == 0 ? 0 : 1;
}
