// dtensor-run: torchrun for C++ programs. Starts --nproc-per-node copies of a program on this machine with
// torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT), prefixes their output per rank, forwards SIGINT/SIGTERM/SIGHUP, and when a rank exits
// non-zero stops the others and exits non-zero naming it, or, with --max-restarts N, starts them all again
// (up to N times; DTENSOR_RESTART_COUNT tells them which start this is, and a program that saves its state
// resumes from it: train/checkpoint_folder.hpp). With --nproc-per-node MIN:MAX a restart runs without the
// ranks that failed, down to MIN (elastic on one machine: the program resumes its state on fewer ranks).
//
//   dtensor-run --nproc-per-node 4 ./train --steps 10                   # one machine
//   dtensor-run --nnodes 2 --node-rank 0 --master-addr node0 --nproc-per-node 8 ./train   # on node0
//   dtensor-run --nnodes 2 --node-rank 1 --master-addr node0 --nproc-per-node 8 ./train   # on node1
//
// The launcher on node 0 hosts the job's TcpStore on --master-port (DTENSOR_USE_AGENT_STORE=1 tells the
// ranks), so the port stays bound for the whole job and ranks may start in any order. The store listens on
// loopback when the master address is a loopback one (one machine), and serves only clients presenting
// the job's token (DTENSOR_STORE_TOKEN: the launcher's own if set, else a random one on one machine). With
// several nodes the launchers share failures through that store: a failed rank anywhere stops every node;
// with --max-restarts they meet there again before each new start (node ranks in the order they join,
// node 0 first), and with --nnodes MIN:MAX a start goes on with the nodes that came back.
// Every launcher records there how each of its ranks ended ("dtensor-run/exit/<rank>"), so that the peers of
// a rank that died name it alone. Run `dtensor-run --help` for every flag.
//
// A program built with the MPI backend (it links libmpi) runs through mpirun by default on one machine
// without a GPU: MPI is the faster backend on CPUs (BENCHMARKS.md, "Which backend on CPUs"), and an MPI
// world needs MPI's own launcher, so dtensor-run becomes `mpirun -np N program` (--backend: gloo keeps the
// launch described above).

#include "dtensor/core/env.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/tcp_store.hpp"
#include "dtensor/rendezvous/tcp_store_server.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <elf.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr const char* kUsage = R"(usage: dtensor-run [options] program [args...]

Starts --nproc-per-node copies of `program` with torchrun's environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT).

options (torchrun's spellings; `--a-b` and `--a_b`, `--opt v` and `--opt=v` are all accepted):
  --nproc-per-node N     processes on this machine (default 1); MIN:MAX: elastic, MAX at the start and
                         one fewer for each rank that failed at each restart, never below MIN
  --nnodes N             machines in the job (default 1); MIN:MAX: elastic (with --max-restarts): each
                         start of the job takes the nodes whose launchers join its rendezvous, at least
                         MIN, at most MAX (node 0, the store's host, must stay)
  --rdzv-last-call S     elastic: once MIN nodes joined a start, how long node 0 waits for more
                         before starting without them (default 10 seconds)
  --max-restarts N       when a rank fails, stop every rank and start them all again, up to N times
                         (default 0); each start gets DTENSOR_RESTART_COUNT (and torchrun's
                         TORCHELASTIC_RESTART_COUNT) = 0, 1, ... With several nodes every launcher
                         restarts its ranks, and the node ranks of a start are those of its rendezvous
                         (node 0: the store's host; the others in the order they join)
  --replica-size K       per-replica restarts (ReplicaManager, train/replicas.hpp): the ranks form
                         replicas of K consecutive ranks; when a rank fails only its replica is
                         stopped and started again (up to --max-restarts times each, with
                         DTENSOR_REPLICA_RESTART_COUNT = 1, 2, ...) while the others go on; a replica
                         with no restart left stays out. One machine; the ranks get DTENSOR_REPLICA_SIZE
  --node-rank R          this machine's index, 0..nnodes-1 (default 0)
  --master-addr A        address of node 0, where the store runs (default 127.0.0.1)
  --master-port P        port of the store (default 29500; 0 = a free port, one machine only)
  --standalone           one machine on a free port (= --nnodes 1 --master-port 0)
  --tee T                streams whose lines get a "[rankN]: " prefix: 0 none (inherited as is),
                         1 stdout, 2 stderr, 3 both (default 3)
  --log-dir DIR          also write each rank's captured streams to DIR/rank_N.{stdout,stderr}
  --local-ranks-filter L show output only from these local ranks (comma list, e.g. 0 or 0,3)
  --rank0-store          let rank 0 host the store instead of this launcher (as plain torch does)
  --store-bind-addr A    interface the store listens on (default: the master address when it is a
                         loopback one, as with --standalone, else every interface)
  --stop-timeout S       seconds between SIGTERM and SIGKILL when stopping ranks (default 10)
  --backend B            the ranks' backend (their DTENSOR_BACKEND): gloo, nccl, mpi or auto (default:
                         DTENSOR_BACKEND, else auto). An MPI job needs MPI's launcher: with mpi,
                         dtensor-run runs the job as `mpirun -np N program` (one machine; DTENSOR_MPIRUN
                         names another mpirun), with the output shown as here. auto is mpi when the
                         program links MPI (built with dtensor::mpi), mpirun is found, and the job is on
                         one machine with no GPU (/dev/nvidia0) and neither --rank0-store nor
                         --store-bind-addr (the faster backend on CPUs: BENCHMARKS.md, "Which backend
                         on CPUs"); else the ranks pick (NCCL with a GPU, else gloo)
  -h, --help             this text

Environment: DTENSOR_STORE_TOKEN, when set, is the job's token (give every node's launcher the same);
else, on one machine, the launcher makes a random one. The ranks get it, and the store refuses clients
without it. DTENSOR_TIMEOUT (seconds, default 300) bounds the launchers' own store calls.

Exit status: 0 when every rank exited 0; else the first failed rank's exit code (128+signal when it
was killed), 128+signal when dtensor-run itself was interrupted.
)";

[[noreturn]] void die(const std::string& msg, int code = 2) {
  std::fprintf(stderr, "dtensor-run: %s\n", msg.c_str());
  std::exit(code);
}

struct Args {
  int nproc_per_node = 1;
  int min_nproc = 0;  // --nproc-per-node MIN:MAX: MIN (0: not elastic)
  int min_nnodes = 0; // --nnodes MIN:MAX: MIN (0: not elastic)
  int max_restarts = 0;
  int replica_size = 0;  // --replica-size K: per-replica restarts (0: the job's)
  double last_call = 10; // --rdzv-last-call seconds
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int tee = 3;
  std::string log_dir;
  std::set<int> ranks_filter;
  bool agent_store = true;
  std::string store_bind_addr;
  bool store_bind_given = false;
  std::string token;
  double stop_timeout = 10;
  std::string backend;          // lower case; "auto" when neither --backend nor DTENSOR_BACKEND names one
  bool own_launch_only = false; // a flag only dtensor-run's own launch honours was given
  std::vector<std::string> cmd;
};

int parse_int(const std::string& flag, const std::string& v, int lo, int hi) {
  try {
    return static_cast<int>(dtensor::detail::parse_decimal_int(flag, v, lo, hi)); // decimal digits only
  } catch (const std::exception&) {
    die(flag + ": '" + v + "' is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
}

/// Why a failed job is not started again once its restarts are spent.
std::string no_restart_left(int used, int max) {
  return "no restart left (" + std::to_string(used) + " of " + std::to_string(max) + " used)";
}

/// "N" (MIN = MAX = N) or "MIN:MAX" (lo <= MIN <= MAX <= hi): {MIN, MAX}.
std::pair<int, int> parse_range(const std::string& flag, const std::string& v, int lo, int hi) {
  const auto colon = v.find(':');
  if (colon == std::string::npos) {
    const int n = parse_int(flag, v, lo, hi);
    return {n, n};
  }
  const int min = parse_int(flag + " (its MIN)", v.substr(0, colon), lo, hi);
  return {min, parse_int(flag + " (its MAX)", v.substr(colon + 1), min, hi)};
}

/// A number of seconds from 0 to a day (decimal): a negative or NaN wait would fire at once (or never),
/// and a day bounds the deadline arithmetic.
double parse_seconds(const std::string& flag, const std::string& v) {
  std::size_t used = 0;
  double s = -1;
  try {
    s = dtensor::detail::is_decimal_number(v) ? std::stod(v, &used) : -1;
  } catch (...) {
    s = -1;
  }
  if (used != v.size() || !(s >= 0 && s <= 86400)) {
    die(flag + ": '" + v + "' is not a number of seconds from 0 to 86400");
  }
  return s;
}

/// 128 random bits as hex: the job's store token.
std::string random_token() {
  unsigned char bytes[16];
  if (::getrandom(bytes, sizeof(bytes), 0) != static_cast<ssize_t>(sizeof(bytes))) {
    die("getrandom: " + std::string(std::strerror(errno)));
  }
  std::string hex;
  for (unsigned char b : bytes) {
    hex += "0123456789abcdef"[b >> 4];
    hex += "0123456789abcdef"[b & 15];
  }
  return hex;
}

Args parse(int argc, char** argv) {
  Args a;
  bool standalone = false;
  bool port_given = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      break; // the program
    }
    std::string value;
    bool has_value = false;
    if (auto eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    std::replace(arg.begin(), arg.end(), '_', '-');
    auto need = [&]() -> std::string {
      if (has_value) {
        return value;
      }
      if (i + 1 >= argc) {
        die(arg + " needs a value (see --help)");
      }
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (arg == "--nproc-per-node") {
      const auto [min, max] = parse_range(arg, need(), 1, 4096);
      a.nproc_per_node = max;
      a.min_nproc = min < max ? min : 0; // N:N is not elastic
    } else if (arg == "--rdzv-last-call") {
      a.last_call = parse_seconds(arg, need());
    } else if (arg == "--max-restarts") {
      a.max_restarts = parse_int(arg, need(), 0, 1 << 20);
    } else if (arg == "--replica-size") {
      a.replica_size = parse_int(arg, need(), 1, 4096);
      a.own_launch_only = true;
    } else if (arg == "--nnodes") {
      const auto [min, max] = parse_range(arg, need(), 1, 1 << 16);
      a.nnodes = max;
      a.min_nnodes = min < max ? min : 0; // N:N is not elastic
    } else if (arg == "--node-rank") {
      a.node_rank = parse_int(arg, need(), 0, 1 << 16);
    } else if (arg == "--master-addr") {
      a.master_addr = need();
    } else if (arg == "--master-port") {
      a.master_port = parse_int(arg, need(), 0, 65535);
      port_given = true;
    } else if (arg == "--standalone") {
      standalone = true;
    } else if (arg == "--tee") {
      a.tee = parse_int(arg, need(), 0, 3);
    } else if (arg == "--log-dir") {
      a.log_dir = need();
    } else if (arg == "--local-ranks-filter") {
      std::string v = need();
      std::size_t at = 0;
      while (at <= v.size()) {
        const std::size_t comma = std::min(v.find(',', at), v.size());
        a.ranks_filter.insert(parse_int(arg, v.substr(at, comma - at), 0, 1 << 20));
        at = comma + 1;
      }
    } else if (arg == "--rank0-store") {
      a.agent_store = false;
      a.own_launch_only = true;
    } else if (arg == "--store-bind-addr") {
      a.store_bind_addr = need();
      a.store_bind_given = true;
      a.own_launch_only = true;
    } else if (arg == "--backend") {
      a.backend = need();
      if (a.backend.empty()) {
        die("--backend needs a name: gloo, nccl, mpi or auto");
      }
    } else if (arg == "--stop-timeout") {
      a.stop_timeout = parse_seconds(arg, need());
    } else {
      die("unknown option " + arg + " (see --help)");
    }
  }
  for (; i < argc; ++i) {
    a.cmd.emplace_back(argv[i]);
  }
  if (a.cmd.empty()) {
    die("no program given (see --help)");
  }
  if (a.backend.empty()) {
    const char* b = std::getenv("DTENSOR_BACKEND");
    a.backend = b != nullptr && *b != '\0' ? b : "auto";
  }
  std::transform(a.backend.begin(), a.backend.end(), a.backend.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (standalone) {
    a.nnodes = 1;
    a.master_addr = "127.0.0.1";
    if (!port_given) {
      a.master_port = 0;
    }
  }
  if (a.node_rank >= a.nnodes) {
    die("--node-rank " + std::to_string(a.node_rank) + " must be < --nnodes " + std::to_string(a.nnodes));
  }
  if (a.nnodes > 1 && a.min_nproc > 0) {
    die("--nproc-per-node MIN:MAX works on one machine (--nnodes 1); across machines the elastic unit is the "
        "node: --nnodes MIN:MAX");
  }
  if ((a.min_nproc > 0 || a.min_nnodes > 0) && a.max_restarts == 0) {
    die(std::string(a.min_nproc > 0 ? "--nproc-per-node " : "--nnodes ") +
        std::to_string(a.min_nproc > 0 ? a.min_nproc : a.min_nnodes) + ":" +
        std::to_string(a.min_nproc > 0 ? a.nproc_per_node : a.nnodes) +
        ": an elastic size changes only at a restart; give --max-restarts N too");
  }
  if (a.nnodes > 1 && a.max_restarts > 0 && !a.agent_store) {
    die("--max-restarts with several nodes needs the launchers' store (leave out --rank0-store): the "
        "launchers meet there to start again");
  }
  if (a.replica_size > 0) {
    if (a.nnodes > 1 || a.min_nproc > 0 || a.min_nnodes > 0 || !a.agent_store) {
      die("--replica-size: per-replica restarts work on one machine (--nnodes 1), with a fixed "
          "--nproc-per-node and the launcher's store (leave out --rank0-store)");
    }
    if (a.nproc_per_node % a.replica_size != 0) {
      die("--replica-size " + std::to_string(a.replica_size) + " does not divide --nproc-per-node " +
          std::to_string(a.nproc_per_node) + " into whole replicas");
    }
  }
  if (a.master_port == 0 && a.nnodes > 1) {
    die("--master-port 0 (a free port) works on one machine only (--nnodes 1)");
  }
  if (a.master_port == 0 && !a.agent_store) {
    // torchrun --standalone's way: find a free port and release it for rank 0 to bind.
    a.master_port = dtensor::TcpStoreServer(0).port();
  }
  if (!a.ranks_filter.empty() && a.tee == 0) {
    a.tee = 3;
  }
  if (!a.store_bind_given && dtensor::detail::tcp::is_loopback(a.master_addr)) {
    a.store_bind_addr = a.master_addr;
  }
  if (const char* t = std::getenv("DTENSOR_STORE_TOKEN"); t != nullptr && *t != '\0') {
    a.token = t;
  } else if (a.nnodes == 1) {
    a.token = random_token();
  }
  return a;
}

// ---- MPI: the job started through mpirun ---------------------------------------------------------------

/// `name` as execvp finds it: itself when it has a '/', else the first executable of that name on PATH;
/// empty when there is none.
std::string find_program(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    return ::access(name.c_str(), X_OK) == 0 ? name : std::string();
  }
  const char* path = std::getenv("PATH");
  std::string_view rest = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    const std::size_t colon = std::min(rest.find(':'), rest.size());
    std::string dir(rest.substr(0, colon));
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    if (colon == rest.size()) {
      return {};
    }
    rest.remove_prefix(colon + 1);
  }
}

/// Whether the ELF file at `path` names an MPI library among its shared libraries (DT_NEEDED): a program
/// built with dtensor::mpi. False for anything that is not a 64-bit ELF file (a script, say).
bool links_mpi(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  Elf64_Ehdr eh{};
  if (!f.read(reinterpret_cast<char*>(&eh), sizeof(eh)) || std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 ||
      eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_shentsize != sizeof(Elf64_Shdr) || eh.e_shnum == 0) {
    return false;
  }
  std::vector<Elf64_Shdr> sections(eh.e_shnum);
  f.seekg(static_cast<std::streamoff>(eh.e_shoff));
  if (!f.read(reinterpret_cast<char*>(sections.data()),
              static_cast<std::streamsize>(sections.size() * sizeof(Elf64_Shdr)))) {
    return false;
  }
  for (const Elf64_Shdr& dyn : sections) {
    if (dyn.sh_type != SHT_DYNAMIC || dyn.sh_link >= sections.size()) {
      continue;
    }
    const Elf64_Shdr& strtab = sections[dyn.sh_link];
    if (dyn.sh_size > (1u << 26) || strtab.sh_size > (1u << 26)) {
      return false; // not a program's dynamic section (a damaged file): read no further
    }
    std::vector<Elf64_Dyn> entries(dyn.sh_size / sizeof(Elf64_Dyn));
    std::string names(strtab.sh_size, '\0');
    f.seekg(static_cast<std::streamoff>(dyn.sh_offset));
    f.read(reinterpret_cast<char*>(entries.data()),
           static_cast<std::streamsize>(entries.size() * sizeof(Elf64_Dyn)));
    f.seekg(static_cast<std::streamoff>(strtab.sh_offset));
    f.read(names.data(), static_cast<std::streamsize>(names.size()));
    if (!f) {
      return false;
    }
    for (const Elf64_Dyn& e : entries) {
      if (e.d_tag == DT_NEEDED && e.d_un.d_val < names.size()) {
        const std::string_view lib(names.c_str() + e.d_un.d_val);
        if (lib.starts_with("libmpi.so") || lib.starts_with("libmpich.so")) {
          return true;
        }
      }
    }
  }
  return false;
}

/// mpirun as DTENSOR_MPIRUN or PATH has it; empty when there is none.
std::string find_mpirun() {
  const char* m = std::getenv("DTENSOR_MPIRUN");
  return find_program(m != nullptr && *m != '\0' ? m : "mpirun");
}

/// Whether dtensor-run starts this job through mpirun (see --backend in kUsage).
bool through_mpirun(const Args& a) {
  if (a.backend == "mpi") {
    return true;
  }
  if (a.backend != "auto" || a.nnodes != 1 || a.own_launch_only || ::access("/dev/nvidia0", F_OK) == 0) {
    return false;
  }
  const std::string program = find_program(a.cmd[0]);
  return !program.empty() && links_mpi(program) && !find_mpirun().empty();
}

// ---- signals: a self-pipe the main loop polls ----------------------------------------------------------

int g_signal_pipe[2] = {-1, -1};

extern "C" void on_signal(int sig) {
  const int saved = errno;
  const char c = static_cast<char>(sig);
  [[maybe_unused]] auto n = ::write(g_signal_pipe[1], &c, 1);
  errno = saved;
}

void install_handlers() {
  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    die("pipe: " + std::string(std::strerror(errno)));
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) {
    ::sigaction(s, &sa, nullptr);
  }
  ::signal(SIGPIPE, SIG_IGN);
}

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? "SIG" + std::string(abbrev) : "signal " + std::to_string(sig);
}

void write_all(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t k = ::write(fd, s.data(), s.size());
    if (k < 0 && errno == EINTR) {
      continue;
    }
    if (k <= 0) {
      return; // the reader went away; drop the output
    }
    s.remove_prefix(static_cast<std::size_t>(k));
  }
}

/// Forks a child running argv[0] (found on PATH) with `envp`, its stdout and stderr on `out_fd` and `err_fd`
/// when >= 0, sent `death_signal` when dtensor-run dies, in its own process group when `own_group` (signals
/// then reach its whole process tree). The caller prepares everything: between fork and exec only
/// async-signal-safe calls. `exec_fail` heads the child's message when the exec fails (exit 127).
pid_t fork_exec(char* const* argv, char* const* envp, int out_fd, int err_fd, bool own_group,
                int death_signal, const std::string& exec_fail) {
  const pid_t launcher = ::getpid();
  // Signals stay blocked across fork until the child has reset the launcher's handlers (which write
  // into the launcher's self-pipe).
  sigset_t all, previous;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &previous);
  const pid_t pid = ::fork();
  if (pid != 0) {
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  }
  if (pid < 0) {
    die("fork: " + std::string(std::strerror(errno)));
  }
  if (pid == 0) {
    if (own_group) {
      ::setpgid(0, 0);
    }
    ::prctl(PR_SET_PDEATHSIG, death_signal);
    if (::getppid() != launcher) {
      ::_exit(137); // the launcher died before prctl took effect
    }
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) {
      ::signal(s, SIG_DFL);
    }
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (out_fd >= 0) {
      ::dup2(out_fd, 1);
    }
    if (err_fd >= 0) {
      ::dup2(err_fd, 2);
    }
    ::execvpe(argv[0], argv, envp);
    const int e = errno;
    [[maybe_unused]] auto n1 = ::write(2, exec_fail.data(), exec_fail.size());
    const char* d = ::strerrordesc_np(e);
    [[maybe_unused]] auto n2 = ::write(2, d, std::strlen(d));
    [[maybe_unused]] auto n3 = ::write(2, "\n", 1);
    ::_exit(127);
  }
  return pid;
}

// ---- the guardian --------------------------------------------------------------------------------------

/// A process that outlives a launcher killed by SIGKILL: the ranks die with the launcher
/// (PR_SET_PDEATHSIG), but their own children would be orphaned and keep running. It learns each rank's
/// process group through a pipe and, when the pipe closes without the launcher's "done", SIGKILLs every
/// group it knows.
class Guardian {
public:
  /// Forks it; call before any thread or rank exists, so it holds no other descriptor.
  void start() {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) {
      die("pipe: " + std::string(std::strerror(errno)));
    }
    const pid_t pid = ::fork();
    if (pid < 0) {
      die("fork: " + std::string(std::strerror(errno)));
    }
    if (pid == 0) {
      ::close(p[1]);
      // A Ctrl-C reaches the launcher, which stops the ranks itself; the guardian must stay for SIGKILL.
      for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
        ::signal(sig, SIG_IGN);
      }
      const int null = ::open("/dev/null", O_RDWR);
      for (int fd : {0, 1, 2}) { // nor keep the launcher's output pipes open after it died
        ::dup2(null, fd);
      }
      watch(p[0]);
    }
    ::close(p[0]);
    fd_ = p[1];
  }

  void add(pid_t group) { send(group); }
  /// The group is empty: its id may be reused by an unrelated process.
  void forget(pid_t group) { send(-group); }
  /// The launcher stopped what it had to: the guardian exits without killing.
  void done() { send(0); }

private:
  void send(std::int32_t v) const {
    if (fd_ >= 0) {
      write_all(fd_, std::string_view(reinterpret_cast<const char*>(&v), sizeof(v)));
    }
  }

  [[noreturn]] static void watch(int fd) {
    std::set<pid_t> groups;
    for (;;) {
      std::int32_t v = 0;
      const ssize_t k = ::read(fd, &v, sizeof(v)); // writes of 4 bytes to a pipe are atomic
      if (k < 0 && errno == EINTR) {
        continue;
      }
      if (k != sizeof(v)) {
        break; // the launcher is gone
      }
      if (v == 0) {
        ::_exit(0);
      }
      if (v > 0) {
        groups.insert(v);
      } else {
        groups.erase(-v);
      }
    }
    for (pid_t g : groups) {
      ::kill(-g, SIGKILL);
    }
    ::_exit(0);
  }

  int fd_ = -1;
};

// ---- ranks ---------------------------------------------------------------------------------------------

struct Stream {
  int fd = -1;    // read end, -1 when closed or not captured
  int target = 1; // 1 stdout, 2 stderr
  std::string partial;
  std::unique_ptr<std::ofstream> log;
};

struct Rank {
  int rank = 0;
  int local_rank = 0;
  int incarnation = 0; // --replica-size: which start of its replica this is
  pid_t pid = -1;
  bool running = false;
  int status = 0;            // waitpid status once exited
  bool failed_first = false; // failed before the launcher stopped anyone
  Stream out, err;
  bool show = true;
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) {
    return "exit code " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    return "killed by " + signal_name(WTERMSIG(status));
  }
  return "status " + std::to_string(status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) {
    return WEXITSTATUS(status);
  }
  if (WIFSIGNALED(status)) {
    return 128 + WTERMSIG(status);
  }
  return 1;
}

class Launcher {
public:
  explicit Launcher(Args args) : a_(std::move(args)), max_nnodes_(a_.nnodes) {}

  int run() {
    guardian_.start();
    install_handlers();
    store_timeout_ = store_timeout_from_env();
    // The store: node 0 hosts it (unless --rank0-store); with several nodes every launcher is a client too.
    if (a_.agent_store && a_.node_rank == 0) {
      try {
        dtensor::TcpStoreServerOptions so;
        so.bind_host = a_.store_bind_addr;
        so.token = a_.token;
        server_ = std::make_unique<dtensor::TcpStoreServer>(a_.master_port, std::move(so));
      } catch (const std::exception& e) {
        die(e.what());
      }
      a_.master_port = server_->port();
    }
    // A client of the job's store on every node where the launcher serves or shares it: with several
    // nodes for failures and completion, and on every node to record how each rank ended (reap()).
    if (a_.agent_store && (a_.nnodes > 1 || server_)) {
      try {
        dtensor::TcpStoreOptions so;
        so.timeout = store_timeout_;
        so.token = a_.token;
        so.server_owner = "dtensor-run on node 0";
        store_ = std::make_shared<dtensor::TcpStore>(
            a_.node_rank == 0 && a_.store_bind_addr.empty() ? "127.0.0.1" : a_.master_addr, a_.master_port,
            so);
      } catch (const std::exception& e) {
        die(std::string(e.what()), 1);
      }
    }
    if (store_ && a_.nnodes > 1) {
      watcher_ = std::thread([this] { watch_store(); });
    }
    for (;;) {
      if (rendezvous_mode()) {
        rendezvous();
      }
      spawn_all();
      int code = loop();
      if (code == 0 && store_ && a_.nnodes > 1) {
        code = wait_for_nodes();
      }
      if (code != 0 && interrupted_ == 0 && a_.max_restarts > 0 && a_.replica_size == 0) {
        const std::string why = restart_ >= a_.max_restarts ? no_restart_left(restart_, a_.max_restarts)
                                : store_lost_               ? "the store on node 0 is gone"
                                : job_stopped()             ? "a launcher of the job was interrupted"
                                                            : "";
        if (why.empty()) {
          restart();
          continue;
        }
        std::fprintf(stderr, "dtensor-run: %s; giving up\n", why.c_str());
      }
      finish_store();
      guardian_.done();
      return code;
    }
  }

private:
  static std::chrono::milliseconds store_timeout_from_env() {
    if (const char* v = std::getenv("DTENSOR_TIMEOUT"); v != nullptr && *v != '\0') {
      try {
        return dtensor::detail::parse_timeout_seconds("DTENSOR_TIMEOUT", v);
      } catch (const std::exception& e) {
        die(e.what());
      }
    }
    return dtensor::kDefaultStoreTimeout;
  }

  int world_size() const { return a_.nnodes * a_.nproc_per_node; }

  /// The job's store key `key` of the current start: the first start's keys as they are, restart k's under
  /// "dtensor-run/restart-<k>/" (DTENSOR_STORE_PREFIX tells the ranks), so that no start reads the keys of
  /// an earlier one (their groups' addresses, the exits of their ranks).
  static std::string store_prefix_of(int start) {
    return start == 0 ? std::string() : "dtensor-run/restart-" + std::to_string(start);
  }
  std::string store_prefix() const { return store_prefix_of(restart_); }
  static std::string job_key_of(int start, const std::string& key) {
    return start == 0 ? key : store_prefix_of(start) + "/" + key;
  }
  std::string job_key(const std::string& key) const { return job_key_of(restart_, key); }

  /// Whether a launcher of the job was interrupted (then no node starts again).
  bool job_stopped() {
    try {
      return store_ && max_nnodes_ > 1 && store_->check({"dtensor-run/stopped"});
    } catch (...) {
      return true;
    }
  }

  /// Several nodes that may start again: each start's nodes meet first (rendezvous()).
  bool rendezvous_mode() const { return max_nnodes_ > 1 && a_.max_restarts > 0; }

  /// The nodes of this start: node 0 (the store's host) waits for the others to join, all of them, or
  /// when elastic at least MIN and then --rdzv-last-call for more (at most MAX), and closes the start;
  /// the others take their node rank in the order they joined. Sets the node rank and count of the start.
  void rendezvous() {
    const std::string key = "dtensor-run/rdzv/" + std::to_string(restart_);
    const int lo = a_.min_nnodes > 0 ? a_.min_nnodes : max_nnodes_;
    try {
      if (server_) {
        const auto deadline = Clock::now() + store_timeout_;
        std::optional<Clock::time_point> enough;
        int joined = 1;
        for (;;) {
          joined = 1 + static_cast<int>(store_->add(key + "/joined", 0));
          if (joined >= max_nnodes_) {
            break;
          }
          if (joined >= lo) {
            enough = enough.value_or(Clock::now());
            if (Clock::now() - *enough >= std::chrono::duration<double>(a_.last_call)) {
              break;
            }
          }
          if (Clock::now() > deadline) {
            die("rendezvous of start " + std::to_string(restart_) + ": " + std::to_string(joined) +
                    " of at least " + std::to_string(lo) + " nodes joined within " +
                    std::to_string(store_timeout_.count()) + " ms",
                1);
          }
          std::this_thread::sleep_for(50ms);
        }
        a_.nnodes = std::min(joined, max_nnodes_);
        a_.node_rank = 0;
        store_->set(key + "/closed", std::to_string(a_.nnodes));
      } else {
        const int index = static_cast<int>(store_->add(key + "/joined", 1)); // 1, 2, ...
        const std::vector<char> v = store_->get(key + "/closed");
        a_.nnodes = std::stoi(std::string(v.begin(), v.end()));
        if (index >= a_.nnodes) {
          die("start " + std::to_string(restart_) + " of the job began with " + std::to_string(a_.nnodes) +
                  " nodes without this one (it joined late)",
              1);
        }
        a_.node_rank = index;
      }
    } catch (const std::exception& e) {
      die("rendezvous of start " + std::to_string(restart_) + " in the store on node 0: " + e.what(), 1);
    }
    std::fprintf(stderr, "dtensor-run: start %d: node %d of %d\n", restart_.load(), a_.node_rank, a_.nnodes);
  }

  /// This node's ranks all exited 0: until every node's did (0), or one failed in this start (1). Only
  /// node 0 (the store's host) waits, unless the nodes may start again.
  int wait_for_nodes() {
    try {
      if (store_->add(job_key("dtensor-run/nodes_done"), 1) == a_.nnodes) {
        store_->set(job_key("dtensor-run/all_done"), std::string_view("1"));
      }
      if (a_.node_rank != 0 && !rendezvous_mode()) {
        return 0;
      }
      const auto until = Clock::now() + store_timeout_;
      while (Clock::now() < until) {
        if (store_->check({job_key("dtensor-run/all_done")})) {
          return 0;
        }
        if (store_->check({job_key("dtensor-run/failed")})) {
          const std::vector<char> v = store_->get(job_key("dtensor-run/failed"));
          std::fprintf(stderr, "dtensor-run: this node's ranks finished, but: %s\n",
                       std::string(v.begin(), v.end()).c_str());
          return rendezvous_mode() ? 1 : 0;
        }
        std::this_thread::sleep_for(100ms);
      }
    } catch (...) {
    }
    return 0;
  }

  /// After a failed start: the next one, without the ranks that failed when elastic (never below MIN).
  void restart() {
    int lost = 0;
    for (const Rank& r : ranks_) {
      lost += r.failed_first ? 1 : 0;
    }
    const int before = a_.nproc_per_node;
    if (a_.min_nproc > 0) {
      a_.nproc_per_node = std::max(a_.min_nproc, before - std::max(lost, 1));
    }
    ++restart_;
    remote_failure_.clear();
    std::fprintf(stderr, "dtensor-run: restart %d of %d: starting %d rank(s)%s\n", restart_.load(),
                 a_.max_restarts, a_.nproc_per_node,
                 a_.nproc_per_node < before
                     ? (" (" + std::to_string(before - a_.nproc_per_node) + " fewer: elastic, at least " +
                        std::to_string(a_.min_nproc) + ")")
                           .c_str()
                     : "");
    ranks_.clear();
    failed_ = nullptr;
    kill_deadline_.reset();
    running_ = 0;
  }

  std::vector<std::string> child_env(const Rank& r) const {
    std::map<std::string, std::string> set = {
        {"RANK", std::to_string(r.rank)},
        {"WORLD_SIZE", std::to_string(world_size())},
        {"LOCAL_RANK", std::to_string(r.local_rank)},
        {"LOCAL_WORLD_SIZE", std::to_string(a_.nproc_per_node)},
        {"GROUP_RANK", std::to_string(a_.node_rank)},
        {"GROUP_WORLD_SIZE", std::to_string(a_.nnodes)},
        {"ROLE_RANK", std::to_string(r.rank)},
        {"ROLE_WORLD_SIZE", std::to_string(world_size())},
        {"ROLE_NAME", "default"},
        {"MASTER_ADDR", a_.master_addr},
        {"MASTER_PORT", std::to_string(a_.master_port)},
        {"DTENSOR_USE_AGENT_STORE", a_.agent_store ? "1" : "0"},
        {"DTENSOR_STORE_TOKEN", a_.token},
        {"DTENSOR_BACKEND", a_.backend},
        {"DTENSOR_RESTART_COUNT", std::to_string(restart_)},
        {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_)},
        {"TORCHELASTIC_MAX_RESTARTS", std::to_string(a_.max_restarts)},
    };
    if (a_.agent_store && restart_ > 0) {
      set["DTENSOR_STORE_PREFIX"] = store_prefix();
    }
    if (a_.replica_size > 0) {
      set["DTENSOR_REPLICA_SIZE"] = std::to_string(a_.replica_size);
      set["DTENSOR_REPLICA_RESTART_COUNT"] = std::to_string(r.incarnation);
    }
    if (a_.store_bind_given) {
      set["DTENSOR_STORE_BIND_ADDR"] = a_.store_bind_addr;
    }
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string_view kv(*e);
      const std::string key(kv.substr(0, kv.find('=')));
      if (!set.contains(key)) {
        env.emplace_back(kv);
      }
    }
    if (a_.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
      env.emplace_back("OMP_NUM_THREADS=1"); // as torchrun: N ranks on one machine share its cores
    }
    for (const auto& [k, v] : set) {
      env.push_back(k + "=" + v);
    }
    return env;
  }

  void spawn_all() {
    if (store_) { // the ranks' failures name the dead rank from these records (backends/gloo/context.hpp)
      try {
        store_->set(job_key("dtensor-run/records_exits"), std::string_view("1"));
      } catch (...) {
      }
    }
    if (!a_.log_dir.empty()) {
      ::mkdir(a_.log_dir.c_str(), 0755);
    }
    ranks_.resize(static_cast<std::size_t>(a_.nproc_per_node));
    for (int l = 0; l < a_.nproc_per_node; ++l) {
      Rank& r = ranks_[static_cast<std::size_t>(l)];
      r.local_rank = l;
      r.rank = a_.node_rank * a_.nproc_per_node + l;
      r.show = a_.ranks_filter.empty() || a_.ranks_filter.contains(l);
      spawn(r);
    }
  }

  void spawn(Rank& r) {
    // Everything the child needs is prepared here: between fork and exec only async-signal-safe calls.
    std::vector<std::string> env = child_env(r);
    std::vector<char*> envp;
    for (auto& s : env) {
      envp.push_back(s.data());
    }
    envp.push_back(nullptr);
    std::vector<std::string> args = a_.cmd;
    std::vector<char*> argv;
    for (auto& s : args) {
      argv.push_back(s.data());
    }
    argv.push_back(nullptr);
    const std::string exec_fail =
        "dtensor-run: rank " + std::to_string(r.rank) + ": cannot execute '" + a_.cmd[0] + "': ";

    int out_pipe[2] = {-1, -1};
    int err_pipe[2] = {-1, -1};
    const bool cap_out = (a_.tee & 1) != 0;
    const bool cap_err = (a_.tee & 2) != 0;
    if ((cap_out && ::pipe2(out_pipe, O_CLOEXEC) != 0) || (cap_err && ::pipe2(err_pipe, O_CLOEXEC) != 0)) {
      die("pipe: " + std::string(std::strerror(errno)));
    }
    // its own process group: signals reach the rank's whole process tree
    const pid_t pid = fork_exec(argv.data(), envp.data(), cap_out ? out_pipe[1] : -1,
                                cap_err ? err_pipe[1] : -1, true, SIGKILL, exec_fail);
    ::setpgid(pid, pid); // also here, so the group exists before any kill(-pid)
    guardian_.add(pid);
    r.pid = pid;
    r.running = true;
    ++running_;
    auto setup = [&](Stream& s, int* p, bool cap, int target, const char* ext) {
      s.target = target;
      if (!cap) {
        return;
      }
      ::close(p[1]);
      s.fd = p[0];
      ::fcntl(s.fd, F_SETFL, ::fcntl(s.fd, F_GETFL) | O_NONBLOCK);
      if (!a_.log_dir.empty()) {
        s.log = std::make_unique<std::ofstream>(a_.log_dir + "/rank_" + std::to_string(r.rank) + "." + ext);
      }
    };
    setup(r.out, out_pipe, cap_out, 1, "stdout");
    setup(r.err, err_pipe, cap_err, 2, "stderr");
  }

  void emit(const Rank& r, Stream& s, std::string_view line) {
    if (s.log) {
      *s.log << line << '\n';
      s.log->flush();
    }
    if (r.show) {
      std::string text = "[rank" + std::to_string(r.rank) + "]: ";
      text.append(line);
      text += '\n';
      write_all(s.target, text);
    }
  }

  /// Reads what is available; closes the stream at EOF.
  void drain(const Rank& r, Stream& s) {
    char buf[65536];
    for (;;) {
      const ssize_t k = ::read(s.fd, buf, sizeof(buf));
      if (k > 0) {
        s.partial.append(buf, static_cast<std::size_t>(k));
        std::size_t at = 0;
        for (std::size_t nl; (nl = s.partial.find('\n', at)) != std::string::npos; at = nl + 1) {
          emit(r, s, std::string_view(s.partial).substr(at, nl - at));
        }
        s.partial.erase(0, at);
        continue;
      }
      if (k < 0 && errno == EINTR) {
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return;
      }
      close_stream(r, s);
      return;
    }
  }

  void close_stream(const Rank& r, Stream& s) {
    if (s.fd < 0) {
      return;
    }
    if (!s.partial.empty()) {
      emit(r, s, s.partial);
      s.partial.clear();
    }
    ::close(s.fd);
    s.fd = -1;
  }

  void signal_all(int sig) {
    for (auto& r : ranks_) {
      if (r.running) {
        ::kill(-r.pid, sig);
      }
    }
  }

  /// Stops every running rank: `sig` now, SIGKILL after --stop-timeout.
  void stop_all(int sig) {
    signal_all(sig);
    if (!kill_deadline_) {
      kill_deadline_ =
          Clock::now() + std::chrono::milliseconds(static_cast<long long>(a_.stop_timeout * 1000));
    }
  }

  void reap() {
    const bool stopping = kill_deadline_.has_value() || interrupted_ != 0;
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) {
        break;
      }
      for (auto& r : ranks_) {
        if (r.pid != pid || !r.running) {
          continue;
        }
        r.running = false;
        r.status = status;
        --running_;
        record_exit(r, status);
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (a_.replica_size > 0 && interrupted_ == 0) {
          replica_exited(r, ok);
          continue;
        }
        r.failed_first = !ok && !stopping; // before this launcher stopped anyone: a failure of its own
        if (!ok && !failed_ && !interrupted_ && remote_failure_.empty()) { // not one this node stopped
          failed_ = &r;
          const std::string report = "rank " + std::to_string(r.rank) + " (local rank " +
                                     std::to_string(r.local_rank) + " on node " +
                                     std::to_string(a_.node_rank) + ", pid " + std::to_string(r.pid) +
                                     ") failed: " + describe_status(status);
          std::fprintf(stderr, "dtensor-run: %s; stopping the other ranks\n", report.c_str());
          publish_failure(report);
        }
        if (kill_deadline_ || interrupted_) {
          // keep killing stragglers in this rank's group (grandchildren)
          ::kill(-r.pid, SIGKILL);
        }
        if (::kill(-r.pid, 0) != 0) {
          guardian_.forget(r.pid);
        }
      }
    }
    if (a_.replica_size > 0) {
      restart_stopped_replicas();
    }
    // After every exit already there was seen: ranks that failed in the same instant all count as failed
    // on their own (an elastic restart leaves them all out).
    if (failed_ != nullptr && !stopping) {
      stop_all(SIGTERM);
    }
  }

  // ---- --replica-size: a failed rank stops and restarts its replica alone ------------------------------

  /// Rank `r` of a replica exited: a failure stops the rest of its replica (SIGKILL: its groups with the
  /// failed rank are broken) and records the replica's end, which the other replicas' quorum reads
  /// (train/replicas.hpp).
  void replica_exited(Rank& r, bool ok) {
    const std::size_t rep = static_cast<std::size_t>(r.rank / a_.replica_size);
    replica_restarts_.resize(ranks_.size() / static_cast<std::size_t>(a_.replica_size));
    replica_failure_.resize(replica_restarts_.size());
    if (!ok && replica_failure_[rep] == 0) {
      replica_failure_[rep] = exit_code_of(r.status) == 0 ? 1 : exit_code_of(r.status);
      std::fprintf(
          stderr, "dtensor-run: rank %d (replica %zu, start %d, pid %d) failed: %s; stopping replica %zu\n",
          r.rank, rep, r.incarnation, static_cast<int>(r.pid), describe_status(r.status).c_str(), rep);
      if (store_) {
        try {
          store_->set("dtensor-run/replica-exit/" + std::to_string(rep) + "/" + std::to_string(r.incarnation),
                      describe_status(r.status));
        } catch (...) {
        }
      }
      for (Rank& o : ranks_) {
        if (o.running && o.rank / a_.replica_size == r.rank / a_.replica_size) {
          ::kill(-o.pid, SIGKILL);
        }
      }
    }
    if (::kill(-r.pid, 0) != 0) {
      guardian_.forget(r.pid);
    }
  }

  /// Starts again each failed replica whose ranks all exited, while it has restarts left; one without
  /// stays out and sets the launcher's exit status.
  void restart_stopped_replicas() {
    for (std::size_t rep = 0; rep < replica_failure_.size(); ++rep) {
      if (replica_failure_[rep] == 0) {
        continue;
      }
      const auto first = ranks_.begin() + static_cast<std::ptrdiff_t>(rep) * a_.replica_size;
      const auto last = first + a_.replica_size;
      if (std::any_of(first, last, [](const Rank& x) { return x.running; })) {
        continue;
      }
      if (replica_restarts_[rep] >= a_.max_restarts) {
        std::fprintf(stderr, "dtensor-run: replica %zu: %s; the other replicas go on without it\n", rep,
                     no_restart_left(replica_restarts_[rep], a_.max_restarts).c_str());
        replica_gave_up_ = replica_gave_up_ != 0 ? replica_gave_up_ : replica_failure_[rep];
        replica_failure_[rep] = 0;
        continue;
      }
      replica_failure_[rep] = 0;
      const int start = ++replica_restarts_[rep];
      std::fprintf(stderr, "dtensor-run: replica %zu: restart %d of %d\n", rep, start, a_.max_restarts);
      for (auto it = first; it != last; ++it) {
        for (Stream* s : {&it->out, &it->err}) {
          if (s->fd >= 0) {
            drain(*it, *s);
            close_stream(*it, *s);
          }
        }
        it->incarnation = start;
        spawn(*it);
      }
    }
  }

  int loop() {
    std::vector<pollfd> pfds;
    std::vector<std::pair<Rank*, Stream*>> owners;
    std::optional<Clock::time_point> drain_deadline;
    for (;;) {
      if (running_ == 0 && !drain_deadline) {
        drain_deadline = Clock::now() + 2s; // output of grandchildren that outlive their rank
      }
      pfds.clear();
      owners.clear();
      pfds.push_back({g_signal_pipe[0], POLLIN, 0});
      owners.emplace_back(nullptr, nullptr);
      for (auto& r : ranks_) {
        for (Stream* s : {&r.out, &r.err}) {
          if (s->fd >= 0) {
            pfds.push_back({s->fd, POLLIN, 0});
            owners.emplace_back(&r, s);
          }
        }
      }
      if (running_ == 0 && pfds.size() == 1) {
        break;
      }
      int timeout_ms = 200;
      if (kill_deadline_) {
        timeout_ms = std::min(timeout_ms, dtensor::detail::tcp::ms_until(*kill_deadline_) + 1);
      }
      ::poll(pfds.data(), pfds.size(), timeout_ms);
      if ((pfds[0].revents & POLLIN) != 0) {
        char sigs[64];
        const ssize_t n = ::read(g_signal_pipe[0], sigs, sizeof(sigs));
        for (ssize_t k = 0; k < n; ++k) {
          on_event(static_cast<unsigned char>(sigs[k]));
        }
      }
      for (std::size_t i = 1; i < pfds.size(); ++i) {
        if (pfds[i].revents != 0) {
          drain(*owners[i].first, *owners[i].second);
        }
      }
      reap();
      check_remote();
      if (kill_deadline_ && Clock::now() >= *kill_deadline_ && running_ > 0) {
        std::fprintf(stderr, "dtensor-run: %d rank(s) still running after %.0f s; sending SIGKILL\n",
                     running_, a_.stop_timeout);
        signal_all(SIGKILL);
        kill_deadline_ = Clock::now() + 3600s;
      }
      if (drain_deadline && Clock::now() >= *drain_deadline) {
        for (auto& r : ranks_) {
          close_stream(r, r.out);
          close_stream(r, r.err);
        }
      }
    }
    if (interrupted_) {
      std::fprintf(stderr, "dtensor-run: interrupted by %s; stopped %d rank(s)\n",
                   signal_name(interrupted_).c_str(), a_.nproc_per_node);
      return 128 + interrupted_;
    }
    if (replica_gave_up_ != 0) { // already reported when it gave up
      return replica_gave_up_;
    }
    if (failed_ != nullptr) { // already reported when it failed
      const int code = exit_code_of(failed_->status);
      return code == 0 ? 1 : code;
    }
    if (!remote_failure_.empty()) {
      std::fprintf(stderr, "dtensor-run: stopped: %s\n", remote_failure_.c_str());
      return 1;
    }
    return 0;
  }

  void on_event(int sig) {
    if (sig == SIGCHLD) {
      return; // reap() runs every iteration
    }
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
      if (interrupted_ != 0) {
        std::fprintf(stderr, "dtensor-run: second %s; killing every rank\n", signal_name(sig).c_str());
        signal_all(SIGKILL);
        return;
      }
      interrupted_ = sig;
      std::fprintf(stderr, "dtensor-run: got %s; forwarding it to %d rank(s)\n", signal_name(sig).c_str(),
                   running_);
      if (store_ && max_nnodes_ > 1) {
        try {
          store_->set("dtensor-run/stopped", signal_name(sig));
        } catch (...) {
        }
      }
      publish_failure("node " + std::to_string(a_.node_rank) + "'s launcher was interrupted by " +
                      signal_name(sig));
      stop_all(sig);
    }
  }

  // ---- the job's store: how ranks ended; with several nodes, failures and completion -------------------

  /// Records how rank `r` ended under "dtensor-run/exit/<rank>", so that its peers, whose ops fail because
  /// its connections closed, name it and how it ended rather than every member that had not reported
  /// (backends/gloo/context.hpp, GlooFailures::silent_members).
  void record_exit(const Rank& r, int status) {
    if (!store_) {
      return;
    }
    try {
      store_->set(job_key("dtensor-run/exit/" + std::to_string(r.rank)), describe_status(status));
    } catch (...) {
    }
  }

  void publish_failure(const std::string& what) {
    if (!store_) {
      return;
    }
    try {
      store_->set(job_key("dtensor-run/failed"), what);
    } catch (...) {
    }
  }

  /// Watches the current start's failure key (each start once), and the store itself.
  void watch_store() {
    int seen = -1;
    while (!stop_watch_.load()) {
      const int start = restart_.load();
      if (start == seen) {
        std::this_thread::sleep_for(100ms);
        continue;
      }
      try {
        const std::string key = job_key_of(start, "dtensor-run/failed");
        store_->wait({key}, 500ms);
        auto v = store_->get(key);
        std::lock_guard lock(remote_m_);
        remote_pending_ = std::string(v.begin(), v.end());
        remote_start_ = start;
        seen = start;
      } catch (const dtensor::TimeoutError&) {
        continue;
      } catch (const std::exception& e) {
        if (stop_watch_.load()) {
          return;
        }
        std::lock_guard lock(remote_m_);
        remote_pending_ = "lost contact with the store on node 0 (" + std::string(e.what()) + ")";
        remote_start_ = -1;
        return;
      }
    }
  }

  void check_remote() {
    std::string what;
    {
      std::lock_guard lock(remote_m_);
      if (remote_start_ >= 0 && remote_start_ != restart_.load()) {
        return; // an earlier start's failure, already acted on
      }
      what = std::exchange(remote_pending_, std::string());
      store_lost_ = store_lost_ || (!what.empty() && remote_start_ < 0);
    }
    if (what.empty() || failed_ != nullptr || interrupted_ != 0 || !remote_failure_.empty()) {
      return;
    }
    remote_failure_ = what;
    if (running_ > 0) {
      std::fprintf(stderr, "dtensor-run: %s; stopping the ranks of node %d\n", what.c_str(), a_.node_rank);
      stop_all(SIGTERM);
    }
  }

  /// Stops watching the store and closes it (node 0: after every node finished, wait_for_nodes()).
  void finish_store() {
    if (store_) {
      stop_watch_.store(true);
      if (watcher_.joinable()) {
        watcher_.join();
      }
    }
    store_.reset();
    server_.reset();
  }

  Args a_;
  std::atomic<int> restart_{0}; ///< this start's number: 0, then 1 .. --max-restarts (read by the watcher)
  int max_nnodes_ = 1;          ///< --nnodes (its MAX); a_.nnodes is the current start's count
  Guardian guardian_;
  std::chrono::milliseconds store_timeout_{0};
  std::vector<Rank> ranks_;
  std::vector<int> replica_restarts_; // --replica-size: restarts used by each replica
  std::vector<int> replica_failure_;  // the failed rank's exit code while its replica stops, else 0
  int replica_gave_up_ = 0;           // the first exit code of a replica that ran out of restarts
  int running_ = 0;
  Rank* failed_ = nullptr;
  int interrupted_ = 0;
  std::optional<Clock::time_point> kill_deadline_;
  std::unique_ptr<dtensor::TcpStoreServer> server_;
  std::shared_ptr<dtensor::TcpStore> store_;
  std::thread watcher_;
  std::atomic<bool> stop_watch_{false};
  std::mutex remote_m_;
  std::string remote_pending_;
  int remote_start_ = 0;    ///< the start remote_pending_ is about (-1: the store was lost)
  bool store_lost_ = false; ///< no restart can meet
  std::string remote_failure_;
};

// ---- MPI: mpirun as the one child ----------------------------------------------------------------------

/// Splits mpirun's --tag-output stream ("[job,rank]<stdout>:text", one tag per chunk a rank wrote, so a
/// partial line is followed by another rank's tag on the same line) back into each rank's lines, and
/// shows them as dtensor-run's own launch does: "[rankN]: " prefixes on the streams --tee names, only the
/// ranks of --local-ranks-filter, each rank's streams also in --log-dir. mpirun's own lines pass as they are.
class MpiOutput {
public:
  explicit MpiOutput(const Args& a) : a_(a) {}

  /// Everything mpirun wrote on `target` (1 stdout, 2 stderr) since the last call.
  void feed(int target, std::string_view chunk) {
    std::string& pending = pending_[target == 1 ? 0 : 1];
    pending.append(chunk);
    std::size_t at = 0;
    for (std::size_t nl; (nl = pending.find('\n', at)) != std::string::npos; at = nl + 1) {
      line(target, std::string_view(pending).substr(at, nl - at));
    }
    pending.erase(0, at);
  }

  /// mpirun is gone: what is left, as complete lines.
  void finish() {
    for (int target : {1, 2}) {
      std::string& pending = pending_[target == 1 ? 0 : 1];
      if (!pending.empty()) {
        line(target, pending);
        pending.clear();
      }
    }
    for (auto& [key, text] : partial_) {
      if (!text.empty()) {
        emit(key.first, key.second, text);
      }
    }
    partial_.clear();
  }

private:
  struct Tag {
    std::size_t begin = 0, end = 0; // of the tag in the line
    int rank = 0, stream = 1;
  };

  /// The tag at line[at..], if one starts there: "[<digits>,<digits>]<stdout|stderr|stddiag>:".
  static std::optional<Tag> tag_at(std::string_view line, std::size_t at) {
    std::size_t i = at;
    auto digits = [&](long& v) {
      const std::size_t from = i;
      v = 0;
      while (i < line.size() && line[i] >= '0' && line[i] <= '9' && i - from < 9) {
        v = v * 10 + (line[i++] - '0');
      }
      return i > from;
    };
    long job = 0, rank = 0;
    if (i >= line.size() || line[i++] != '[' || !digits(job) || i >= line.size() || line[i++] != ',' ||
        !digits(rank) || line.substr(i, 2) != "]<") {
      return std::nullopt;
    }
    i += 2;
    for (auto [name, stream] : {std::pair{"stdout>:", 1}, {"stderr>:", 2}, {"stddiag>:", 2}}) {
      if (line.substr(i).starts_with(name)) {
        return Tag{at, i + std::strlen(name), static_cast<int>(rank), stream};
      }
    }
    return std::nullopt;
  }

  void line(int target, std::string_view text) {
    std::optional<Tag> tag = tag_at(text, 0);
    if (!tag) {
      write_all(target, std::string(text) + "\n"); // mpirun's own
      return;
    }
    while (tag) {
      // this rank's text runs to the next tag, or to the end of the line (and then ends its line)
      std::optional<Tag> next;
      for (std::size_t k = text.find('[', tag->end); k != std::string_view::npos && !next;
           k = text.find('[', k + 1)) {
        next = tag_at(text, k);
      }
      std::string& part = partial_[{tag->rank, tag->stream}];
      part.append(text.substr(tag->end, (next ? next->begin : text.size()) - tag->end));
      if (!next) {
        emit(tag->rank, tag->stream, part);
        part.clear();
      }
      tag = next;
    }
  }

  void emit(int rank, int stream, std::string_view text) {
    if (!a_.log_dir.empty()) {
      auto& log = logs_[{rank, stream}];
      if (!log) {
        log = std::make_unique<std::ofstream>(a_.log_dir + "/rank_" + std::to_string(rank) +
                                              (stream == 1 ? ".stdout" : ".stderr"));
      }
      *log << text << '\n';
      log->flush();
    }
    if (!a_.ranks_filter.empty() && !a_.ranks_filter.contains(rank)) {
      return;
    }
    const bool prefix = (a_.tee & (stream == 1 ? 1 : 2)) != 0;
    write_all(stream,
              (prefix ? "[rank" + std::to_string(rank) + "]: " : std::string()) + std::string(text) + "\n");
  }

  const Args& a_;
  std::string pending_[2];
  std::map<std::pair<int, int>, std::string> partial_;
  std::map<std::pair<int, int>, std::unique_ptr<std::ofstream>> logs_;
};

/// Runs the job as `mpirun -np N program args` (Open MPI's flags), the ranks on the MPI backend. mpirun
/// forwards signals, stops every rank when one fails and names the first failed process; dtensor-run
/// forwards its own signals to mpirun, turns mpirun's tagged output into its own (MpiOutput) and exits
/// with mpirun's status.
/// One start of the MPI job with `np` ranks (restart `restart`): what run_mpirun returns for it;
/// `interrupted` gets the signal that interrupted dtensor-run, if one did.
int run_mpirun_once(const Args& a, const std::string& mpirun, int np, int restart, int& interrupted) {
  // With restarts the output always goes through dtensor-run (it outlives each mpirun).
  const bool rewrite = a.tee != 0 || !a.log_dir.empty() || !a.ranks_filter.empty() || a.max_restarts > 0;
  std::vector<std::string> args = {mpirun, "-np", std::to_string(np), "--bind-to", "none",
                                   // as dtensor-run: any number of ranks, whatever the cores
                                   "--oversubscribe"};
  if (::geteuid() == 0) {
    args.emplace_back("--allow-run-as-root"); // Open MPI refuses root unless asked (containers)
  }
  if (rewrite) {
    args.emplace_back("--tag-output");
  }
  args.insert(args.end(), a.cmd.begin(), a.cmd.end());
  ::setenv("DTENSOR_RESTART_COUNT", std::to_string(restart).c_str(), 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", std::to_string(restart).c_str(), 1);
  ::setenv("TORCHELASTIC_MAX_RESTARTS", std::to_string(a.max_restarts).c_str(), 1);
  std::vector<char*> argv;
  for (auto& s : args) {
    argv.push_back(s.data());
  }
  argv.push_back(nullptr);
  std::fflush(nullptr);
  if (!rewrite) {
    ::execv(mpirun.c_str(), argv.data());
    die("cannot execute '" + mpirun + "': " + std::strerror(errno), 127);
  }

  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    die("pipe: " + std::string(std::strerror(errno)));
  }
  // mpirun stops its ranks when dtensor-run dies (SIGTERM)
  const pid_t pid = fork_exec(argv.data(), environ, out[1], err[1], false, SIGTERM,
                              "dtensor-run: cannot execute '" + mpirun + "': ");
  ::close(out[1]);
  ::close(err[1]);
  MpiOutput output(a);
  pollfd fds[3] = {{g_signal_pipe[0], POLLIN, 0}, {out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  while (fds[1].fd >= 0 || fds[2].fd >= 0) {
    ::poll(fds, 3, -1);
    if ((fds[0].revents & POLLIN) != 0) {
      char sigs[64];
      const ssize_t n = ::read(g_signal_pipe[0], sigs, sizeof(sigs));
      for (ssize_t k = 0; k < n; ++k) {
        const int sig = static_cast<unsigned char>(sigs[k]);
        if (sig != SIGCHLD) {
          interrupted = sig;
          ::kill(pid, sig); // mpirun forwards it to the ranks
        }
      }
    }
    for (int i : {1, 2}) {
      if (fds[i].fd < 0 || fds[i].revents == 0) {
        continue;
      }
      char buf[65536];
      const ssize_t k = ::read(fds[i].fd, buf, sizeof(buf));
      if (k > 0) {
        output.feed(i, std::string_view(buf, static_cast<std::size_t>(k)));
      } else if (k == 0 || (errno != EINTR && errno != EAGAIN)) {
        ::close(fds[i].fd);
        fds[i].fd = -1; // poll ignores negative descriptors
      }
    }
  }
  output.finish();
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (interrupted != 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    std::fprintf(stderr, "dtensor-run: interrupted by %s; mpirun ended with %s\n",
                 signal_name(interrupted).c_str(), describe_status(status).c_str());
    return 128 + interrupted; // as the own launch: 128+signal when dtensor-run itself was interrupted
  }
  return exit_code_of(status);
}

int run_mpirun(const Args& a) {
  if (a.nnodes != 1) {
    die("--backend mpi: dtensor-run starts an MPI job on one machine only (--nnodes 1); across machines "
        "start it with mpirun (a hostfile) or srun --mpi=pmix");
  }
  if (a.replica_size > 0) {
    die("--backend mpi: an MPI job ends with any of its ranks, so --replica-size needs --backend gloo (or "
        "nccl)");
  }
  if (a.own_launch_only) {
    die("--backend mpi: --rank0-store and --store-bind-addr are about dtensor-run's TCP store; MPI jobs "
        "meet through MPI (leave them out, or use --backend gloo)");
  }
  const std::string mpirun = find_mpirun();
  if (mpirun.empty()) {
    die("--backend mpi: mpirun is not found (PATH, or DTENSOR_MPIRUN); install openmpi-bin, or use "
        "--backend gloo");
  }
  // The ranks meet through MPI: no torchrun variables, which would take precedence over mpirun's.
  for (const char* v :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DTENSOR_USE_AGENT_STORE"}) {
    ::unsetenv(v);
  }
  ::setenv("DTENSOR_BACKEND", "mpi", 1);
  if (a.nproc_per_node > 1) {
    ::setenv("OMP_NUM_THREADS", "1", 0); // as torchrun: N ranks on one machine share its cores
  }
  if (!a.log_dir.empty()) {
    ::mkdir(a.log_dir.c_str(), 0755);
  }
  install_handlers();
  // mpirun ends the job at the first failed rank and does not say which: an elastic restart runs one fewer.
  int np = a.nproc_per_node;
  for (int restart = 0;; ++restart) {
    int interrupted = 0;
    const int code = run_mpirun_once(a, mpirun, np, restart, interrupted);
    if (code == 0 || interrupted != 0 || restart >= a.max_restarts) {
      if (code != 0 && a.max_restarts > 0 && interrupted == 0) {
        std::fprintf(stderr, "dtensor-run: %s; giving up\n",
                     no_restart_left(restart, a.max_restarts).c_str());
      }
      return code;
    }
    const int before = np;
    np = a.min_nproc > 0 ? std::max(a.min_nproc, np - 1) : np;
    std::fprintf(stderr, "dtensor-run: mpirun ended with code %d; restart %d of %d: starting %d rank(s)%s\n",
                 code, restart + 1, a.max_restarts, np, np < before ? " (one fewer: elastic)" : "");
  }
}

} // namespace

int main(int argc, char** argv) {
  Args args = parse(argc, argv);
  if (through_mpirun(args)) {
    if (args.backend == "auto") {
      std::fprintf(stderr,
                   "dtensor-run: %s links MPI: starting its %d rank(s) through mpirun, on the MPI "
                   "backend (--backend gloo for dtensor-run's own launch on gloo)\n",
                   args.cmd[0].c_str(), args.nproc_per_node);
    }
    return run_mpirun(args);
  }
  Launcher launcher(std::move(args));
  return launcher.run();
}
